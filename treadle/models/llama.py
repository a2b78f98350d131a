"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the engine's flat batch.

Owns the model's parameters in fused form (one `qkv_proj` and one `gate_up_proj` per
layer), the forward pass over a flat batch of tokens (all requests concatenated, no
padding, one position per token), the logits, and the mapping of Hugging Face weight
names onto the fused parameters. Attention over the paged KV cache is delegated to
`treadle.worker.attention`; this module never builds attention metadata, picks tokens or
samples. It takes the checkpoint's parsed config.json dict, not a transformers config
object, so it does not depend on the transformers version.

Kernels are handed in by the worker and never chosen here (`set_kernels`): one
`LinearKernel` per linear layer (models/linear.py), and optionally elementwise ops
(`LayerOps`: fused residual-add + RMSNorm, silu(gate) * up; each returns None where it
does not apply, and the torch code below runs instead). Attention is one
`AttentionLayer` call per layer with un-rotated queries and keys; the attention backend
does the rest.

Family switches (as transformers defines them): Qwen2 always has q/k/v biases; Qwen3
applies a per-head RMSNorm (`q_norm`, `k_norm`) to queries and keys before RoPE; Llama
and Qwen3 read `attention_bias`, Llama reads `mlp_bias`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treadle.models.linear import Linear, LinearKernelFactory, attach_linear_kernels
from treadle.models.rope import RotaryEmbedding, RotaryInputs
from treadle.worker.attention import AttentionLayer

_ARCH_TO_FAMILY = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
}
# tie_word_embeddings when config.json does not say (transformers' per-family default).
_TIE_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False}


def _family(hf_config: dict[str, Any]) -> str:
    model_type = hf_config.get("model_type")
    if model_type in _TIE_DEFAULT:
        return model_type
    for arch in hf_config.get("architectures") or []:
        if arch in _ARCH_TO_FAMILY:
            return _ARCH_TO_FAMILY[arch]
    return "llama"


class LayerOps(Protocol):
    """Fused elementwise kernels (worker.native_linear.NativeLayerOps); each returns None
    where it does not apply."""

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> torch.Tensor | None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None: ...


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


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Linear:
    return Linear(in_features, out_features, bias, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, int],
                 dtype: torch.dtype, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = dims["num_heads"], dims["num_kv_heads"]
        self.head_dim = dims["head_dim"]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = True if family == "qwen2" else attention_bias
        o_bias = False if family in ("qwen2", "mistral") else attention_bias
        hidden = dims["hidden_size"]
        self.qkv_proj = _linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = _linear(self.q_size, hidden, o_bias, dtype)
        self.eps = dims["eps"]
        self.attn = AttentionLayer(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.scale, layer_index)
        if family == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, self.eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, self.eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rotary: RotaryInputs, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :qk_size].view(num_tokens, heads, self.head_dim)
        value = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Per-head norms of queries and keys in one pass, with a [heads, head_dim] weight.
            weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                                self.k_norm.weight.expand(self.num_kv_heads, -1)))
            qk = rms_norm(qk, weight, self.eps)
        return self.o_proj(self.attn(qk, value, kv_cache, meta, rotary))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], family: str, hidden: int, intermediate: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(cfg.get("mlp_bias", False)) if family == "llama" else False
        self.intermediate = intermediate
        self.gate_up_proj = _linear(hidden, 2 * intermediate, bias, dtype)
        self.down_proj = _linear(intermediate, hidden, bias, dtype)
        self.ops: LayerOps | None = None
        """Fused elementwise kernels (see LlamaForCausalLM.set_kernels), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = None if self.ops is None else self.ops.silu_mul(gate_up)
        if h is None:
            h = F.silu(gate_up[:, :self.intermediate])
            h.mul_(gate_up[:, self.intermediate:])
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, int],
                 dtype: torch.dtype, layer_index: int) -> None:
        super().__init__()
        hidden, eps = dims["hidden_size"], dims["eps"]
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = Attention(cfg, family, dims, dtype, layer_index)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = MLP(cfg, family, hidden, dims["intermediate_size"], dtype)
        self.ops: LayerOps | None = None
        """Fused elementwise kernels (see LlamaForCausalLM.set_kernels), or None."""

    def forward(self, hidden: torch.Tensor, rotary: RotaryInputs, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """hidden is the residual stream, owned by the caller's forward: updated in place."""
        x = add_rms_norm(hidden, None, self.input_layernorm, self.ops)
        attn = self.self_attn.forward(x, rotary, kv_cache, meta)
        x = add_rms_norm(hidden, attn, self.post_attention_layernorm, self.ops)
        hidden.add_(self.mlp.forward(x))
        return hidden


class DecoderModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, int],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(dims["vocab_size"], dims["hidden_size"], dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, family, dims, dtype, i) for i in range(dims["num_layers"]))
        self.norm = RMSNorm(dims["hidden_size"], dims["eps"], dtype)


