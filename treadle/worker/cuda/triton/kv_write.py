"""The K/V cache write in Triton: scatter the new tokens' K and V into their slots.

Owns one kernel: a program per new token copies its [num_kv_heads, head_dim] K and V rows
to slot_mapping[token] (block = slot // block_size, offset = slot % block_size) of the
cache layout in common.py, casting to the cache's dtype. A token whose slot is negative
is skipped: that is how the rows that pad a CUDA graph's batch are marked, the same
convention as the cache-write kernels of FlashAttention and FlashInfer users, so a padded
batch is valid for any of them. It does not decide slots (core/kv/manager.py does).

Into a uint8 cache (fp8_e4m3 rows, worker/kv_quant.py) it quantizes as kv_quant does: per
(token, KV head) scale = fp16(max|x| / 448), values e4m3(x / scale) with IEEE division
(`div_rn`) and rounding to nearest even (by hand, `_round_to_e4m3`), then the scale's
two bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.worker.cuda.triton.common import check_kv_cache, is_fp8_cache, next_pow2

_E4M3_MAX = 448.0
_FP16_MAX = 65504.0


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still as
    float32: the cast that follows is then exact. Done by hand because triton's CPU
    interpreter drops the carry when rounding reaches the next power of two (124.8 -> 64);
    the GPU's cvt instruction rounds the same way as this."""
    bits = x.to(tl.uint32, bitcast=True)
    # normal range: keep 3 mantissa bits, nearest even (a carry moves the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32,
                                                                       bitcast=True)
    # subnormal range (|x| < 2^-6): multiples of 2^-9, nearest even by the 1.5 * 2^23 trick
    sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _store_fp8_rows(rows, x, dims, mask, HEAD_DIM: tl.constexpr):
    """x [heads, HEAD_DIM_PAD] float32 as fp8_e4m3 rows with their float16 scales."""
    head_ok = tl.max(mask.to(tl.int32), 1) > 0
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
    scale16 = tl.minimum(tl.math.div_rn(amax, _E4M3_MAX), _FP16_MAX).to(tl.float16)
    scale = scale16.to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)
    scaled = tl.where(scale[:, None] > 0, tl.math.div_rn(x, safe[:, None]), 0.0)
    scaled = tl.minimum(tl.maximum(scaled, -_E4M3_MAX), _E4M3_MAX)
    values = _round_to_e4m3(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(rows[:, None] + dims[None, :], values, mask=mask)
    bits = scale16.to(tl.uint16, bitcast=True)
    tl.store(rows + HEAD_DIM, (bits & 0xFF).to(tl.uint8), mask=head_ok)
    tl.store(rows + HEAD_DIM + 1, (bits >> 8).to(tl.uint8), mask=head_ok)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckb, stride_cks, stride_ckh, stride_cvb, stride_cvs, stride_cvh,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # the slot test as a block, not a scalar: triton 3.9's interpreter rejects the mask a
    # scalar bool broadcasts into
    slot_ok = (heads[:, None] * 0 + dims[None, :] * 0 + slot) >= 0
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM) & slot_ok
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                mask=mask)
    k_rows = k_cache_ptr + block * stride_ckb + offset * stride_cks + heads * stride_ckh
    v_rows = v_cache_ptr + block * stride_cvb + offset * stride_cvs + heads * stride_cvh
    if FP8:
        _store_fp8_rows(k_rows, k.to(tl.float32), dims, mask, HEAD_DIM)
        _store_fp8_rows(v_rows, v.to(tl.float32), dims, mask, HEAD_DIM)
    else:
        tl.store(k_rows[:, None] + dims[None, :], k.to(k_cache_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(v_rows[:, None] + dims[None, :], v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping [num_tokens].

    slot_mapping: int32 or int64 slots (block_id * block_size + offset); negative: skip.
    Slots past the cache's end are the caller's bug and are not checked here (checking
    would read the device); the scheduler only hands out slots of allocated blocks.
    """
    block_size, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    expected = (key.shape[0], num_kv_heads, head_dim)
    if key.shape != expected or value.shape != expected:
        raise ValueError(f"key and value must be {expected}, got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must have a contiguous head_dim")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32,
                                                                           torch.int64):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}] int32/int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size,
        FP8=is_fp8_cache(key_cache),
        num_warps=1 if num_kv_heads * head_dim <= 1024 else 4)
