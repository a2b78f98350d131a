"""Tiny GGUF files for tests, written with the `gguf` package the way llama.cpp's convert
script lays them out (its tensor names, its q/k row permutation for llama, its tokenizer
metadata), from a tiny Hugging Face checkpoint the test made."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from treadle.models.demo import CHAT_TEMPLATE, SPECIAL_TOKENS, _build_merges, _byte_alphabet

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "gemma3": "gemma3"}

# HF parameter stem -> GGUF stem (llama.cpp's names), written out independently of
# treadle/models/gguf_arch.py so that a wrong table there fails the tests.
_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Gemma 3's own names where they differ from the table above (llama.cpp's gemma3 layout).
_GEMMA3_NAMES = {"post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
# Byte offsets of the float16 scales in each K-quant block (gguf-py's block layouts).
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                    "Q6_K": (208,)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` of q/k rows (HF rotate-half -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_cpp_rope_freqs(base: float, dim: int, scaling: dict) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's rope_freqs for llama3 rope scaling (its loop, kept)."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, bid, rest = stem.split(".", 3)
        names = {**_NAMES, **_GEMMA3_NAMES} if arch == "gemma3" else _NAMES
        return f"blk.{bid}.{names[rest]}.{suffix}"
    return f"{_NAMES[stem]}.{suffix}"


def tokenizer_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of exactly vocab_size tokens: tokens, merges."""
    tokens = [*SPECIAL_TOKENS, *_byte_alphabet()]
    merges = _build_merges(vocab_size - len(tokens))
    tokens += [a + b for a, b in merges]
    return tokens, [f"{a} {b}" for a, b in merges]


def random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small scales (gguf-py cannot quantize K types)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scale = np.full((rows, cols // block_values), 5e-5, dtype=np.float16)
        data[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return data.reshape(rows, -1)


def write_tiny_gguf(checkpoint_dir: str | Path, out_path: str | Path, family: str,
                    types: dict[str, str] | None = None, seed: int = 0) -> Path:
    """Write the checkpoint as GGUF. `types` maps a substring of HF names (e.g. "mlp.") to
    a GGML type; the first match wins; unmatched tensors are F32. For K types the
    tensor's values are replaced by random blocks (the GGUF then defines the model)."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    # torch's loader: numpy has no bfloat16 (the demo writer's checkpoints are bf16)
    weights = load_file(str(Path(checkpoint_dir) / "model.safetensors"))
    arch = ARCH[family]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    writer = GGUFWriter(str(out_path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope_params = config.get("rope_parameters") or {}
    rope_params = rope_params.get("full_attention", rope_params)  # gemma3: per layer kind
    writer.add_rope_freq_base(config.get("rope_theta") or rope_params.get("rope_theta", 1e4))
    writer.add_rope_dimension_count(head_dim)
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    tokens, merges = tokenizer_vocab(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(
            rope.get("rope_theta") or config.get("rope_theta"), head_dim, rope))
    rng = np.random.default_rng(seed)
    for name, value in weights.items():
        value = value.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, n_kv)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        qtype = next((t for key, t in (types or {}).items() if key in name), "F32")
        if value.ndim == 1:
            qtype = "F32"  # llama.cpp keeps norms and biases in F32
        if qtype in _K_SCALE_OFFSETS:
            data = random_k_blocks(*value.shape, qtype, rng)
        else:
            data = quantize(value, GGMLQuantizationType[qtype])
        raw_dtype = None if qtype in ("F32", "F16") else GGMLQuantizationType[qtype]
        writer.add_tensor(gguf_name(name, arch), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)