# HF name pieces that land in a slice of a fused parameter: piece -> (fused piece, shard).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_FUSED_NAME = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM on a flat, unpadded batch."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        cfg = hf_config
        family = _family(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        self.family = family
        self.dtype = dtype
        self.num_layers = int(cfg["num_hidden_layers"])
        self.num_heads = num_heads
        self.num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        self.head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        self.hidden_size = hidden
        self.vocab_size = int(cfg["vocab_size"])
        self.max_position_embeddings = int(cfg.get("max_position_embeddings") or 2048)
        if family == "mistral":
            self.sliding_window = cfg.get("sliding_window")
        elif family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            self.sliding_window = cfg.get("sliding_window")
        else:
            self.sliding_window = None
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", _TIE_DEFAULT[family]))
        dims = {"hidden_size": hidden, "num_heads": num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": int(cfg["intermediate_size"]),
                "vocab_size": self.vocab_size, "num_layers": self.num_layers,
                "eps": float(cfg.get("rms_norm_eps", 1e-6))}
        self.model = DecoderModel(cfg, family, dims, dtype)
        if not self.tie_word_embeddings:
            self.lm_head = _linear(hidden, self.vocab_size, False, dtype)
        self.rotary = RotaryEmbedding(cfg, self.head_dim, self.max_position_embeddings, dtype)
        self.lm_head_kernel = None
        """The LinearKernel of the LM head (set_kernels), or None for F.linear."""
        self.ops: LayerOps | None = None

    @property
    def num_parameters(self) -> int:
        """Parameter count; a tied embedding / lm_head is counted once."""
        return sum(p.numel() for p in self.parameters())

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: Any) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm, for every token.

        `attn_metadata` is the attention backend's metadata of the step."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        embed = self.model.embed_tokens.weight
        rotary = RotaryInputs(*self.rotary.cos_sin(positions, embed.dtype))  # once per step
        hidden = F.embedding(input_ids, embed)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer.forward(hidden, rotary, kv_cache, attn_metadata)
        return add_rms_norm(hidden, None, self.model.norm, self.ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of hidden states [N, hidden]."""
        if self.lm_head_kernel is not None:
            return self.lm_head_kernel(hidden).float()
        return F.linear(hidden, self.lm_head_weight).float()

    def set_kernels(self, linear_kernels: LinearKernelFactory | None,
                    ops: LayerOps | None) -> int:
        """Attach a kernel from `linear_kernels` to every linear layer and to the LM head
        (None: plain F.linear), and `ops` to every layer (None: torch only). The worker
        calls this after loading; a kernel may hold a packed copy of its weight, made
        now. Returns how many kernels were attached."""
        count = attach_linear_kernels(self, linear_kernels)
        if not self.tie_word_embeddings:
            self.lm_head_kernel = self.lm_head.kernel  # attached above with the others
        else:
            self.lm_head_kernel = (None if linear_kernels is None
                                   else linear_kernels(self.lm_head_weight, None))
            count += self.lm_head_kernel is not None
        self.ops = ops
        for module in self.modules():
            if isinstance(module, (DecoderLayer, MLP)):
                module.ops = ops
        return count

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises ValueError naming any unexpected or mis-shaped weight, and any parameter
        (or slice of a fused one) that no weight filled.
        """
        params = dict(self.named_parameters())
        fused = _fused_targets(params)
        pending = {name: fused.get(name, 1) for name in params}
        loaded: dict[str, set[int]] = {name: set() for name in params}
        unexpected = []
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                target, shard = name, None
                match = _FUSED_NAME.match(name)
                if match:
                    fused_piece, shard = _FUSED[match.group(2)]
                    target = f"{match.group(1)}.{fused_piece}.{match.group(3)}"
                if target not in params:
                    unexpected.append(name)
                    continue
                dest = params[target]
                if shard is not None:
                    dest = self._shard_slice(dest, target, shard)
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dest.shape)}")
                dest.copy_(tensor)
                # A fused name given whole (treadle's own state dict) fills every shard.
                loaded[target].update(range(pending[target]) if shard is None else (shard,))
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {', '.join(sorted(unexpected))}")
        missing = sorted(n for n, got in loaded.items() if len(got) < pending[n])
        if missing:
            raise ValueError(f"parameters never loaded from checkpoint: {', '.join(missing)}")

    def _shard_slice(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if "qkv_proj" in name:
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        else:
            half = param.shape[0] // 2
            bounds = (shard * half, (shard + 1) * half)
        return param[bounds[0]:bounds[1]]


def _fused_targets(params: dict[str, torch.Tensor]) -> dict[str, int]:
    """Fused parameter name -> how many checkpoint tensors fill it."""
    return {n: (3 if ".qkv_proj." in n else 2) for n in params
            if ".qkv_proj." in n or ".gate_up_proj." in n}
