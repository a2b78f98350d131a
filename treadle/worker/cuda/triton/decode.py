"""Paged decode attention in Triton: one new token per request, split-K over the context.

Owns the decode kernel, its split reduction and the choice of the split count. One
program takes one (request, KV head, split): it loads the query rows of every query head
of that KV head's group at once (GQA: each K/V tile is read from memory once per group,
not once per query head) and runs an online softmax over its share of the context, one
tile of TILE_N tokens at a time (a tile may span several KV blocks: each token's block is
looked up in the block table). With one split the program writes the normalised output;
with more, each writes its unnormalised partial sum, running max and running sum into a
float32 workspace and a second small kernel merges the splits of each (request, head)
with the usual log-sum-exp rescaling: no atomics, the result does not depend on the order
in which programs run.

The split count is a launch parameter, not derived from the context lengths on the
host: each request's context is cut into num_splits equal runs of tiles inside the
kernel, so one launch shape serves any context lengths (what a captured CUDA graph needs).
Requests with seq_len 0 (padding rows of a graph's batch) get zeros.

It decides nothing about which requests run; it does not write K/V (kv_write.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from treadle.worker.cuda.triton.common import (check_attention_inputs, check_sliding_window,
                                          dot_in_fp32, fp8_rows, is_fp8_cache, mma,
                                          next_pow2)

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      tile_n: int = 64, programs_per_sm: int = 2,
                      min_tiles_per_split: int = 2) -> int:
    """Splits per (request, KV head) so that the launch fills the GPU.

    Enough programs for `programs_per_sm` per multiprocessor, but no split shorter than
    `min_tiles_per_split` tiles of the longest context (a split's fixed cost, the query load
    and the merge, must stay small against its loads), a power of two, at most MAX_SPLITS.
    """
    for name, value in (("num_seqs", num_seqs), ("num_kv_heads", num_kv_heads),
                        ("num_sms", num_sms), ("tile_n", tile_n)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    programs = num_seqs * num_kv_heads
    wanted = math.ceil(num_sms * programs_per_sm / programs)
    by_length = max(1, max_seq_len // (tile_n * min_tiles_per_split))
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr,
    scale_log2, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    num_seqs, num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    num_tiles = tl.cdiv(seq_len - lo, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        tok = lo + tile * TILE_N + offs_n
        tok_ok = tok < seq_len
        block = tl.load(table + tok // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = tok % BLOCK_SIZE
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k_rows = k_cache_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)
        if FP8:  # the scales fold into the scores and the probabilities
            k, k_scale = fp8_rows(k_rows, dims, kv_mask, HEAD_DIM, q.dtype)
        else:
            k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([GROUP_PAD, TILE_N], dtype=tl.float32), DOT_F32)
        if FP8:
            s = s * k_scale[None, :]
        s = tl.where(tok_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_cache_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)
        if FP8:
            v, v_scale = fp8_rows(v_rows, dims, kv_mask, HEAD_DIM, q.dtype)
            p = p * v_scale[None, :]
        else:
            v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_F32)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # workspace: acc [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD], m and l
        # [2, num_seqs, num_heads, NUM_SPLITS], all contiguous float32
        part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + num_seqs * num_heads * NUM_SPLITS + part, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_ot, stride_oh,
    num_seqs, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_ml_ptr + part)
    denom = tl.load(part_ml_ptr + num_seqs * num_heads * NUM_SPLITS + part)
    m_all = tl.max(m, 0)
    # splits that saw no token keep m = -1e30 and denom = 0: their weight is exp2(-huge) = 0
    w = tl.exp2(m - m_all)
    total = tl.sum(w * denom, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_config(head_dim: int, group: int) -> dict[str, int]:
    """Tile size and launch shape per head_dim.

    Checked with ptxas for sm_90 (benchmarks/gpu/compile_sm90.py): no spills at every
    head_dim, group and dtype; two tiles in flight (num_stages) hide the gather latency.
    """
    tile_n = 64 if head_dim <= 128 else 32
    return {"TILE_N": tile_n, "num_warps": 4, "num_stages": 2}


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, *, num_splits: int = 1,
                     sliding_window: int | None = None, tile_n: int | None = None
                     ) -> torch.Tensor:
    """Attention of one new token per request (row i of query is request i's token).

    query: [num_seqs, num_heads, head_dim]; key_cache/value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [>= num_seqs, max_blocks] int32; seq_lens:
    [num_seqs] int32 context lengths including the new token (0: a padding row, output 0).
    num_splits: a power of two <= MAX_SPLITS (choose_num_splits picks one).
    out: [num_seqs, num_heads, head_dim] (any dtype; strided rows allowed). Returns out.
    """
    block_size, num_kv_heads, head_dim, group = check_attention_inputs(
        query, key_cache, value_cache, block_tables, seq_lens)
    window = check_sliding_window(sliding_window)
    num_seqs, num_heads = query.shape[0], query.shape[1]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} query rows")
    if not 1 <= num_splits <= MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], "
                         f"got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head_dim, "
                         f"got {tuple(out.shape)}")
    if num_seqs == 0:
        return out
    config = decode_config(head_dim, group)
    if tile_n is not None:
        config["TILE_N"] = tile_n
    head_dim_pad = max(16, next_pow2(head_dim))
    if num_splits > 1:
        part_acc = torch.empty(num_seqs * num_heads * num_splits * head_dim_pad,
                               dtype=torch.float32, device=query.device)
        part_ml = torch.empty(2 * num_seqs * num_heads * num_splits, dtype=torch.float32,
                              device=query.device)
    else:
        part_acc = part_ml = out  # not read: the kernel writes out directly
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_acc, part_ml,
        scale * _LOG2E, window,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_seqs, num_heads,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE_N=config["TILE_N"],
        NUM_SPLITS=num_splits, SLIDING=window > 0, DOT_F32=dot_in_fp32(query.dtype),
        FP8=is_fp8_cache(key_cache),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), num_seqs, num_heads,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
            num_warps=4)
    return out
