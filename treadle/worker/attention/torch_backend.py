"""The `torch` attention backend: paged attention in plain torch ops, for any device.

Owns the metadata of one step for the torch path (decode groups padded to similar
context lengths, prefill spans with their causal masks), the K/V write by index_copy,
and the attention itself. The `cpu-native` backend reuses its pieces for what its C
kernels do not cover.

KV cache layout `heads_first` (worker/kv_cache.py): per layer [2, num_kv_heads,
num_blocks, block_size, head_dim]. The gather of a request's blocks runs over dim 0 of
the cache viewed as [kv_heads * num_blocks, block_size * head_dim], with one index per
(head, block) precomputed per step: torch's CPU `index_select` copies whole rows there,
3x faster than the same gather over dim 1 (measured: 1.25 ms against 3.7 ms for 64
requests x 512 tokens).

Why not `scaled_dot_product_attention` everywhere: on CPU, with a padding mask and
grouped-query heads, it was ~8x slower than the grouped matmuls below for decode batches
(measured with torch 2.13, 64 requests x 512 context: 17 ms against 2 ms). For a prefill
chunk of many tokens it is the faster one, and is used there (`_FUSED_PREFILL_MIN_SCORES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from treadle.worker.attention.base import (AttentionBackend, AttentionLayer, AttentionStep,
                                           Rotary, split_rotated)

_DECODE_GROUP_SPREAD = 2.0
"""Decodes are padded to the longest context of their group. A group holds contexts
within this factor of its shortest one, which bounds padding waste while keeping the
number of groups (each a few kernel launches per layer) to about log2(longest/shortest)."""
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


def gather_rows(block_table, num_kv_heads: int, num_cache_blocks: int) -> np.ndarray:
    """Row indices of the (head, block) view for a block table (numpy, any shape).

    Row h * num_cache_blocks + b holds block b of head h; the result is ordered head
    first, then the table's own order.
    """
    offsets = np.arange(num_kv_heads, dtype=np.int64).reshape(-1, 1) * num_cache_blocks
    return (offsets + np.asarray(block_table, dtype=np.int64).reshape(1, -1)).reshape(-1)


def decode_groups(step: AttentionStep, rows: np.ndarray, num_kv_heads: int,
                  device: torch.device) -> list[DecodeGroup]:
    """Single-token rows grouped by context length (each group padded to its longest)."""
    bs = step.block_size
    ctx_lens = step.context_lens
    rows = rows[np.argsort(ctx_lens[rows], kind="stable")]
    groups, first = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or ctx_lens[rows[j]] > _DECODE_GROUP_SPREAD * ctx_lens[rows[first]]:
            groups.append(rows[first:j])
            first = j
    result = []
    for group in groups:
        ctx = ctx_lens[group]
        num_blocks = int((ctx.max() + bs - 1) // bs)
        span = np.arange(num_blocks * bs)
        bias = np.where(span[None, :] < ctx[:, None], 0.0, -np.inf).astype(np.float32)
        gather = gather_rows(step.block_table[group, :num_blocks], num_kv_heads,
                             step.num_cache_blocks)
        result.append(DecodeGroup(
            token_indices=torch.from_numpy(step.query_starts[group]).to(device),
            gather_ids=torch.from_numpy(gather).to(device),
            num_blocks=num_blocks,
            mask_bias=torch.from_numpy(bias).view(1, len(group), 1, -1).to(device)))
    return result


def prefill_span(step: AttentionStep, row: int, num_kv_heads: int,
                 device: torch.device) -> PrefillSpan:
    """The span of a row with several new tokens (a prompt chunk, or a token with the
    proposed tokens after it), with its causal mask over the whole context."""
    bs = step.block_size
    first = int(step.query_starts[row])
    start, num_new = int(step.num_computed[row]), int(step.query_lens[row])
    num_blocks = (start + num_new + bs - 1) // bs
    query_pos = np.arange(start, start + num_new)
    key_pos = np.arange(num_blocks * bs)
    allowed = key_pos[None, :] <= query_pos[:, None]
    bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)
    gather = gather_rows(step.block_table[row, :num_blocks], num_kv_heads,
                         step.num_cache_blocks)
    return PrefillSpan(start=first, end=first + num_new,
                       gather_ids=torch.from_numpy(gather).to(device),
                       mask_bias=torch.from_numpy(bias).to(device),
                       allowed=torch.from_numpy(allowed).to(device))


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


def attend_decode_groups(query: torch.Tensor, kv_cache: torch.Tensor,
                         groups: list[DecodeGroup], out: torch.Tensor, scale: float) -> None:
    """Attention of the grouped single-token rows into `out` [tokens, heads * head_dim]."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    for dg in groups:
        num_reqs = dg.token_indices.numel()
        # [kv_heads, requests, group, head_dim]
        q = query.index_select(0, dg.token_indices).view(
            num_reqs, num_kv_heads, group, head_dim).transpose(0, 1)
        k, v = _gather_kv(kv_cache, dg.gather_ids, num_reqs, dg.workspace)
        probs = _softmax(torch.matmul(q, k.transpose(-1, -2)), scale, dg.mask_bias)
        o = torch.matmul(probs, v)  # [kv_heads, requests, group, head_dim]
        out.index_copy_(0, dg.token_indices, o.transpose(0, 1).reshape(num_reqs, -1))


def attend_prefill_spans(query: torch.Tensor, kv_cache: torch.Tensor,
                         spans: list[PrefillSpan], out: torch.Tensor, scale: float) -> None:
    """Causal attention of each span's tokens over its context, into `out`."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    for span in spans:
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


def _softmax(scores: torch.Tensor, scale: float, mask_bias: torch.Tensor) -> torch.Tensor:
    """Scaled, masked softmax in float32, returned in the scores' dtype."""
    probs = torch.softmax(scores.float() * scale + mask_bias, dim=-1)
    return probs.to(scores.dtype)


@dataclass
class TorchMetadata:
    """What every layer needs for one step on the torch path."""

    backend: "TorchBackend"
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot (block_id * block_size + offset) of each new token."""
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_spans: list[PrefillSpan] = field(default_factory=list)


class TorchBackend(AttentionBackend):
    """Grouped matmuls for decodes, torch's fused attention for long prefill chunks."""

    name = "torch"
    kv_layout = "heads_first"

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads

    def build_metadata(self, step: AttentionStep, device: torch.device) -> TorchMetadata:
        rows = np.flatnonzero(step.query_lens == 1)
        multi = np.flatnonzero(step.query_lens > 1)
        return TorchMetadata(
            self, torch.from_numpy(step.slot_mapping).to(device),
            decode_groups=(decode_groups(step, rows, self.num_kv_heads, device)
                           if rows.size else []),
            prefill_spans=[prefill_span(step, int(i), self.num_kv_heads, device)
                           for i in multi])

    def forward(self, layer: AttentionLayer, qk: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: TorchMetadata,
                rotary: Rotary | None) -> torch.Tensor:
        query, key = split_rotated(layer, qk, rotary)
        write_kv(kv_cache, key, value, meta.slot_mapping)
        out = query.new_empty(query.shape[0], layer.num_heads * layer.head_dim)
        attend_decode_groups(query, kv_cache, meta.decode_groups, out, layer.scale)
        attend_prefill_spans(query, kv_cache, meta.prefill_spans, out, layer.scale)
        return out
