"""The weight formats kept quantized in memory: GGUF's Q8_0, Q4_0, Q4_1 and Q4_K blocks
(layouts exactly as ggml defines them, see kernels/quant_simd.h) and treadle's INT8
(per-output-channel symmetric int8, made at load from a bf16 / fp32 weight).

Owns the format table, the shape rules (which K a format can hold, with a clear error
where it cannot), the int8 quantizer, and a pure-torch dequantizer: the fallback where
the C kernels are unavailable and a second reference in the tests. It does not read GGUF
files (treadle/models/gguf*.py does) and does not run matmuls (quant_weights.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """One weight format: blocks of `block_elems` weights in `block_bytes` bytes."""

    name: str
    ggml_type: int | None
    """GGMLQuantizationType value in GGUF files (None: treadle's own INT8)."""
    block_elems: int
    block_bytes: int

    def check_k(self, k: int) -> None:
        """ValueError unless a row of k weights fits this format."""
        if k <= 0:
            raise ValueError(f"{self.name}: in_features must be positive, got {k}")
        if k % self.block_elems:
            raise ValueError(
                f"{self.name}: in_features {k} is not a multiple of the format's block of "
                f"{self.block_elems} weights (GGUF stores whole blocks per row)")

    def row_bytes(self, k: int) -> int:
        """Bytes per row of k weights (INT8: k rounded up to 64, zero padded)."""
        self.check_k(k)
        if self.name == "INT8":
            return (k + 63) // 64 * 64
        return k // self.block_elems * self.block_bytes


FORMATS = {
    "Q8_0": QuantFormat("Q8_0", 8, 32, 34),
    "Q4_0": QuantFormat("Q4_0", 2, 32, 18),
    "Q4_1": QuantFormat("Q4_1", 3, 32, 20),
    "Q4_K": QuantFormat("Q4_K", 12, 256, 144),
    "INT8": QuantFormat("INT8", None, 1, 1),
}
_BY_GGML = {f.ggml_type: f for f in FORMATS.values() if f.ggml_type is not None}


def format_of(kind: int | str) -> QuantFormat:
    """The format for a GGML type number (GGMLQuantizationType) or a name ('Q8_0',
    'q4_k', 'int8', ...); ValueError naming the supported ones otherwise."""
    if isinstance(kind, str):
        found = FORMATS.get(kind.upper())
    else:
        found = _BY_GGML.get(int(kind))
    if found is None:
        raise ValueError(f"quantized weight type {kind!r} is not supported: "
                         f"supported are {', '.join(FORMATS)} (GGML types "
                         f"{', '.join(f'{f.name}={f.ggml_type}' for f in _BY_GGML.values())})")
    return found


def quantize_int8(weight: torch.Tensor, rows_per_pass: int = 4096
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] float weight as INT8: uint8 rows [N, Kp] holding int8 q (Kp = K rounded up
    to 64, zero padded) and fp32 scales [N], with q = round(w * 127 / amax(row)) and
    w ~= scale * q, scale = amax / 127 (0 for an all-zero row). Done in passes of rows so
    that the fp32 copy of a large weight is never whole in memory."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"int8 quantization needs a 2-D float weight, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    kp = FORMATS["INT8"].row_bytes(k)
    blocks = torch.zeros(n, kp, dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    for r0 in range(0, n, rows_per_pass):
        w = weight[r0:r0 + rows_per_pass].float()
        amax = w.abs().amax(dim=1)
        if not torch.isfinite(amax).all():
            raise ValueError("int8 quantization: the weight has inf or NaN entries")
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        blocks[r0:r0 + len(w), :k] = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[r0:r0 + len(w)] = amax / 127.0
    return blocks.view(torch.uint8), scales


def quantize_q8_0(weight: torch.Tensor, rows_per_pass: int = 4096) -> torch.Tensor:
    """A [N, K] float weight as GGUF Q8_0 blocks: uint8 [N, K / 32 * 34], each block of 32
    values an fp16 scale d = amax / 127 then 32 int8 q = round(w / d) (ggml's rule, with q
    taken against the fp16-rounded d that dequantization reads). K must be a multiple of
    32. In passes of rows, as quantize_int8."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"Q8_0 quantization needs a 2-D float weight, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 quantization needs in_features a multiple of 32, got {k}")
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    for r0 in range(0, n, rows_per_pass):
        w = weight[r0:r0 + rows_per_pass].float().reshape(-1, k // 32, 32)
        amax = w.abs().amax(dim=2)
        if not torch.isfinite(amax).all():
            raise ValueError("Q8_0 quantization: the weight has inf or NaN entries")
        d = (amax / 127.0).to(torch.float16)
        inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(amax))
        q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        rows = out[r0:r0 + len(w)]
        rows[..., :2] = d.contiguous().view(torch.uint8).reshape(len(w), k // 32, 2)
        rows[..., 2:] = q.view(torch.uint8)
    return out.reshape(n, k // 32 * 34)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dimension's 2 bytes, as fp32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (qs & 15).float(), (qs >> 4).float()


def q4k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K blocks from their 12 packed bytes [..., 12]."""
    s = scales.to(torch.int32)
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (top & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def dequantize_torch(fmt: QuantFormat, blocks: torch.Tensor, k: int,
                     scales: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 [N, k] weight of `blocks` (uint8 [N, row_bytes]), in plain torch."""
    n = blocks.shape[0]
    if fmt.name == "INT8":
        return blocks[:, :k].contiguous().view(torch.int8).float() * scales.float()[:, None]
    b = blocks[:, :fmt.row_bytes(k)].reshape(n, k // fmt.block_elems, fmt.block_bytes)
    if fmt.name == "Q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])
    elif fmt.name == "Q4_0":
        lo, hi = _nibbles(b[..., 2:18])
        w = (torch.cat([lo, hi], dim=-1) - 8.0) * _f16(b[..., 0:2])
    elif fmt.name == "Q4_1":
        lo, hi = _nibbles(b[..., 4:20])
        w = torch.cat([lo, hi], dim=-1) * _f16(b[..., 0:2]) + _f16(b[..., 2:4])
    else:  # Q4_K: sub-blocks 2i, 2i + 1 are the low and high nibbles of qs[32i:32i + 32]
        sc, mn = q4k_scales_mins(b[..., 4:16])
        lo, hi = _nibbles(b[..., 16:144].reshape(n, -1, 4, 32))
        q = torch.stack([lo, hi], dim=-2).reshape(n, -1, 8, 32)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        w = (d * sc.float())[..., None] * q - (dmin * mn.float())[..., None]
    return w.reshape(n, k)
