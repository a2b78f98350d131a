"""The model's linear layer, and the seam where kernels plug into it.

`Linear` holds its weight and bias as parameters (Hugging Face names, `.weight` and
`.bias`) and computes y = x @ weight.T + bias with the `LinearKernel` the worker attached
to it (plain `F.linear` until then). A kernel is an explicit per-layer object (a packed
copy of the weight, small-batch C kernels, later quantized weights or LoRA terms), never
state hidden on the module. This module knows no kernel: the worker makes them
(worker/cpu/linear_kernels.py, worker/cpu/quantized_linears.py, worker/lora/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearKernel(Protocol):
    """Computes one layer's x @ weight.T + bias."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


LinearKernelFactory = Callable[[torch.Tensor, "torch.Tensor | None"], LinearKernel]
"""(weight, bias) -> the kernel of a layer; called after the weights are loaded."""


class Linear(nn.Module):
    """A linear layer whose matmul is done by the kernel attached to it."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.kernel: LinearKernel | None = None
        """Set by `attach_linear_kernels`; None computes with F.linear."""

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        """The bias the kernel adds (a row-parallel layer adds its own after the sum)."""
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class LoRAPart:
    """One Hugging Face module inside a (possibly fused) linear layer of this rank: where its
    output lies in the layer's output, and which slice of an adapter's tensors this rank
    takes (column-parallel: rows of B, the module's output features; row-parallel: columns
    of A, its input features; None: all)."""

    module: str
    """PEFT's name, e.g. 'k_proj'."""
    columns: tuple[int, int]
    """[first, last) output column of the layer's (rank-local) output."""
    b_rows: tuple[int, int] | None = None
    a_columns: tuple[int, int] | None = None


@dataclass(frozen=True)
class LoRATarget:
    """A linear layer an adapter may change: q/k/v stacked in the fused qkv_proj, gate/up in
    gate_up_proj, o_proj and down_proj alone."""

    layer: int
    """Index of its decoder layer in the whole model."""
    name: str
    """The layer's parameter name, e.g. 'qkv_proj'."""
    linear: "Linear"
    parts: tuple[LoRAPart, ...]


def attach_linear_kernels(model: nn.Module, factory: LinearKernelFactory | None) -> int:
    """Give every Linear of `model` its kernel from `factory` (None: plain F.linear).
    Returns how many layers got one."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = (None if factory is None
                             else factory(module.weight, module.kernel_bias))
            count += module.kernel is not None
    return count
