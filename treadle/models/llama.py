"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the engine's flat batch.

Owns the model's parameters in fused form (one `qkv_proj` and one `gate_up_proj` per
layer), the forward pass over a flat batch of tokens (all requests concatenated, no
padding, one position per token), the logits, and the mapping of Hugging Face weight
names onto the fused parameters, read by slices for a tensor-parallel rank. It is built
from treadle/layers/ (attention, rotary, norms, linears, tensor-parallel layers); attention
over the paged KV cache is computed by the backend the step's metadata carries. This
module never builds attention metadata, picks tokens or samples, and never imports the
worker. It takes the checkpoint's parsed config.json dict, not a transformers config
object, so it does not depend on the transformers version.

Kernels are handed in by the worker and never chosen here (`set_kernels`): one
`LinearKernel` per linear layer (layers/linear.py), and optionally elementwise ops
(`LayerOps`: fused residual-add + RMSNorm, silu(gate) * up; each returns None where it
does not apply, and the torch code below runs instead). Attention is one
`AttentionLayer` call per layer with un-rotated queries and keys; the attention backend
does the rest.

Tensor and pipeline parallelism (`parallel`: layers.parallel.ParallelContext): a
rank holds its heads, MLP columns and vocabulary range of every layer of its stage
(layers/tensor_parallel.py), reads only those slices from the checkpoint, and
all-reduces after attention and after the MLP; the first stage embeds, the last one
normalizes and computes logits (gathered to the stage's first rank). With one rank all of
this is the plain model.

Family switches (as transformers defines them): Qwen2 always has q/k/v biases; Qwen3
applies a per-head RMSNorm (`q_norm`, `k_norm`) to queries and keys before RoPE; Llama
and Qwen3 read `attention_bias`, Llama reads `mlp_bias`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from treadle.layers.attention import AttentionLayer
from treadle.layers.linear import (Linear, LinearKernelFactory, LoRAPart, LoRATarget,
                                   attach_linear_kernels)
from treadle.layers.norm import LayerOps, RMSNorm, add_rms_norm, rms_norm
from treadle.layers.parallel import ParallelContext
from treadle.layers.plain_layer import PlainDecoder, PlainLayer
from treadle.layers.rotary import RotaryEmbedding, RotaryInputs
from treadle.layers.tensor_parallel import RowParallelLinear, ShardGeometry, VocabParallelEmbedding
from treadle.models.weights import TensorSource, WeightSource

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


def _layer_windows(cfg: dict[str, Any], family: str, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers reads the
    config: Mistral's `sliding_window` holds for every layer; Qwen2/3 slide only with
    `use_sliding_window`, on the layers `layer_types` names (else those from
    `max_window_layers` on)."""
    window = cfg.get("sliding_window")
    if family == "mistral" and window is not None:
        return [int(window)] * num_layers
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window is not None:
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
            else "full_attention" for i in range(num_layers)]
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [None] * num_layers


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, Any],
                 dtype: torch.dtype, layer_index: int) -> None:
        super().__init__()
        shard: ShardGeometry = dims["shard"]
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = dims["head_dim"]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = True if family == "qwen2" else attention_bias
        o_bias = False if family in ("qwen2", "mistral") else attention_bias
        hidden = dims["hidden_size"]
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, hidden, o_bias, dtype, dims["parallel"])
        self.eps = dims["eps"]
        self.attn = AttentionLayer(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.scale, layer_index,
                                   sliding_window=dims["layer_windows"][layer_index])
        if family == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, self.eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, self.eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rotary: RotaryInputs, kv_cache: torch.Tensor,
                meta: Any, keep: torch.Tensor | None = None) -> torch.Tensor:
        """keep: the rows whose output is wanted (every row's keys and values are still
        written); None: all."""
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
        out = self.attn(qk, value, kv_cache, meta, rotary)
        return self.o_proj(out if keep is None else out.index_select(0, keep))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, Any],
                 dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(cfg.get("mlp_bias", False)) if family == "llama" else False
        hidden = dims["hidden_size"]
        self.intermediate = dims["shard"].intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, bias, dtype)
        self.down_proj = RowParallelLinear(self.intermediate, hidden, bias, dtype,
                                           dims["parallel"])
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
    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, Any],
                 dtype: torch.dtype, layer_index: int) -> None:
        super().__init__()
        hidden, eps = dims["hidden_size"], dims["eps"]
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = Attention(cfg, family, dims, dtype, layer_index)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = MLP(cfg, family, dims, dtype)
        self.ops: LayerOps | None = None
        """Fused elementwise kernels (see LlamaForCausalLM.set_kernels), or None."""

    def forward(self, hidden: torch.Tensor, rotary: RotaryInputs, kv_cache: torch.Tensor,
                meta: Any, keep: torch.Tensor | None = None) -> torch.Tensor:
        """hidden is the residual stream, owned by the caller's forward: updated in place,
        or, with `keep` (row indices), only those rows carried on past the attention and
        returned (every row's keys and values are written)."""
        x = add_rms_norm(hidden, None, self.input_layernorm, self.ops)
        attn = self.self_attn.forward(x, rotary, kv_cache, meta, keep)
        if keep is not None:
            hidden = hidden.index_select(0, keep)
        x = add_rms_norm(hidden, attn, self.post_attention_layernorm, self.ops)
        hidden.add_(self.mlp.forward(x))
        return hidden


class DecoderModel(nn.Module):
    """The layers of this pipeline stage (keyed by their index in the whole model), with
    the embedding on the first stage and the final norm on the last."""

    def __init__(self, cfg: dict[str, Any], family: str, dims: dict[str, Any],
                 dtype: torch.dtype, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.embed_tokens = VocabParallelEmbedding(dims["shard"], dims["hidden_size"],
                                                       dtype, dims["parallel"])
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, family, dims, dtype, i) for i in layers})
        if last:
            self.norm = RMSNorm(dims["hidden_size"], dims["eps"], dtype)


_PROJECTIONS = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\."
                          r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|"
                          r"qkv_proj|gate_up_proj)\.(weight|bias)$")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
