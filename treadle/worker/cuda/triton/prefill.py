"""Paged prefill attention in Triton: chunked prefill over a cached prefix, causal.

Owns the prefill kernel and its launch. A program takes BLOCK_Q consecutive new tokens of
one request and all query heads of one KV head's group: its BLOCK_M = BLOCK_Q x group
rows are (token, head) pairs, so each K/V tile is loaded once for the whole group. It
runs a flash loop (online softmax, exp2) over the request's context, TILE_N tokens at a
time, read through the block table; the context is the cached prefix and the new tokens
themselves (already written by kv_write.py). Tiles entirely at or below the lowest
query position of the program skip the causal mask; the tiles across the diagonal are
masked; with a sliding window every tile is masked and tiles wholly before the window
of the program's first query are not visited.

Programs find their request without any host-side table: with q0 the first query row of
the batch, request s owns program ids from (query_start_loc[s] - q0) // BLOCK_Q + s on,
which is at least as many as its ceil(num_new / BLOCK_Q) query tiles; a binary search
over query_start_loc finds s, and surplus programs exit. The grid is
query.shape[0] // BLOCK_Q + num_reqs programs (an upper bound when the offsets are a slice
of a larger batch's), known on the host without reading the device.

It also serves one-token requests (correct, but decode.py is the faster kernel for them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.worker.cuda.triton.common import (check_attention_inputs, check_sliding_window,
                                          dot_in_fp32, fp8_rows, is_fp8_cache, mma,
                                          next_pow2)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, hi, q_pos, k_cache_ptr, v_cache_ptr, table,
                 kv_head, scale_log2, window,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 dims, dim_ok,
                 BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 MASKED: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr,
                 HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    tok = start + tl.arange(0, TILE_N)
    tok_ok = tok < hi
    block = tl.load(table + tok // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    slot = tok % BLOCK_SIZE
    kv_mask = tok_ok[:, None] & dim_ok[None, :]
    k_rows = k_cache_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)
    if FP8:  # the scales fold into the scores and the probabilities
        k, k_scale = fp8_rows(k_rows, dims, kv_mask, HEAD_DIM, q.dtype)
    else:
        k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32), DOT_F32)
    if FP8:
        s = s * k_scale[None, :]
    s = s * scale_log2
    if MASKED:
        allowed = tok_ok[None, :] & (tok[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
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
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr,
    scale_log2, window, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # the request s whose first program id (query_start_loc[s] - q0) // BLOCK_Q + s is the
    # largest one <= pid
    q0 = tl.load(query_start_loc_ptr)
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first = (tl.load(query_start_loc_ptr + mid) - q0) // BLOCK_Q + mid
        go_right = first <= pid
        left = tl.where(go_right, mid + 1, left)
        right = tl.where(go_right, right, mid)
    seq = left - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = pid - ((q_start - q0) // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < num_new:
        seq_len = tl.load(seq_lens_ptr + seq)
        num_cached = seq_len - num_new

        rows = tl.arange(0, BLOCK_M)
        tok_in_seq = q_tile * BLOCK_Q + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok_in_seq < num_new)
        q_pos = num_cached + tok_in_seq
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q_rows = (q_start + tok_in_seq).to(tl.int64) * stride_qt + heads * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt

        first_pos = num_cached + q_tile * BLOCK_Q
        hi = tl.minimum(num_cached + (q_tile + 1) * BLOCK_Q, seq_len)  # last query + 1
        if SLIDING:
            lo = tl.maximum(first_pos - window + 1, 0)
            for start in range(lo, hi, TILE_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, start, hi, q_pos, k_cache_ptr, v_cache_ptr, table,
                    kv_head, scale_log2, window, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, dims, dim_ok,
                    BLOCK_M, BLOCK_SIZE, TILE_N, True, True, DOT_F32, HEAD_DIM, FP8)
        else:
            # keys 0 .. first_pos are visible to every row: no mask on whole tiles there
            full_end = (first_pos + 1) // TILE_N * TILE_N
            for start in range(0, full_end, TILE_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, start, hi, q_pos, k_cache_ptr, v_cache_ptr, table,
                    kv_head, scale_log2, window, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, dims, dim_ok,
                    BLOCK_M, BLOCK_SIZE, TILE_N, False, False, DOT_F32, HEAD_DIM, FP8)
            for start in range(full_end, hi, TILE_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, start, hi, q_pos, k_cache_ptr, v_cache_ptr, table,
                    kv_head, scale_log2, window, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, dims, dim_ok,
                    BLOCK_M, BLOCK_SIZE, TILE_N, True, False, DOT_F32, HEAD_DIM, FP8)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + tok_in_seq).to(tl.int64) * stride_ot + heads * stride_oh
        tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])


def prefill_config(head_dim: int, group: int) -> dict[str, int]:
    """Rows per program and tile size per head_dim.

    Checked with ptxas for sm_90 (benchmarks/gpu/compile_sm90.py): no spills and at most
    96 KiB of shared memory (two programs per SM) at every head_dim, group and dtype.
    """
    block_m = 128 if head_dim <= 128 else 64
    tile_n = 64 if head_dim <= 128 else 32
    return {"BLOCK_M": max(block_m, next_pow2(group)), "TILE_N": tile_n,
            "num_warps": 8, "num_stages": 2}


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                      *, sliding_window: int | None = None, block_m: int | None = None,
                      tile_n: int | None = None) -> torch.Tensor:
    """Causal attention of every request's new tokens to its context (prefix + themselves).

    query: [num_tokens, num_heads, head_dim]; request i's new tokens are rows
    query_start_loc[i] .. query_start_loc[i + 1] - 1 of it (int32, num_reqs + 1 entries).
    The offsets may be a slice of a larger batch's (they need not start at 0: rows before
    query_start_loc[0] are neither read nor written), with seq_lens and block_tables sliced
    to match. seq_lens: [num_reqs] int32, context lengths including the new tokens;
    block_tables: [>= num_reqs, max_blocks] int32.
    out: [num_tokens, num_heads, head_dim] (strided rows allowed). Returns out.
    """
    block_size, num_kv_heads, head_dim, group = check_attention_inputs(
        query, key_cache, value_cache, block_tables, seq_lens)
    window = check_sliding_window(sliding_window)
    num_seqs = seq_lens.shape[0]
    if (query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32
            or query_start_loc.shape[0] != num_seqs + 1):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] int32, got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    if query_start_loc.device != query.device:
        raise ValueError("query_start_loc must be on the query's device")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head_dim, "
                         f"got {tuple(out.shape)}")
    num_tokens = query.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    config = prefill_config(head_dim, group)
    if block_m is not None:
        config["BLOCK_M"] = block_m
    if tile_n is not None:
        config["TILE_N"] = tile_n
    block_q = config["BLOCK_M"] // group
    if block_q < 1:
        raise ValueError(f"block_m ({config['BLOCK_M']}) must be >= the group ({group})")
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, window, num_seqs,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=config["BLOCK_M"], BLOCK_Q=block_q,
        TILE_N=config["TILE_N"], SLIDING=window > 0, DOT_F32=dot_in_fp32(query.dtype),
        FP8=is_fp8_cache(key_cache), num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out
