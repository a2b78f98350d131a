"""The Gemma 3 text decoder (`Gemma3ForCausalLM`) over the engine's flat batch.

What differs from the Llama family (models/llama.py), as transformers defines Gemma 3:
the embedding is scaled by sqrt(hidden_size) (rounded to the model's dtype); each layer
has four RMSNorms (before and after attention, before and after the MLP), every norm
(q/k norms included) scales by (1 + weight) and casts to the dtype after the scaling;
queries and keys get per-head RMSNorms before RoPE; the MLP is GeGLU (tanh-approximated
GELU); queries are scaled by `query_pre_attn_scalar ** -0.5`; layers are local (a
sliding window, RoPE base `rope_local_base_freq` / rope_parameters["sliding_attention"])
or global (the whole context, rope_parameters["full_attention"]), by `layer_types` or
every `sliding_window_pattern`-th layer global; optional tanh softcaps on the attention
scores (`attn_logit_softcapping`) and on the final logits (`final_logit_softcapping`);
the LM head is tied to the embedding by default.

The loading, kernel attachment, tensor parallelism and adapter targets are the Llama
class's (same fused `qkv_proj` / `gate_up_proj` parameter names); this module only owns
the layers and the forward pass. `layer_windows` tells the worker which layers slide
(the KV manager's layer groups).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from treadle.layers.attention import AttentionLayer
from treadle.layers.linear import Linear
from treadle.layers.norm import LayerOps
from treadle.layers.parallel import ParallelContext
from treadle.layers.plain_layer import SandwichDecoder, SandwichLayer
from treadle.layers.rotary import RotaryEmbedding, RotaryInputs
from treadle.layers.tensor_parallel import RowParallelLinear, ShardGeometry, VocabParallelEmbedding
from treadle.models.llama import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalized and scaled by (1 + weight) in float32, then cast."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gemma_add_norm(hidden: torch.Tensor, delta: torch.Tensor | None,
                   delta_norm: GemmaRMSNorm | None, norm: GemmaRMSNorm | None,
                   ops: LayerOps | None) -> torch.Tensor | None:
    """`hidden += delta_norm(delta)` in place (when delta is given), then norm(hidden)
    (None without `norm`): one fused call through `ops` where it applies (the decode
    stack, worker/cpu/gemma_stack.py, runs the same kernel)."""
    if ops is not None:
        out = ops.gemma_add_norm(hidden, delta,
                                 None if delta_norm is None else delta_norm.weight,
                                 None if norm is None else norm.weight,
                                 (norm or delta_norm).eps)
        if out is not None:
            return None if out is True else out
    if delta is not None:
        hidden.add_(delta_norm(delta))
    return None if norm is None else norm(hidden)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's kind: config.json's `layer_types`, else every `sliding_window_pattern`-th
    layer full (transformers' rule for older configs; 6 by default)."""
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} or "
                         f"{FULL!r}, got {types!r}")
    return types


def rope_configs(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rope settings of each layer kind as a config dict layers/rotary.py reads."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        full = dict(params.get(FULL) or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = dict(params.get(SLIDING) or {})
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        return {FULL: {"rope_parameters": full}, SLIDING: {"rope_parameters": local}}
    return {FULL: {"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                   "rope_scaling": cfg.get("rope_scaling")},
            SLIDING: {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}}


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], dims: dict[str, Any], dtype: torch.dtype,
                 layer_index: int, window: int | None) -> None:
        super().__init__()
        shard: ShardGeometry = dims["shard"]
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = d = dims["head_dim"]
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        bias = bool(cfg.get("attention_bias", False))
        hidden = dims["hidden_size"]
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, hidden, bias, dtype, dims["parallel"])
        self.q_norm = GemmaRMSNorm(d, dims["eps"], dtype)
        self.k_norm = GemmaRMSNorm(d, dims["eps"], dtype)
        scalar = float(cfg.get("query_pre_attn_scalar") or d)
        softcap = cfg.get("attn_logit_softcapping")
        self.ops: LayerOps | None = None
        """Fused kernels (set_kernels), or None: torch only."""
        self.attn = AttentionLayer(self.num_heads, self.num_kv_heads, d, scalar ** -0.5,
                                   layer_index, sliding_window=window,
                                   logit_softcap=None if softcap is None else float(softcap))

    def forward(self, x: torch.Tensor, rotary: RotaryInputs, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        if self.ops is not None and self.ops.gemma_head_norms(
                qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads,
                self.num_kv_heads, self.q_norm.eps):
            qk = qkv[:, :qk_size].view(n, self.num_heads + self.num_kv_heads, d)
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(n, self.num_heads, d))
            k = self.k_norm(qkv[:, self.q_size:qk_size].view(n, self.num_kv_heads, d))
            qk = torch.cat((q, k), dim=1)
        value = qkv[:, qk_size:].view(n, self.num_kv_heads, d)
        return self.o_proj(self.attn(qk, value, kv_cache, meta, rotary))


