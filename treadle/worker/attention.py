"""Attention over the paged KV cache for a flat batch of mixed prefill chunks and decodes.

Owns the metadata of one step's attention (built once per step by the model runner and
shared by every layer) and the torch implementation used on CPU. It does not decide
which tokens run; it only computes what the metadata describes.

KV cache layout, per layer: one tensor of shape [2, num_kv_heads, num_blocks, block_size,
head_dim] (K then V). Keeping the head dimension outermost makes a gather of a request's
blocks yield [kv_heads, tokens, head_dim] directly, which is the operand layout of a
batched matmul: no transpose copy per layer. The gather runs over dim 0 of the cache
viewed as [kv_heads * num_blocks, block_size * head_dim], with one index per (head,
block) precomputed by the runner: torch's CPU `index_select` copies whole rows there, 3x
faster than the same gather over dim 1 (measured: 1.25 ms against 3.7 ms for 64 requests
x 512 tokens).

Why not `scaled_dot_product_attention` everywhere: on CPU, with a padding mask and
grouped-query heads, it was ~8x slower than the grouped matmuls below for decode batches
(measured with torch 2.13, 64 requests x 512 context: 17 ms against 2 ms). For a prefill
chunk of many tokens it is the faster one, and is used there (`_FUSED_PREFILL_MIN_SCORES`)
when the C prefill kernel (`NativePrefill`, bf16 on CPUs with AVX-512 BF16; 2-3x faster
again) cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

_FUSED_PREFILL_MIN_SCORES = 4096
"""Query x context positions from which a prefill chunk uses torch's fused attention:
it never holds the float32 score matrix, ~3.5x faster for a 512-token chunk over 512-1024
positions (measured: 4.5 ms against 16.5 ms per layer, bf16, 2 cores); below this the
grouped matmuls are as fast."""


@dataclass
class DecodeGroup:
    """Requests with one new token each and similar context lengths, padded together."""

    token_indices: torch.Tensor
    """[num_requests] rows of these requests' tokens in the flat batch."""
    gather_ids: torch.Tensor
    """[kv_heads * num_requests * num_blocks] rows of the cache's (head, block) view that
    hold the requests' padded block tables (see `gather_rows`)."""
    num_blocks: int
    """Blocks per request after padding (the longest table in the group)."""
    mask_bias: torch.Tensor
    """[1, num_requests, 1, num_blocks * block_size]: 0 for real context, -inf for padding."""
    workspace: list[torch.Tensor] = field(default_factory=list)
    """Gather buffers for K and V, made by the first layer and reused by the others."""


@dataclass
class PrefillSpan:
    """One request's chunk of several new tokens (a prompt chunk or a recompute)."""

    start: int
    """First row of the chunk in the flat batch."""
    end: int
    """One past the last row."""
    gather_ids: torch.Tensor
    """[kv_heads * num_blocks] rows of the cache's (head, block) view holding the request's
    context, new tokens included (see `gather_rows`)."""
    mask_bias: torch.Tensor
    """[end - start, num_blocks * block_size]: causal mask over the whole context."""
    allowed: torch.Tensor
    """The same mask as booleans (True: attend), for scaled_dot_product_attention."""
    workspace: list[torch.Tensor] = field(default_factory=list)
    """Gather buffers for K and V, made by the first layer and reused by the others."""


@dataclass
class NativeDecode:
    """All decode tokens of a step for the C kernel: no grouping, no padding waste."""

    kernels: Any
    """worker.native.NativeKernels"""
    num_rows: int
    """Decode tokens occupy rows [0, num_rows) of the flat batch."""
    block_table: torch.Tensor
    """[num_rows, max_blocks] int64 block tables (padding past each context is not read)."""
    ctx_lens: torch.Tensor
    """[num_rows] int64 context length of each request, its new token included."""


@dataclass
class NativePrefill:
    """All prefill spans of a step for the C kernel (worker/kernels/paged_prefill.c)."""

    kernels: Any
    """worker.native.NativeKernels"""
    spans: torch.Tensor
    """[num_spans, 3] int64: first row in the flat batch, new tokens, positions before."""
    block_tables: torch.Tensor
    """[num_spans, max_blocks] int64."""
    workspace: torch.Tensor
    """Packed K/V buffer, made once per step and reused by every layer."""


@dataclass
class AttentionMetadata:
    """What every attention layer needs for one step."""

    num_tokens: int
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot (block_id * block_size + offset) each new token's K/V goes to."""
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_spans: list[PrefillSpan] = field(default_factory=list)
    native_decode: NativeDecode | None = None
    native_prefill: NativePrefill | None = None