"""HF projection -> (fused parameter, which of its parts)."""
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM on a flat, unpadded batch."""

    keeps_rows = True
    """Whether `forward` takes `keep_rows` (a subclass with its own forward says False)."""

    decode_stack: Any = None
    """Set by the worker (worker/cpu/decode_stack.py, from `plain_decoder`), or None:
    called with (hidden, rotary, kv_caches, attn_metadata) after the embedding, it runs
    every layer and the final norm of a step it covers in one kernel call and returns the
    result, else None."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        cfg = hf_config
        family = _family(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
        parallel = self._set_geometry(cfg, family, dtype, parallel, default_max_position=2048)
        hidden = self.hidden_size
        self.layer_windows = _layer_windows(cfg, family, self.num_layers)
        """Per layer of the whole model: its sliding window, or None (whole context)."""
        self.sliding_window = next((w for w in self.layer_windows if w is not None), None)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", _TIE_DEFAULT[family]))
        dims = {"hidden_size": hidden, "head_dim": self.head_dim, "shard": self.shard,
                "parallel": parallel, "eps": float(cfg.get("rms_norm_eps", 1e-6)),
                "layer_windows": self.layer_windows}
        first, last = parallel.is_first_stage, parallel.is_last_stage
        self.model = DecoderModel(cfg, family, dims, dtype, range(*self.layer_range),
                                  first, last)
        # The LM head shares the embedding when tied and both live on this stage.
        if last and not (self.tie_word_embeddings and first):
            self.lm_head = Linear(hidden, self.shard.vocab_per_rank, False, dtype)
        self.rotary = RotaryEmbedding(cfg, self.head_dim, self.max_position_embeddings, dtype)
        self.lm_head_kernel = None
        """The LinearKernel of the LM head (set_kernels), or None for F.linear."""
        self.ops: LayerOps | None = None

    @property
    def num_local_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    @property
    def num_parameters(self) -> int:
        """Parameter count of this rank; a tied embedding / lm_head is counted once."""
        return sum(p.numel() for p in self.parameters())

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if hasattr(self, "lm_head"):
            return self.lm_head.weight
        return self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: Any,
                hidden: torch.Tensor | None = None,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of every token: after the final norm on the
        last stage, else the residual stream for the next stage.

        The first stage embeds `input_ids`; a later one continues from `hidden`, the
        previous stage's output. `attn_metadata` is the attention backend's metadata of
        the step; `kv_caches` holds one tensor per layer of this stage. `keep_rows` (int64
        row indices; the last stage only): the rows the caller needs, in its order; the
        last layer carries only those past its attention (a prefill chunk's other rows
        only write keys and values there) and the result is [len(keep_rows), hidden]."""
        if len(kv_caches) != self.num_local_layers:
            raise ValueError(f"expected {self.num_local_layers} KV caches, got {len(kv_caches)}")
        rotary = RotaryInputs(*self.rotary.cos_sin(positions, self.dtype))  # once per step
        if self.parallel.is_first_stage:
            hidden = self.model.embed_tokens(input_ids)
            if self.decode_stack is not None and self.parallel.is_last_stage:
                out = self.decode_stack(hidden, rotary, kv_caches, attn_metadata)
                if out is not None:
                    return out if keep_rows is None else out.index_select(0, keep_rows)
        last = len(kv_caches) - 1
        if not self.parallel.is_last_stage:
            keep_rows = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers.values(), kv_caches)):
            hidden = layer.forward(hidden, rotary, kv_cache, attn_metadata,
                                   keep_rows if i == last else None)
        if not self.parallel.is_last_stage:
            return hidden
        return add_rms_norm(hidden, None, self.model.norm, self.ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab] of hidden states [N, hidden]; with tensor parallelism
        on the stage's first rank only (None on the others, which still take part)."""
        # Float32 straight from the LM head's kernel where it can (the same values); with
        # tensor parallelism the bf16 shards are gathered, half the bytes.
        as_float = (getattr(self.lm_head_kernel, "float_output", None)
                    if self.parallel.tp_size == 1 else None)
        shard = as_float(hidden) if as_float is not None else None
        if shard is None:
            shard = (self.lm_head_kernel(hidden) if self.lm_head_kernel is not None
                     else F.linear(hidden, self.lm_head_weight))
        logits = self.parallel.gather_last_dim(shard)
        if logits is None:
            return None
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, :self.vocab_size]
        return logits.float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The token of each row's largest logit (the first on ties), int64 [N], from
        hidden states [N, hidden] without making the logits: the LM head's kernel
        argmax where it has one, one rank holds the whole vocabulary and the logits are
        the head's output as they are (a subclass that changes them, such as a softcap,
        is not covered). None where not covered: compute_logits then."""
        if type(self).compute_logits is not LlamaForCausalLM.compute_logits:
            return None
        return self.head_argmax(hidden)

    def head_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """greedy_tokens over the LM head's output as it is (a subclass whose logits
        differ only by a strictly increasing map may use it too); None where the kernel
        has no argmax or the vocabulary is split over ranks."""
        if self.parallel.tp_size != 1:
            return None
        argmax = getattr(self.lm_head_kernel, "argmax", None)
        return None if argmax is None else argmax(hidden, self.vocab_size)

    def set_kernels(self, linear_kernels: LinearKernelFactory | None,
                    ops: LayerOps | None) -> int:
        """Attach a kernel from `linear_kernels` to every linear layer and to the LM head
        (None: plain F.linear), and `ops` to every layer (None: torch only). The worker
        calls this after loading; a kernel may hold a packed copy of its weight, made
        now. Returns how many kernels were attached."""
        count = attach_linear_kernels(self, linear_kernels)
        if not self.parallel.is_last_stage:
            self.lm_head_kernel = None
        elif hasattr(self, "lm_head"):
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

    def plain_decoder(self) -> PlainDecoder | None:
        """This stage's layers and final norm as a fused kernel may run them
        (layers/plain_layer.py), when every layer has the plain Llama shape: Llama,
        Mistral and Qwen2 layers without per-head q/k norms, sliding windows or softcaps,
        on the last stage. None for anything else (Qwen3, Gemma 3, a sliding model)."""
        if self.family not in ("llama", "mistral", "qwen2") or not self.parallel.is_last_stage:
            return None
        layers = list(self.model.layers.values())
        if not layers or any(type(layer) is not DecoderLayer for layer in layers):
            return None
        plain = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (attn.q_norm is not None or attn.attn.sliding_window is not None
                    or attn.attn.logit_softcap is not None):
                return None
            plain.append(PlainLayer(layer.input_layernorm, layer.post_attention_layernorm,
                                    attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                    mlp.down_proj, attn.scale, mlp.intermediate))
        return PlainDecoder(tuple(plain), self.model.norm)

    # ----- adapters --------------------------------------------------------------------

    def lora_module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every module an adapter may target, whole model."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.total_num_heads * d, self.total_num_kv_heads * d
        inter = self.shard.intermediate_size * self.shard.tp_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}

    def _set_geometry(self, cfg: dict[str, Any], family: str, dtype: torch.dtype,
                      parallel: ParallelContext | None,
                      default_max_position: int) -> ParallelContext:
        """The model's sizes and this rank's shard of them (every family's constructor
        starts here); returns the parallel context."""
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        self.parallel = parallel = parallel or ParallelContext()
        self.family = family
        self.dtype = dtype
        self.num_layers = int(cfg["num_hidden_layers"])
        """Layers of the whole model (this stage runs `layer_range` of them)."""
        self.layer_range = parallel.layer_range or (0, self.num_layers)
        self.total_num_heads = num_heads
        self.total_num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        self.head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        self.hidden_size = hidden
        self.vocab_size = int(cfg["vocab_size"])
        self.shard = ShardGeometry.of(parallel, num_heads, self.total_num_kv_heads,
                                      self.head_dim, int(cfg["intermediate_size"]),
                                      self.vocab_size)
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        """Heads of this rank (all of them with one rank)."""
        self.max_position_embeddings = int(cfg.get("max_position_embeddings")
                                           or default_max_position)
        return parallel

    def lora_targets(self) -> list[LoRATarget]:
        """The linear layers of this rank an adapter may change, with where each module
        lies in its fused layer and which slices of an adapter's tensors this rank takes
        (split like the base weights: see `_plan`)."""
        shard, d = self.shard, self.head_dim
        q, kv, cols = shard.num_heads * d, shard.num_kv_heads * d, shard.intermediate_size
        heads = [h * d for h in shard.q_heads()]
        kv_rows = tuple(h * d for h in shard.kv_heads(self.total_num_kv_heads))
        mlp_cols = shard.columns()
        targets = []
        for index, layer in self.model.layers.items():
            i = int(index)
            attn, mlp = layer.self_attn, layer.mlp
            targets += [
                LoRATarget(i, "qkv_proj", attn.qkv_proj, (
                    LoRAPart("q_proj", (0, q), b_rows=tuple(heads)),
                    LoRAPart("k_proj", (q, q + kv), b_rows=kv_rows),
                    LoRAPart("v_proj", (q + kv, q + 2 * kv), b_rows=kv_rows))),
                LoRATarget(i, "o_proj", attn.o_proj, (
                    LoRAPart("o_proj", (0, self.hidden_size), a_columns=tuple(heads)),)),
                LoRATarget(i, "gate_up_proj", mlp.gate_up_proj, (
                    LoRAPart("gate_proj", (0, cols), b_rows=mlp_cols),
                    LoRAPart("up_proj", (cols, 2 * cols), b_rows=mlp_cols))),
                LoRATarget(i, "down_proj", mlp.down_proj, (
                    LoRAPart("down_proj", (0, self.hidden_size), a_columns=mlp_cols),)),
            ]
        return targets

    # ----- loading ---------------------------------------------------------------------

    def load_weights(self, weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this rank's (fused, sharded) parameters.

        `weights` is a WeightSource (read by slices: a rank reads only its shard) or
        (name, tensor) pairs. Raises ValueError naming any unexpected or mis-shaped
        weight, and any parameter (or part of a fused one) that no weight filled.
        """
        source = weights if hasattr(weights, "read") else TensorSource(weights)
        params = dict(self.named_parameters())
        parts = {n: 3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1
                 for n in params}
        loaded: dict[str, set[int]] = {name: set() for name in params}
        unexpected = []
        with torch.no_grad():
            for name in source.names():
                plan = self._plan(name, source.shape(name), params)
                if plan is None:
                    unexpected.append(name)
                    continue
                for target, part, rows, src in plan:
                    dest = params[target]
                    if rows is not None:
                        dest = dest[rows[0]:rows[1]]
                    tensor = source.read(name, *src) if src else source.read(name)
                    if tensor.shape[0] < dest.shape[0] and ("embed" in target
                                                            or "lm_head" in target):
                        dest[tensor.shape[0]:].zero_()  # vocabulary padding of the last rank
                        dest = dest[:tensor.shape[0]]
                    if tuple(dest.shape) != tuple(tensor.shape):
                        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    loaded[target].update(range(parts[target]) if part is None else (part,))
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {', '.join(sorted(unexpected))}")
        missing = sorted(n for n, got in loaded.items() if len(got) < parts[n])
        if missing:
            raise ValueError(f"parameters never loaded from checkpoint: {', '.join(missing)}")

    def _plan(self, name: str, shape: tuple[int, ...], params: dict[str, torch.Tensor]
              ) -> list[tuple[str, int | None, tuple[int, int] | None, tuple]] | None:
        """Where checkpoint tensor `name` goes on this rank: a list of (parameter, part of
        a fused parameter or None, its row range or None, the slice to read as (dim,
        start, stop) or () for all). Empty: not this rank's; None: unexpected."""
        if name.endswith("rotary_emb.inv_freq"):
            return []
        shard, d = self.shard, self.head_dim
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            index = int(layer.group(1))
            if index >= self.num_layers:
                return None
            if not self.layer_range[0] <= index < self.layer_range[1]:
                return []
        projection = _PROJECTIONS.match(name)
        if projection is not None:
            _, _, piece, kind = projection.groups()
            prefix = name[:-len(f"{piece}.{kind}")]
            if piece in ("o_proj", "down_proj"):  # row-parallel: split input columns
                first, last = (shard.q_heads() if piece == "o_proj" else shard.columns())
                width = d if piece == "o_proj" else 1
                src = (1, first * width, last * width) if kind == "weight" else ()
                return [(name, None, None, src)] if name in params else None
            if piece in ("qkv_proj", "gate_up_proj"):  # treadle's own fused names
                if self.parallel.tp_size > 1:
                    return None
                return [(name, None, None, ())] if name in params else None
            fused, part = _FUSED[piece]
            target = f"{prefix}{fused}.{kind}"
            if target not in params:
                return None
            q, kv, cols = shard.num_heads * d, shard.num_kv_heads * d, shard.intermediate_size
            if fused == "qkv_proj":
                heads = (shard.q_heads() if part == 0
                         else shard.kv_heads(self.total_num_kv_heads))
                rows = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][part]
                return [(target, part, rows, (0, heads[0] * d, heads[1] * d))]
            first, last = shard.columns()
            return [(target, part, (part * cols, (part + 1) * cols), (0, first, last))]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            first, last = shard.vocab_range()
            src = (0, first, min(last, self.vocab_size))
            targets = []
            if name == "model.embed_tokens.weight" and "model.embed_tokens.weight" in params:
                targets.append(("model.embed_tokens.weight", None, None, src))
            tied_here = self.tie_word_embeddings and name == "model.embed_tokens.weight"
            if "lm_head.weight" in params and (tied_here or not self.tie_word_embeddings
                                               and name == "lm_head.weight"):
                targets.append(("lm_head.weight", None, None, src))
            known = name == "model.embed_tokens.weight" or not self.tie_word_embeddings
            return targets if targets or known else []
        if name == "model.norm.weight":
            return [(name, None, None, ())] if name in params else (
                [] if not self.parallel.is_last_stage else None)
        return [(name, None, None, ())] if name in params else None
