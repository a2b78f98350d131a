"""RMSNorm, and the seam where fused elementwise kernels plug into a layer.

Owns the norm's parameter (`RMSNorm`: weight and epsilon, Hugging Face's names), its
torch computation (`rms_norm`: normalized in float32, cast back, then scaled, as
transformers does for Llama) and `add_rms_norm` (the residual add and the norm, one
fused call through `LayerOps` where the worker attached them: worker/cpu/native_linear.py
`NativeLayerOps`). It knows no kernel and no device.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class LayerOps(Protocol):
    """Fused elementwise kernels (worker/cpu/native_linear.py NativeLayerOps); each returns None
    where it does not apply."""

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> torch.Tensor | None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None: ...

    # Gemma 3's layer steps (models/gemma3.py): norms that scale by (1 + weight).
    def gemma_add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                       delta_weight: torch.Tensor | None, weight: torch.Tensor | None,
                       eps: float) -> torch.Tensor | bool | None: ...

    def gemma_head_norms(self, qkv: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, heads: int, kv_heads: int,
                         eps: float) -> bool: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalized in float32, cast back, then scaled (as HF)."""
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(variance.add_(eps))
    return normed.to(x.dtype).mul_(weight)  # a fresh tensor either way: safe in place


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm,
                 ops: LayerOps | None) -> torch.Tensor:
    """`hidden += delta` in place (when delta is given), then rms_norm(hidden): one fused
    call through `ops` where it applies."""
    if ops is not None:
        out = ops.add_rms_norm(hidden, delta, norm.weight, norm.eps)
        if out is not None:
            return out
    if delta is not None:
        hidden.add_(delta)
    return rms_norm(hidden, norm.weight, norm.eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
