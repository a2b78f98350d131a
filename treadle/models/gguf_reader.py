"""Reading a GGUF file: its Hugging Face config, and its tensors raw or dequantized.

Owns opening a file with the `gguf` package, checking it is one we can run (architecture,
tensor types, metadata that would change the math), the config.json dict its metadata
describes (via the table of treadle/models/gguf_arch.py), and the tensors in two steps:
`raw_tensors` yields each one under its HF name with its GGUF type and its undecoded
blocks (rows already in HF order), and `dequantize` turns one into a torch tensor. Kept
apart so that a quantized execution path can take the raw blocks. It writes nothing (that
is gguf_convert's) and knows nothing of the engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from treadle.models import gguf_arch
from treadle.models.gguf_arch import GGUFArchitecture

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""GGML tensor types that `dequantize` decodes (with the gguf package's decoders)."""

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class RawTensor:
    """One GGUF tensor, named and shaped as its Hugging Face parameter."""

    hf_name: str
    gguf_name: str
    tensor_type: str
    """GGML type name: F32, F16, BF16, Q8_0, Q4_K, ..."""
    data: np.ndarray
    """The undecoded rows (for quantized types: uint8 blocks, one row per output row), in
    HF row order: row-only transforms (llama's q/k permutation) are already applied."""
    shape: tuple[int, ...]
    """The HF (torch) shape: GGUF's dimensions reversed."""
    value_transform: str | None = None
    """A gguf_arch value transform (e.g. MINUS_ONE) that `dequantize` applies."""