def gather_rows(block_table, num_kv_heads: int, num_cache_blocks: int):
    """Row indices of the (head, block) view for a block table (numpy, any shape).

    Row h * num_cache_blocks + b holds block b of head h; the result is ordered head
    first, then the table's own order.
    """
    import numpy as np

    offsets = np.arange(num_kv_heads, dtype=np.int64).reshape(-1, 1) * num_cache_blocks
    return (offsets + np.asarray(block_table, dtype=np.int64).reshape(1, -1)).reshape(-1)


def _gather_kv(kv_cache: torch.Tensor, gather_ids: torch.Tensor, groups: int,
               workspace: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [kv_heads, groups, tokens, head_dim] each, gathered into `workspace`.

    Every layer of a step gathers the same shapes, so the buffers are made once per step:
    fresh multi-megabyte tensors per layer cost page faults on every call.
    """
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    rows = kv_cache.view(2, num_kv_heads * num_blocks, block_size * head_dim)
    if not workspace:
        workspace.extend(rows.new_empty(2, gather_ids.numel(), block_size * head_dim))
    key, value = workspace
    torch.index_select(rows[0], 0, gather_ids, out=key)
    torch.index_select(rows[1], 0, gather_ids, out=value)
    return (key.view(num_kv_heads, groups, -1, head_dim),
            value.view(num_kv_heads, groups, -1, head_dim))


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K and V ([num_tokens, kv_heads, head_dim]) at their slots."""
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
    flat[0].index_copy_(1, slot_mapping, key.transpose(0, 1))
    flat[1].index_copy_(1, slot_mapping, value.transpose(0, 1))


def paged_attention(query: torch.Tensor, key: torch.Tensor | None,
                    value: torch.Tensor | None, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each token to its context.

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, kv_heads, head_dim],
    or None when the caller already stored them (NativeLayerOps.rope_kv).
    Returns [num_tokens, num_heads * head_dim].
    """
    if key is not None:
        write_kv(kv_cache, key, value, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    out = query.new_empty(num_tokens, num_heads * head_dim)

    nd = meta.native_decode
    if nd is not None:
        rows = nd.num_rows
        nd.kernels.paged_decode(query[:rows].contiguous(), kv_cache[0], kv_cache[1],
                                nd.block_table, nd.ctx_lens,
                                out[:rows].view(rows, num_heads, head_dim), scale)

    npf = meta.native_prefill
    if npf is not None:
        npf.kernels.paged_prefill(query, kv_cache[0], kv_cache[1], npf.spans,
                                  npf.block_tables, out, npf.workspace, scale)

    for dg in meta.decode_groups:
        num_reqs = dg.token_indices.numel()
        # [kv_heads, requests, group, head_dim]
        q = query.index_select(0, dg.token_indices).view(
            num_reqs, num_kv_heads, group, head_dim).transpose(0, 1)
        k, v = _gather_kv(kv_cache, dg.gather_ids, num_reqs, dg.workspace)
        probs = _softmax(torch.matmul(q, k.transpose(-1, -2)), scale, dg.mask_bias)
        o = torch.matmul(probs, v)  # [kv_heads, requests, group, head_dim]
        out.index_copy_(0, dg.token_indices, o.transpose(0, 1).reshape(num_reqs, -1))

    for span in meta.prefill_spans:
        n = span.end - span.start
        k, v = _gather_kv(kv_cache, span.gather_ids, 1, span.workspace)
        if n * span.allowed.shape[1] >= _FUSED_PREFILL_MIN_SCORES:
            # [1, heads, n, head_dim] against [1, kv_heads, context, head_dim]
            o = F.scaled_dot_product_attention(
                query[span.start:span.end].transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1), v.transpose(0, 1), attn_mask=span.allowed, scale=scale,
                enable_gqa=True)
            out[span.start:span.end] = o[0].transpose(0, 1).reshape(n, -1)
            continue
        # [kv_heads, group, n, head_dim]
        q = query[span.start:span.end].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        probs = _softmax(torch.matmul(q, k.transpose(-1, -2)), scale, span.mask_bias)
        o = torch.matmul(probs, v)  # [kv_heads, group, n, head_dim]
        out[span.start:span.end] = o.permute(2, 0, 1, 3).reshape(n, -1)
    return out


def _softmax(scores: torch.Tensor, scale: float, mask_bias: torch.Tensor) -> torch.Tensor:
    """Scaled, masked softmax in float32, returned in the scores' dtype."""
    probs = torch.softmax(scores.float() * scale + mask_bias, dim=-1)
    return probs.to(scores.dtype)
