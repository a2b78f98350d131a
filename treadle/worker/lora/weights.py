"""An adapter's weights as the LoRA layers use them, and reading them from a PEFT folder.

Owns the layout: per target layer of this rank (layers.linear.LoRATarget, a fused layer
such as qkv_proj), the A matrices of the modules the adapter has there stacked into one
[sum of ranks, in_features] tensor (one shrink matmul for q, k and v together), and per
module its B [out_features, rank] with the module's scaling folded in and the output
columns it adds to. Tensor parallelism splits them like the base layer: a column-parallel
layer takes B's rows of this rank's output features, a row-parallel one A's columns of its
input features (the partial sums are all-reduced with the base layer's). Reading checks
the files again (treadle/lora.py) and reads only this rank's slices of this stage's
layers. It decides nothing about when an adapter is loaded or evicted (manager.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.lora import LoRAError, LoRARequest, inspect_adapter
from treadle.layers.linear import LoRATarget


@dataclass
class PartWeights:
    """One module's term in a target layer: y[:, columns] += t[:, ranks] @ b.T."""

    columns: tuple[int, int]
    ranks: tuple[int, int]
    """[first, last) rows of the target's stacked A (columns of its shrink output t)."""
    b: torch.Tensor
    """[out_features (this rank's), rank], scaled."""


@dataclass
class TargetWeights:
    """An adapter's weights for one target layer."""

    a: torch.Tensor
    """[sum of the parts' ranks, in_features (this rank's)]."""
    parts: tuple[PartWeights, ...]


@dataclass
class AdapterWeights:
    """One adapter's weights on one device: target index -> its weights there."""

    lora: LoRARequest
    targets: dict[int, TargetWeights]
    packed: object = None
    """A kernel's own layout of these weights, made when first needed (native_ops.py);
    it lives as long as this object (the adapter's slot)."""

    @property
    def num_bytes(self) -> int:
        return sum(t.a.numel() * t.a.element_size()
                   + sum(p.b.numel() * p.b.element_size() for p in t.parts)
                   for t in self.targets.values())

    def round_to(self, dtype: torch.dtype) -> None:
        """Round every weight to `dtype`'s precision in place (keeping its own dtype)."""
        for target in self.targets.values():
            for tensor in (target.a, *(p.b for p in target.parts)):
                tensor.copy_(tensor.to(dtype))

    def to(self, device: torch.device) -> "AdapterWeights":
        """A copy on `device` (the same tensors when they are there already)."""
        return AdapterWeights(self.lora, {
            i: TargetWeights(t.a.to(device), tuple(
                PartWeights(p.columns, p.ranks, p.b.to(device)) for p in t.parts))
            for i, t in self.targets.items()})


def _read(handle, name: str, dim: int | None, span: tuple[int, int] | None) -> torch.Tensor:
    if span is None:
        return handle.get_tensor(name)
    piece = handle.get_slice(name)
    return piece[span[0]:span[1]] if dim == 0 else piece[:, span[0]:span[1]]


def load_adapter(lora: LoRARequest, targets: list[LoRATarget],
                 module_shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
                 dtype: torch.dtype, pin_memory: bool = False) -> AdapterWeights:
    """Read an adapter's slices for `targets` (this rank's layers) into host memory in
    `dtype`. Raises LoRAError when the files do not fit the model."""
    from safetensors import safe_open

    spec = inspect_adapter(lora.lora_path, module_shapes, num_layers, max_rank)
    weights: dict[int, TargetWeights] = {}
    try:
        with safe_open(spec.weights_file, framework="pt") as handle:
            for index, target in enumerate(targets):
                a_parts, parts, rank0 = [], [], 0
                for part in target.parts:
                    module = spec.modules.get((target.layer, part.module))
                    if module is None:
                        continue
                    a = _read(handle, module.a_name, 1, part.a_columns).float()
                    b = _read(handle, module.b_name, 0, part.b_rows).float()
                    b.mul_(module.scaling)
                    a_parts.append(a.to(dtype))
                    parts.append(PartWeights(part.columns, (rank0, rank0 + module.rank),
                                             b.to(dtype).contiguous()))
                    rank0 += module.rank
                if parts:
                    a = torch.cat(a_parts).contiguous()
                    if pin_memory:
                        a = a.pin_memory()
                        parts = [PartWeights(p.columns, p.ranks, p.b.pin_memory())
                                 for p in parts]
                    weights[index] = TargetWeights(a, tuple(parts))
    except (OSError, RuntimeError) as exc:
        raise LoRAError(f"adapter {lora.lora_name!r}: reading {spec.weights_file} failed: "
                        f"{exc}") from None
    return AdapterWeights(lora, weights)
