"""What the Triton kernels share: the KV layout's checks, the interpreter switch, tile sizes.

Owns input validation for every kernel entry point (a clear ValueError naming the
argument, never a wrong answer from a bad stride), the choice of float32 dot products
under the interpreter, and the jit helpers used by more than one kernel. It launches
nothing itself.

The KV layout, per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim],
head_dim contiguous; the worker allocates one [2, num_blocks, block_size, num_kv_heads,
head_dim] tensor and passes its two halves (docs/gpu.md says why). A uint8 cache holds
fp8_e4m3 rows instead (`--kv-cache-dtype fp8_e4m3`, worker/kv_quant.py): head_dim fp8
values then their float16 scale, so its last dimension is head_dim + 2; the kernels widen
the values in registers and fold the scales into scores and probabilities.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised where triton is absent
    raise ImportError("treadle's GPU kernels need triton: pip install 'treadle[triton]'") from exc

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CACHE_DTYPE = torch.uint8
"""A cache of this dtype holds fp8_e4m3 rows with their scales (worker/kv_quant.py)."""
SCALE_BYTES = 2
MAX_GROUP = 128
"""Most query heads per KV head one program takes (all of a group are one program)."""


def interpreting() -> bool:
    """True when triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1, CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast dot operands to float32 (exact IEEE products).

    float32 caches always (no TF32 rounding). And every dtype under the interpreter: its
    dot multiplies the raw uint16 bit patterns of bfloat16 operands (checked with triton
    3.6-3.9), so the kernels upcast first and round P to the cache dtype before P @ V, as
    the GPU path does, which keeps the interpreter's numbers those of the compiled kernel.
    """
    return dtype == torch.float32 or interpreting()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_CACHE_DTYPE


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of a K/V cache pair, or a ValueError."""
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (*SUPPORTED_DTYPES,
                                                                       FP8_CACHE_DTYPE):
        raise ValueError(f"key_cache/value_cache dtype must be one of {SUPPORTED_DTYPES} "
                         f"(or {FP8_CACHE_DTYPE}: fp8_e4m3 rows) and equal, got "
                         f"{key_cache.dtype} and {value_cache.dtype}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must have a contiguous head_dim")
    head_dim = key_cache.shape[3] - (SCALE_BYTES if is_fp8_cache(key_cache) else 0)
    if head_dim < 1:
        raise ValueError(f"an fp8 cache's rows hold head_dim values + {SCALE_BYTES} scale "
                         f"bytes, got rows of {key_cache.shape[3]}")
    return key_cache.shape[1], key_cache.shape[2], head_dim


def check_attention_inputs(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor) -> tuple[int, int, int, int]:
    """(block_size, num_kv_heads, head_dim, group) after checking shapes, dtypes, devices."""
    block_size, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [num_tokens, num_heads, {head_dim}], "
                         f"got {tuple(query.shape)}")
    if query.stride(-1) != 1:
        raise ValueError("query must have a contiguous head_dim")
    if query.dtype not in SUPPORTED_DTYPES or (query.dtype != key_cache.dtype
                                               and not is_fp8_cache(key_cache)):
        raise ValueError(f"query dtype {query.dtype} must equal the cache's {key_cache.dtype}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) with at most {MAX_GROUP} query heads per KV head")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [num_reqs, max_blocks] int32, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [num_reqs] int32, got {tuple(seq_lens.shape)} "
                         f"{seq_lens.dtype}")
    if block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for "
                         f"{seq_lens.shape[0]} requests")
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return block_size, num_kv_heads, head_dim, num_heads // num_kv_heads


def check_sliding_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: 0 for none, else the positive window."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return sliding_window


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b, in exact float32 when DOT_F32 (see dot_in_fp32), else on tensor cores."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def fp8_rows(rows, dims, mask, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """A tile of fp8_e4m3 cache rows: the values [tokens, HEAD_DIM_PAD] widened to DTYPE,
    and each row's float16 scale [tokens] as float32 (0 where masked). `rows`: each
    token's row pointer; `mask`: [tokens, HEAD_DIM_PAD]."""
    raw = tl.load(rows[:, None] + dims[None, :], mask=mask, other=0)
    values = raw.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    row_ok = tl.max(mask.to(tl.int32), 1) > 0
    lo = tl.load(rows + HEAD_DIM, mask=row_ok, other=0).to(tl.uint16)
    hi = tl.load(rows + HEAD_DIM + 1, mask=row_ok, other=0).to(tl.uint16)
    scale = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    return values, scale