class GGUFFile:
    """An opened GGUF file: metadata values by key, tensors, and the architecture table."""

    def __init__(self, path: str | Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError as exc:  # a declared dependency; say so if it is missing
            raise ImportError("reading GGUF files needs the `gguf` package: "
                              "pip install gguf") from exc
        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        arch_name = self.get("general.architecture")
        if arch_name is None:
            raise ValueError(f"{self.path} has no general.architecture metadata")
        self.arch: GGUFArchitecture = gguf_arch.architecture(arch_name)
        if (self.get("split.count") or 1) > 1:
            raise ValueError(f"{self.path} is one part of a split GGUF file "
                             f"({self.get('split.count')} parts): merge the parts first "
                             "(llama.cpp's gguf-split --merge)")

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, number, bool or list), or default when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.arch.gguf_name}.{suffix}", default)

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json dict of the file's model; ValueError naming what is not supported."""
    arch = gguf.arch
    for suffix in gguf_arch.UNSUPPORTED_KEYS:
        if gguf.arch_get(suffix) and suffix not in arch.config_keys:
            raise ValueError(f"unsupported GGUF metadata {arch.gguf_name}.{suffix}="
                             f"{gguf.arch_get(suffix)!r} in {gguf.path}")
    config: dict[str, Any] = {"architectures": [arch.hf_architecture],
                              "model_type": arch.model_type, **arch.config_defaults}
    for suffix, hf_key in arch.config_keys.items():
        value = gguf.arch_get(suffix)
        if value is not None:
            config[hf_key] = value
    for needed in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                   "intermediate_size"):
        if needed not in config:
            raise ValueError(f"{gguf.path} lacks the metadata for {needed}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("max_position_embeddings", 2048)
    config.setdefault("rms_norm_eps", 1e-6)
    if "vocab_size" not in config:
        tokens = gguf.reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{gguf.path} gives neither {arch.gguf_name}.vocab_size nor "
                             "tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens.data)
    rope_dim = gguf.arch_get("rope.dimension_count")
    if arch.rope_must_cover_head and rope_dim is not None and rope_dim != config["head_dim"]:
        raise ValueError(f"unsupported partial rotary embedding in {gguf.path}: "
                         f"rope.dimension_count={rope_dim}, head_dim={config['head_dim']}")
    scaling = gguf.arch_get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(gguf.arch_get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r} in {gguf.path}")
    rope_freqs = next((t for t in gguf.reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None and "rope_freqs.weight" in arch.config_tensors:
        divisors = dequantize_array(rope_freqs.data, rope_freqs.tensor_type.name)
        llama3 = llama3_rope_scaling(divisors, float(config.get("rope_theta", 10000.0)),
                                     config["head_dim"], gguf.path)
        if llama3 is not None and "rope_scaling" in config:
            raise ValueError(f"{gguf.path} has both rope.scaling.type and rope_freqs")
        if llama3 is not None:
            config["rope_scaling"] = llama3

    if arch.model_type == "gemma3_text":
        config["query_pre_attn_scalar"] = gemma3_query_scalar(config)
        pattern = gguf.arch_get("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: True where the layer slides
            config["layer_types"] = ["sliding_attention" if p else "full_attention"
                                     for p in pattern]
        elif pattern:
            config["sliding_window_pattern"] = int(pattern)
    names = set(gguf.tensor_names)
    config["tie_word_embeddings"] = "output.weight" not in names
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value = gguf.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def gemma3_query_scalar(config: dict[str, Any]) -> float:
    """Gemma 3's `query_pre_attn_scalar`, which GGUF does not carry: head_dim, except for
    the 27B model (62 layers), whose queries are scaled by hidden_size / num_heads (as
    llama.cpp's gemma3 loader decides)."""
    if config["num_hidden_layers"] == 62:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int,
                        source: Path) -> dict[str, Any] | None:
    """The llama3 `rope_scaling` behind a `rope_freqs` tensor (None: all factors are 1).

    llama.cpp's convert script stores Llama 3's scaling as per-frequency divisors: 1 for
    short wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) in between with
    s linear in 1 / wavelength. Only two of the three remaining HF parameters are
    identifiable, so low_freq_factor is set to 1 and the others fitted; the fit is checked
    by recomputing every divisor."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope_freqs in {source} has {factors.size} values, expected "
                         f"{inv_freq.size}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    wavelen = 2 * np.pi / inv_freq
    middle = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if middle.sum() >= 2:
        smooth = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[middle], smooth, 1)
        high = 1 - 1 / b
        original = a * (high - 1)
    else:  # no smooth band to fit: Meta's published values, checked below
        high, original = 4.0, 8192.0
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(round(high, 4)),
               "original_max_position_embeddings": int(round(original))}
    if not np.allclose(_llama3_divisors(inv_freq, scaling), factors, rtol=1e-3):
        raise ValueError(f"unsupported rope_freqs in {source}: not llama3 rope scaling")
    return scaling


def _llama3_divisors(inv_freq: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    """The divisors of each inverse frequency under llama3 scaling (HF's definition)."""
    original, low, high = (s["original_max_position_embeddings"], s["low_freq_factor"],
                           s["high_freq_factor"])
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / s["factor"] + smooth)


def _hf_name(arch: GGUFArchitecture, gguf_name: str) -> tuple[str, str] | None:
    """(HF name, GGUF stem template) of a GGUF tensor name, or None when the table lacks it."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    match = _BLOCK_NAME.match(stem)
    template = f"blk.{{bid}}.{match.group(2)}" if match else stem
    hf_stem = arch.tensors.get(template)
    if hf_stem is None:
        return None
    return hf_stem.format(bid=match.group(1) if match else "") + "." + suffix, template


def check_supported(gguf: GGUFFile) -> None:
    """ValueError naming the first tensor whose name or type cannot be converted."""
    for tensor in gguf.reader.tensors:
        if tensor.name in gguf.arch.config_tensors:
            continue
        if _hf_name(gguf.arch, tensor.name) is None:
            raise ValueError(f"unsupported GGUF tensor {tensor.name} for architecture "
                             f"{gguf.arch.gguf_name} in {gguf.path}")
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported GGUF tensor type {tensor.tensor_type.name} "
                             f"(tensor {tensor.name}) in {gguf.path}; supported: "
                             f"{', '.join(SUPPORTED_TYPES)}")


def unpermute_rows(data: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (works on raw quantized rows too).

    llama.cpp reorders each head's rows from HF's (first half, second half) rotary layout
    to interleaved pairs: gguf[h, j, c] = hf[h, c, j] for rows viewed as (head, half, 2).
    """
    rows = data.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    order = np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2)
    return data[order.swapaxes(1, 2).reshape(-1)]


def raw_tensors(gguf: GGUFFile, config: dict[str, Any] | None = None) -> Iterator[RawTensor]:
    """Every tensor as a RawTensor under its HF name, in file order (check_supported first)."""
    config = config if config is not None else hf_config(gguf)
    heads = {gguf_arch.PERMUTE_Q: config["num_attention_heads"],
             gguf_arch.PERMUTE_K: config["num_key_value_heads"]}
    check_supported(gguf)
    for tensor in gguf.reader.tensors:
        if tensor.name in gguf.arch.config_tensors:
            continue
        hf_name, template = _hf_name(gguf.arch, tensor.name)
        transform = gguf.arch.transforms.get(template)
        data = tensor.data
        if transform in gguf_arch.ROW_TRANSFORMS:
            data = unpermute_rows(data, heads[transform])
        yield RawTensor(hf_name, tensor.name, tensor.tensor_type.name, data,
                        tuple(int(d) for d in reversed(tensor.shape)),
                        transform if transform in gguf_arch.VALUE_TRANSFORMS else None)


def dequantize_array(data: np.ndarray, tensor_type: str) -> np.ndarray:
    """Raw GGUF data of a GGML type decoded to a fresh, writable float32 array."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    # A copy: the reader's arrays are read-only views of the memory-mapped file.
    return np.array(gguf_dequantize(data, GGMLQuantizationType[tensor_type]), dtype=np.float32)


def dequantize(raw: RawTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor's values in `dtype`, decoded in float32 by the gguf package."""
    tensor = torch.from_numpy(dequantize_array(raw.data, raw.tensor_type)).reshape(raw.shape)
    if raw.value_transform == gguf_arch.MINUS_ONE:
        tensor = tensor - 1.0
    return tensor.to(dtype)
