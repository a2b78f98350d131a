"""One table per GGUF architecture: GGUF metadata keys and tensor names -> Hugging Face.

Owns what differs between architectures when a GGUF file becomes a Hugging Face
checkpoint: which `<arch>.*` metadata key is which config.json key, which GGUF tensor
(`blk.{bid}.attn_q`, ...) is which HF parameter, and which tensors llama.cpp's convert
script changed on the way in (the rotary row permutation of Llama's q/k projections, the
`w + 1` of Gemma's norms) so that the reader can undo it. It only describes: reading
files is gguf_reader's, writing checkpoints gguf_convert's.

Adding an architecture is one more `GGUFArchitecture` entry in `ARCHITECTURES`, plus its
model class in treadle/models/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PERMUTE_Q = "permute_q"
"""Rows were interleaved per head (llama.cpp's `permute` for its rotary layout); undo with
the query head count."""
PERMUTE_K = "permute_k"
"""As PERMUTE_Q, with the key/value head count."""
MINUS_ONE = "minus_one"
"""The file stores `w + 1` (Gemma's norms, whose HF weight is applied as 1 + w)."""

ROW_TRANSFORMS = (PERMUTE_Q, PERMUTE_K)
"""Transforms that only reorder rows: they apply to quantized blocks as well (a GGUF row
is whole blocks), so raw tensors come out already in HF row order."""
VALUE_TRANSFORMS = (MINUS_ONE,)
"""Transforms of the values, applied after dequantization."""

# Metadata common to the decoder-only families below: `<arch>.<key>` -> config.json key.
_COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# GGUF tensor stems (before .weight / .bias) -> HF parameter stems.
_COMMON_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}

# Metadata that changes the math and that no table below maps: refused by name rather
# than silently ignored (a MoE file read as a dense model would be garbage).
UNSUPPORTED_KEYS = ("expert_count", "attention.sliding_window", "attention.q_lora_rank",
                    "ssm.conv_kernel")
"""`<arch>.<key>` suffixes that are an error when present, unless the architecture's table
maps them (gemma3 maps its sliding window). (`rope.scaling.type` is read by gguf_reader:
'none' and 'linear' are mapped, anything else is refused.)"""

# Gemma 3 as llama.cpp's convert script writes it: four norms per layer, q/k norms, every
# norm stored as 1 + w; the local RoPE base (10000), the layer pattern (every 6th layer
# global) and the query scale are not in the file (llama.cpp hard-codes them too; the
# query scale is set by gguf_reader.gemma3_query_scalar).
_GEMMA3_NORMS = ("output_norm", "blk.{bid}.attn_norm", "blk.{bid}.attn_q_norm",
                 "blk.{bid}.attn_k_norm", "blk.{bid}.post_attention_norm",
                 "blk.{bid}.ffn_norm", "blk.{bid}.post_ffw_norm")


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one `general.architecture` maps onto a Hugging Face checkpoint."""

    gguf_name: str
    hf_architecture: str
    model_type: str
    config_keys: dict[str, str]
    tensors: dict[str, str]
    transforms: dict[str, str] = field(default_factory=dict)
    """GGUF tensor stem -> one of PERMUTE_Q, PERMUTE_K, MINUS_ONE."""
    config_defaults: dict[str, Any] = field(default_factory=dict)
    """config.json values the file does not carry (the HF family's own conventions)."""
    rope_must_cover_head: bool = True
    """`<arch>.rope.dimension_count`, when present, must equal head_dim (no partial rotary)."""
    config_tensors: tuple[str, ...] = ()
    """Tensors that describe the config rather than weights (read by gguf_reader.hf_config,
    not yielded as weights)."""


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(
        "llama", "LlamaForCausalLM", "llama", _COMMON_KEYS, _COMMON_TENSORS,
        # llama.cpp's convert script permutes Llama's q/k rows from HF's rotate-half layout
        # to its interleaved one; Qwen and Gemma keep HF's layout (llama.cpp's NEOX rope).
        transforms={"blk.{bid}.attn_q": PERMUTE_Q, "blk.{bid}.attn_k": PERMUTE_K},
        config_defaults={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
        # Llama 3.x: llama3 rope scaling stored as per-frequency divisors
        config_tensors=("rope_freqs.weight",)),
    "qwen2": GGUFArchitecture(
        "qwen2", "Qwen2ForCausalLM", "qwen2", _COMMON_KEYS, _COMMON_TENSORS,
        config_defaults={"hidden_act": "silu", "use_sliding_window": False}),
    "qwen3": GGUFArchitecture(
        "qwen3", "Qwen3ForCausalLM", "qwen3", _COMMON_KEYS,
        {**_COMMON_TENSORS,
         "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
         "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm"},
        config_defaults={"hidden_act": "silu", "attention_bias": False,
                         "use_sliding_window": False}),
    "gemma3": GGUFArchitecture(
        "gemma3", "Gemma3ForCausalLM", "gemma3_text",
        {**_COMMON_KEYS, "attention.sliding_window": "sliding_window"},
        {**_COMMON_TENSORS,
         "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
         "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm",
         "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
         "blk.{bid}.ffn_norm": "model.layers.{bid}.pre_feedforward_layernorm",
         "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm"},
        transforms=dict.fromkeys(_GEMMA3_NORMS, MINUS_ONE),
        config_defaults={"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                         "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
                         "final_logit_softcapping": None, "attn_logit_softcapping": None}),
}

SUPPORTED = tuple(ARCHITECTURES)


def architecture(name: str) -> GGUFArchitecture:
    """The table of `general.architecture` = name, or ValueError naming it."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: "
                         f"{', '.join(SUPPORTED)}")
    return ARCHITECTURES[name]
