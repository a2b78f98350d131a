"""The plain Llama decoder layer as a fused kernel sees it: what a model declares so that
the worker can run its layers in one call without knowing the model's classes.

A `PlainLayer` is a pre-norm layer of exactly this shape: x = RMSNorm(h); q, k, v from
one fused projection; RoPE (rotate_half) on q and k; causal attention over the whole
context with the layer's scale (no per-head q/k norms, no sliding window, no softcap);
h += o(attention); x = RMSNorm(h); h += down(silu(gate) * up) from one fused gate/up
projection. A model whose every layer has that shape answers `plain_decoder()` with a
`PlainDecoder` (its layers and the final norm, the model's own modules with their kernels
attached, never copies); any other model answers None. The fused kernel's own conditions
(dtype, kernels, cache layout, ranks) are the worker's to check (worker/cpu/
decode_stack.py); nothing here runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.layers.linear import Linear
from treadle.layers.norm import RMSNorm


@dataclass(frozen=True)
class PlainLayer:
    """One plain decoder layer's modules (see the module docstring)."""

    input_norm: RMSNorm
    post_attention_norm: RMSNorm
    qkv: Linear
    """q, k and v stacked: [num_heads + 2 * num_kv_heads] * head_dim output features."""
    o: Linear
    gate_up: Linear
    """gate, then up: 2 * intermediate output features."""
    down: Linear
    scale: float
    """The attention's softmax scale."""
    intermediate: int
    """MLP columns of this rank."""


@dataclass(frozen=True)
class PlainDecoder:
    """Every layer of a stage in the plain shape, in order, and the final norm after them."""

    layers: tuple[PlainLayer, ...]
    final_norm: RMSNorm
