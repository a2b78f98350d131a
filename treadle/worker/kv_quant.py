"""Quantized KV-cache rows (`--kv-cache-dtype int8 | fp8_e4m3`): the format, and its torch
quantization and dequantization, which every backend's reads and writes must reproduce.

A cached K or V vector of one token and one KV head is one *row* of `head_dim + 2`
bytes: `head_dim` quantized values, then its scale as a little-endian float16 (a float32
scale would cost 6% of a head_dim-64 row for no measurable gain: float16 keeps 11
significant bits, and the rounding of the scale is applied before quantizing, so it
only moves the grid, never adds error beyond half a step). The row
replaces the `head_dim` elements of the unquantized layouts (worker/kv_cache.py), so a
block holds its values and their scales side by side: a block copy (swap out/in, the
draft cache) moves both, and a prefix-cache hit reuses both, with no second tensor to
keep in step.

- `int8`: scale = fp16(max|x| / 127) per row, q = round-half-even(x / scale) clamped to
  [-127, 127], x ~ q * scale. The C kernels (worker/kernels: rope_kv, decode, prefill) quantize and
  dequantize exactly this way (IEEE division, nearest-even rounding).
- `fp8_e4m3`: scale = fp16(max|x| / 448) per row, q = e4m3(x / scale) (torch's
  float8_e4m3fn cast, nearest even), x ~ q * scale. On CPU this is emulated: the values
  are stored as fp8 bytes and widened by torch before the attention math.

A row of zeros has scale 0 and dequantizes to zeros.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
"""`--kv-cache-dtype` choices; `auto` stores K/V in the model's dtype."""
SCALE_BYTES = 2
"""A float16 scale after each row's values."""
_SCALE_MAX = 65504.0
"""float16's largest finite value (a larger scale saturates)."""
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
"""The cache tensor's dtype per quantized format (fp8 bytes are viewed as
float8_e4m3fn when read)."""


def check_kv_cache_dtype(name: str) -> str:
    """`name` if it is a known KV-cache dtype, else ValueError naming the field."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return name


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in _QMAX


def row_bytes(head_dim: int) -> int:
    """Bytes of one quantized row: the values and the scale."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> rows [..., head_dim + 2] of the storage dtype."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale16 = (amax / _QMAX[kind]).clamp_(max=_SCALE_MAX).to(torch.float16)
    scale = scale16.float()
    scaled = torch.where(scale > 0, xf / torch.where(scale > 0, scale, 1.0), 0.0)
    if kind == "int8":
        values = torch.round(scaled).clamp_(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale16.contiguous().view(torch.uint8).view(STORAGE_DTYPES[kind])
    return torch.cat((values, scale_bytes), dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The scales [..., 1] (as float32) of quantized rows [..., head_dim + 2]."""
    tail = rows[..., -SCALE_BYTES:].contiguous()
    return tail.view(torch.uint8).view(torch.float16).float()


def dequantize(rows: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """rows [..., head_dim + 2] -> [..., head_dim] in `dtype` (values x scale in float32,
    then cast)."""
    values = rows[..., :-SCALE_BYTES]
    if kind == "int8":
        vf = values.float()
    else:
        vf = values.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).float()
    return (vf * scales(rows)).to(dtype)
