"""Rotary position embedding (RoPE) for the Llama family, in Hugging Face's "rotate_half" layout.

Owns the inverse-frequency formulas of the supported rope types (`default`, `linear`,
`llama3`), reading them from a checkpoint's config dict in either the transformers 5 form
(`rope_parameters`, with `rope_theta` inside) or the older one (`rope_scaling` plus a
top-level `rope_theta`), and a cos/sin table over every position up to
`max_position_embeddings`. Callers gather the table once per forward for the step's
positions and rotate each layer's queries and keys with it. It holds no model weights and
never decides positions: those come from the model runner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


def rope_settings(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters of a config dict, with `rope_type` and `rope_theta` always set.

    Reads `rope_parameters` (transformers 5) or `rope_scaling` (older checkpoints, where
    the type may be spelled `type`); `rope_theta` inside them wins over the top-level key.
    """
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict, got {params!r}")
    settings = dict(params)
    settings["rope_type"] = settings.get("rope_type") or settings.get("type") or "default"
    settings.pop("type", None)
    theta = settings.get("rope_theta", hf_config.get("rope_theta"))
    settings["rope_theta"] = float(theta if theta is not None else DEFAULT_ROPE_THETA)
    return settings


def _require(settings: dict[str, Any], key: str) -> float:
    if settings.get(key) is None:
        raise ValueError(f"rope type {settings['rope_type']!r} needs {key!r} in the rope settings")
    return float(settings[key])


def inverse_frequencies(settings: dict[str, Any], head_dim: int,
                        max_position_embeddings: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies of the configured rope type."""
    rope_type = settings["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    # theta_i = base^(-2i/d), evaluated in float32 as the reference implementation does.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (settings["rope_theta"] ** exponents)
    if rope_type == "linear":
        # Position interpolation: positions are divided by the factor.
        return inv_freq / _require(settings, "factor")
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, settings, max_position_embeddings)
    return inv_freq


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, settings: dict[str, Any],
                                max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, and
    those in between blended linearly in (original context / wavelength)."""
    factor = _require(settings, "factor")
    low_freq_factor = _require(settings, "low_freq_factor")
    high_freq_factor = _require(settings, "high_freq_factor")
    original_len = float(settings.get("original_max_position_embeddings")
                         or max_position_embeddings)
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # smooth = 0 at the low-frequency edge (fully scaled), 1 at the high one (unscaled).
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """A cos/sin table for positions [0, max_position_embeddings), gathered per step.

    The table is a plain tensor (not a module buffer) so that building the model on the
    meta device and materializing it with `to_empty` leaves it intact. It is computed in
    float32 and rounded once to the model's dtype; a copy for another device or dtype
    (after `model.to(...)`) is made on first use.
    """

    def __init__(self, hf_config: dict[str, Any], head_dim: int, max_position_embeddings: int,
                 dtype: torch.dtype) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.settings = rope_settings(hf_config)
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = inverse_frequencies(self.settings, head_dim, max_position_embeddings)
        positions = torch.arange(max_position_embeddings, dtype=torch.int64, device="cpu").float()
        angles = torch.outer(positions, inv_freq)  # [max_pos, head_dim // 2], float32
        # The two halves of the rotate_half layout share their angles: keep one half only.
        self._float_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.cos_sin_cache = self._float_cache.to(dtype)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [num_tokens, 1, head_dim // 2] for these positions (once per step)."""
        cache = self.cos_sin_cache
        if cache.device != positions.device or cache.dtype != dtype:
            cache = self.cos_sin_cache = self._float_cache.to(positions.device, dtype)
        cos, sin = cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by the angles; returns a new contiguous tensor.

    Equal to x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), with the same roundings.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out


@dataclass(frozen=True)
class RotaryInputs:
    """One step's rotary angles, handed with un-rotated queries and keys to the attention
    layer: the backend rotates them (`apply`) or fuses the rotation with its K/V write."""

    cos: torch.Tensor
    """[num_tokens, 1, head_dim // 2]"""
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos, self.sin)
