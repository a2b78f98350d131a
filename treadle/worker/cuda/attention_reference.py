"""Plain-torch paged attention: the reference every GPU kernel is tested against.

Owns one function that computes, request by request and in float32, what the Triton
kernels (worker/cuda/triton/) compute for a flat batch of mixed decodes and prefill chunks over
the paged KV layout of docs/gpu.md: per layer, K and V each of shape
[num_blocks, block_size, num_kv_heads, head_dim]. It is slow on purpose (a Python loop
per request, the whole score matrix materialised) and must never be used to serve.
"""

from __future__ import annotations

import torch


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_tables: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens to its whole context.

    query: [num_tokens, num_heads, head_dim], the new tokens of request i in rows
    query_start_loc[i]:query_start_loc[i + 1] (int32, cumulative, num_reqs + 1 entries).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    block_tables: [num_reqs, max_blocks] int32; token t of request i is in block
    block_tables[i, t // block_size] at offset t % block_size.
    seq_lens: [num_reqs] context length of each request, its new tokens included, so the
    new tokens sit at positions seq_len - num_new .. seq_len - 1.
    sliding_window: a query at position p sees keys at positions p - sliding_window + 1 .. p
    (Mistral's and Gemma's convention: the window counts the query itself); None: all.
    Returns [num_tokens, num_heads, head_dim] in the query's dtype.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_new = q_end - q_start
        if num_new == 0:
            continue
        if not 0 < num_new <= seq_len:
            raise ValueError(f"request {i}: {num_new} new tokens with seq_len {seq_len}")
        blocks = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, head_dim]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_start:q_end].float().transpose(0, 1)        # [heads, num_new, head_dim]
        q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device).view(-1, 1)
        k_pos = torch.arange(seq_len, device=query.device).view(1, -1)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q_start:q_end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
    return out.to(query.dtype)
