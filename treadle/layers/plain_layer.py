"""The decoder layer shapes a fused kernel runs: what a model declares so that the worker
can run its layers in one call without knowing the model's classes. Two shapes: the plain
Llama layer, and Gemma 3's sandwich layer (below).

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

from typing import Any

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


@dataclass(frozen=True)
class SandwichLayer:
    """One Gemma 3 layer as the fused kernel runs it (worker/cpu/gemma_stack.py): norms
    before and after each sublayer, each scaling by (1 + weight) (models/gemma3.py
    GemmaRMSNorm: `weight` and `eps`); q, k, v from one fused projection; per-head
    RMSNorms of q and k; RoPE (rotate_half) with its kind's base; causal attention over the
    whole context or the last `window` positions, with `scale` and no softcap; h +=
    post_attn_norm(o(attention)); h += post_ffw_norm(down(gelu_tanh(gate) * up))."""

    input_norm: Any
    post_attention_norm: Any
    pre_feedforward_norm: Any
    post_feedforward_norm: Any
    q_norm: Any
    k_norm: Any
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    scale: float
    intermediate: int
    window: int | None
    """The sliding window (a local layer: the KV manager's sliding group), or None."""


@dataclass(frozen=True)
class SandwichDecoder:
    """Every layer of a stage in the sandwich shape, and the final norm (a Gemma norm)."""

    layers: tuple[SandwichLayer, ...]
    final_norm: Any
