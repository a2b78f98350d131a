"""Checkpoint tensors by name, read whole or by slices, with the bytes read counted.

A model's `load_weights` asks a `WeightSource` for the tensors it needs: whole, or only
the rows or columns of its tensor-parallel shard (`read(name, dim, start, stop)`), cast
to its dtype. `SafetensorsSource` reads slices straight from the files
(safetensors' `get_slice`), so a rank never materializes the tensors it does not hold;
`TensorSource` serves tensors already in memory (a state dict, a converted checkpoint).
`num_bytes_read` counts what was read, in the file's dtype: the sharded-loading test
checks that every slice is read once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

import torch
from safetensors import safe_open


class WeightSource(Protocol):
    num_bytes_read: int

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """The tensor, or its [start, stop) range along `dim`, cast to the source's dtype."""


def _index(ndim: int, dim: int | None, start: int, stop: int | None) -> tuple:
    if dim is None:
        return (slice(None),) * ndim
    return tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))


class SafetensorsSource:
    """Tensors of safetensors files, read lazily and by slices."""

    def __init__(self, files: Iterable[Path], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.num_bytes_read = 0
        self._handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        handle = self._where[name]
        if dim is None:
            tensor = handle.get_tensor(name)
        else:
            part = handle.get_slice(name)
            tensor = part[_index(len(part.get_shape()), dim, start, stop)]
        self.num_bytes_read += tensor.numel() * tensor.element_size()
        return tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)


class TensorSource:
    """Tensors already in memory."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]],
                 dtype: torch.dtype | None = None) -> None:
        self.tensors = dict(tensors)
        self.dtype = dtype
        self.num_bytes_read = 0

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        tensor = self.tensors[name]
        tensor = tensor[_index(tensor.dim(), dim, start, stop)]
        self.num_bytes_read += tensor.numel() * tensor.element_size()
        return tensor if self.dtype is None or tensor.dtype == self.dtype else tensor.to(self.dtype)