class Gemma3MLP(nn.Module):
    def __init__(self, dims: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden = dims["hidden_size"]
        self.intermediate = dims["shard"].intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, False, dtype)
        self.down_proj = RowParallelLinear(self.intermediate, hidden, False, dtype,
                                           dims["parallel"])
        self.ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = None if self.ops is None else self.ops.gelu_tanh_mul(gate_up)
        if h is None:
            h = F.gelu(gate_up[:, :self.intermediate], approximate="tanh")
            h.mul_(gate_up[:, self.intermediate:])
        return self.down_proj(h)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], dims: dict[str, Any], dtype: torch.dtype,
                 layer_index: int, window: int | None) -> None:
        super().__init__()
        hidden, eps = dims["hidden_size"], dims["eps"]
        self.is_sliding = window is not None
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Gemma3Attention(cfg, dims, dtype, layer_index, window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = Gemma3MLP(dims, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.ops: LayerOps | None = None

    def forward(self, hidden: torch.Tensor, rotary: RotaryInputs, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """hidden is the residual stream, owned by the caller's forward: updated in place."""
        x = gemma_add_norm(hidden, None, None, self.input_layernorm, self.ops)
        attn = self.self_attn(x, rotary, kv_cache, meta)
        x = gemma_add_norm(hidden, attn, self.post_attention_layernorm,
                           self.pre_feedforward_layernorm, self.ops)
        gemma_add_norm(hidden, self.mlp(x), self.post_feedforward_layernorm, None, self.ops)
        return hidden


class Gemma3Model(nn.Module):
    """The layers of this pipeline stage, the embedding on the first, the norm on the last."""

    def __init__(self, cfg: dict[str, Any], dims: dict[str, Any], dtype: torch.dtype,
                 layers: range, windows: list[int | None], first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.embed_tokens = VocabParallelEmbedding(dims["shard"], dims["hidden_size"],
                                                       dtype, dims["parallel"])
        self.layers = nn.ModuleDict(
            {str(i): Gemma3DecoderLayer(cfg, dims, dtype, i, windows[i]) for i in layers})
        if last:
            self.norm = GemmaRMSNorm(dims["hidden_size"], dims["eps"], dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text-only causal LM on a flat, unpadded batch."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        nn.Module.__init__(self)
        cfg = hf_config
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or _ACTIVATIONS[0]
        if activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation {activation!r} is not supported for Gemma 3; "
                             f"only {', '.join(_ACTIVATIONS)}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true (embedding Gemma) is not "
                             "supported: treadle serves causal language models")
        parallel = self._set_geometry(cfg, "gemma3", dtype, parallel,
                                      default_max_position=131072)
        hidden = self.hidden_size
        window = cfg.get("sliding_window")
        window = None if window is None else int(window)
        self.layer_kinds = layer_types(cfg)
        self.layer_windows: list[int | None] = [
            window if kind == SLIDING else None for kind in self.layer_kinds]
        """Per layer of the whole model: its sliding window, or None (global)."""
        self.sliding_window = window if any(self.layer_windows) else None
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        softcap = cfg.get("final_logit_softcapping")
        self.final_logit_softcap = None if softcap is None else float(softcap)
        dims = {"hidden_size": hidden, "head_dim": self.head_dim, "shard": self.shard,
                "parallel": parallel, "eps": float(cfg.get("rms_norm_eps", 1e-6))}
        first, last = parallel.is_first_stage, parallel.is_last_stage
        self.model = Gemma3Model(cfg, dims, dtype, range(*self.layer_range),
                                 self.layer_windows, first, last)
        if last and not (self.tie_word_embeddings and first):
            self.lm_head = Linear(hidden, self.shard.vocab_per_rank, False, dtype)
        ropes = rope_configs(cfg)
        self.rotary = RotaryEmbedding(ropes[FULL], self.head_dim,
                                      self.max_position_embeddings, dtype)
        self.local_rotary = RotaryEmbedding(ropes[SLIDING], self.head_dim,
                                            self.max_position_embeddings, dtype)
        # transformers multiplies by sqrt(hidden) held in the weights' dtype: round it so.
        self.embed_scale = float(torch.tensor(hidden ** 0.5, dtype=dtype, device="cpu"))
        self.lm_head_kernel = None
        self.ops = None

    keeps_rows = False  # its forward computes every row

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: Any,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward; local layers rotate with the local RoPE base."""
        if len(kv_caches) != self.num_local_layers:
            raise ValueError(f"expected {self.num_local_layers} KV caches, got {len(kv_caches)}")
        rotary = RotaryInputs(*self.rotary.cos_sin(positions, self.dtype))
        local = RotaryInputs(*self.local_rotary.cos_sin(positions, self.dtype))
        if self.parallel.is_first_stage:
            hidden = self.model.embed_tokens(input_ids) * self.embed_scale
            if self.decode_stack is not None and self.parallel.is_last_stage:
                out = self.decode_stack(hidden, rotary, kv_caches, attn_metadata, local)
                if out is not None:
                    return out
        for layer, kv_cache in zip(self.model.layers.values(), kv_caches):
            hidden = layer.forward(hidden, local if layer.is_sliding else rotary, kv_cache,
                                   attn_metadata)
        if not self.parallel.is_last_stage:
            return hidden
        return gemma_add_norm(hidden, None, None, self.model.norm, self.ops)

    def sandwich_decoder(self) -> SandwichDecoder | None:
        """This stage's layers as a fused kernel may run them (layers/plain_layer.py), on
        the last stage and without softcaps; None otherwise."""
        if not self.parallel.is_last_stage or not self.parallel.is_first_stage:
            return None
        plain = []
        for layer in self.model.layers.values():
            attn, mlp = layer.self_attn, layer.mlp
            if attn.attn.logit_softcap is not None:
                return None
            plain.append(SandwichLayer(
                layer.input_layernorm, layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm,
                attn.q_norm, attn.k_norm, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                mlp.down_proj, attn.attn.scale, mlp.intermediate, attn.attn.sliding_window))
        return SandwichDecoder(tuple(plain), self.model.norm) if plain else None

    def set_kernels(self, linear_kernels: Any, ops: LayerOps | None) -> int:
        count = super().set_kernels(linear_kernels, ops)
        for module in self.modules():
            if isinstance(module, (Gemma3DecoderLayer, Gemma3Attention, Gemma3MLP)):
                module.ops = ops
        return count

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head kernel's argmax when there is no final softcap (Gemma 3's configs
        have none): a softcap's tanh could round distinct logits into ties."""
        return None if self.final_logit_softcap is not None else self.head_argmax(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
