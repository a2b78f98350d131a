"""The C LoRA kernel (kernels/lora_bf16.c) as the LoRA layers' ops: every small adapter
segment of a layer in one call, long ones with torch.

Owns the kernel's layout of an adapter, made once per resident adapter (per target its
stacked A and each part's B transposed, `[rank, out]`, both bf16, so a decode step reads
half the bytes of the fp32 weights the torch path keeps), and per step the table of
segments of every target (one numpy fill per step: a layer's call is then one ctypes
call). A segment of more than `max_rows` rows (a prompt chunk) is compute-bound, where
torch's fp32 matmuls win: it goes through the torch path (`apply_segments`). Used for
bf16 models on CPUs with AVX-512 or AVX2 (`load` answers None elsewhere and the manager
keeps TorchLoRAOps); it never decides which adapters run.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from treadle.worker.lora.layers import apply_segments
from treadle.worker.lora.weights import AdapterWeights

MAX_ROWS = 64
"""Segments up to this many rows use the C kernel; longer ones torch (docs/lora.md)."""
_MAX_PARTS = 3
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class NativeLoRAOps:
    """Segments of up to `max_rows` rows in one C call per layer; the rest with torch."""

    name = "C"
    weight_precision = torch.bfloat16
    """The manager rounds adapters to bf16 at load, so the torch path of long segments
    uses the kernel's values."""

    def __init__(self, lib: ctypes.CDLL, num_targets: int, max_rows: int = MAX_ROWS) -> None:
        self._fn = lib.lora_bf16
        self._fn.argtypes = [_P, _I64, _I64, _P, _I64, _P, _I64, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        lib.lora_seg_fields.restype = ctypes.c_int
        lib.lora_max_stacked_rank.restype = ctypes.c_int
        self.fields = lib.lora_seg_fields()
        self.max_stacked_rank = lib.lora_max_stacked_rank()
        self.num_targets = num_targets
        self.max_rows = max_rows
        self._tables: np.ndarray | None = None
        self._num_small = 0
        self._large: list[tuple[AdapterWeights, int, int]] = []

    @classmethod
    def load(cls, lib: ctypes.CDLL | None, num_targets: int,
             max_rows: int = MAX_ROWS) -> "NativeLoRAOps | None":
        """The kernel of `lib`, or None when it has none or was built without a vector
        unit (the C function answers -1 then: probed on an empty call)."""
        if lib is None or not hasattr(lib, "lora_bf16"):
            return None
        ops = cls(lib, num_targets, max_rows)
        empty = np.zeros((1, ops.fields), dtype=np.int64)
        return ops if ops._fn(None, 0, 0, None, 0, empty.ctypes.data, 0, 1) == 0 else None

    def _table(self, adapter: AdapterWeights) -> np.ndarray:
        """The adapter's segment row for every target (row0 and nrows left 0), made once
        per resident adapter; the packed tensors live as long as the adapter's weights."""
        if adapter.packed is not None:
            return adapter.packed[0]
        table = np.zeros((self.num_targets, self.fields), dtype=np.int64)
        keep = []
        for index, weights in adapter.targets.items():
            if weights.a.shape[0] > self.max_stacked_rank or len(weights.parts) > _MAX_PARTS:
                raise ValueError("the C LoRA kernel takes a stacked rank of at most "
                                 f"{self.max_stacked_rank} and {_MAX_PARTS} modules per layer")
            a = weights.a.to(torch.bfloat16).contiguous()
            keep.append(a)
            table[index, 2:5] = (a.data_ptr(), a.shape[0], len(weights.parts))
            for k, part in enumerate(weights.parts):
                bt = part.b.t().to(torch.bfloat16).contiguous()  # [rank, out]
                keep.append(bt)
                table[index, 5 + 5 * k:10 + 5 * k] = (
                    part.columns[0], part.columns[1] - part.columns[0], part.ranks[0],
                    part.ranks[1] - part.ranks[0], bt.data_ptr())
        adapter.packed = (table, keep)
        return table

    def prepare(self, segments: list[tuple[AdapterWeights, int, int]]) -> None:
        """The step's segment tables: [targets, small segments, fields], filled once."""
        small = [(a, s, e) for a, s, e in segments if e - s <= self.max_rows]
        self._large = [(a, s, e) for a, s, e in segments if e - s > self.max_rows]
        self._num_small = len(small)
        if not small:
            self._tables = None
            return
        tables = np.stack([self._table(a) for a, _, _ in small], axis=1)
        tables[:, :, 0] = [s for _, s, _ in small]
        tables[:, :, 1] = [e - s for _, s, e in small]
        self._tables = np.ascontiguousarray(tables)

    def apply_layer(self, index: int, x: torch.Tensor, y: torch.Tensor,
                    segments: list[tuple[AdapterWeights, int, int]]) -> None:
        """Add target `index`'s terms of the prepared segments to y."""
        if self._tables is not None:
            if x.dtype != torch.bfloat16 or y.dtype != torch.bfloat16 \
                    or x.stride(1) != 1 or y.stride(1) != 1:
                raise ValueError("the C LoRA kernel needs bf16 tensors with dense rows, got "
                                 f"{x.dtype} / {y.dtype}")
            table = self._tables[index]
            if self._fn(x.data_ptr(), x.stride(0), x.shape[1], y.data_ptr(), y.stride(0),
                        table.ctypes.data, self._num_small, 0) != 0:
                raise RuntimeError("lora_bf16 failed (stacked rank or parts over the limit)")
        if self._large:
            apply_segments(x, y, [(a.targets[index], s, e) for a, s, e in self._large
                                  if index in a.targets])
