"""The `torch` attention backend: paged attention in plain torch ops, for any device.

Owns the metadata of one step for the torch path (decode groups padded to similar
context lengths, prefill spans with their causal masks; for sliding-window layers a second
set, made on first use, that reads only the blocks inside each row's window), the K/V
write by index_copy, and the attention itself (logit softcapping included). The
`cpu-native` backend reuses its pieces for what its C kernels do not cover.

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

A quantized cache (`kv_cache_dtype` int8 / fp8_e4m3, worker/kv_quant.py): new K/V are
quantized on write, and the gathered context of each group or span is dequantized to the
queries' dtype before the matmuls (one request group's context, never the whole cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from treadle.worker import kv_quant
from treadle.layers.attention import AttentionLayer, AttentionStep, Rotary
from treadle.worker.attention.base import AttentionBackend, split_rotated

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
    plain_causal: bool = False
    """The context is the chunk itself (nothing before it, no window cutting in), so the
    mask is the plain causal one and scaled_dot_product_attention can take is_causal."""
    workspace: list[torch.Tensor] = field(default_factory=list)
    """Gather buffers for K and V, made by the first layer and reused by the others."""
    _sdpa_masks: dict = field(default_factory=dict)

    def sdpa_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """mask_bias in the queries' dtype, made by the first layer that asks: given a
        boolean mask, scaled_dot_product_attention converts it with a `where` per call
        (~4% of a 512-token prefill on 2 cores)."""
        if dtype not in self._sdpa_masks:
            self._sdpa_masks[dtype] = self.mask_bias.to(dtype)
        return self._sdpa_masks[dtype]


def gather_rows(block_table, num_kv_heads: int, num_cache_blocks: int) -> np.ndarray:
    """Row indices of the (head, block) view for a block table (numpy, any shape).

    Row h * num_cache_blocks + b holds block b of head h; the result is ordered head
    first, then the table's own order.
    """
    offsets = np.arange(num_kv_heads, dtype=np.int64).reshape(-1, 1) * num_cache_blocks
    return (offsets + np.asarray(block_table, dtype=np.int64).reshape(1, -1)).reshape(-1)


def _first_blocks(step: AttentionStep, first_query: np.ndarray,
                  window: int | None) -> np.ndarray:
    """Per row, the first block holding a key its queries may see: 0 without a window,
    else the block of position first_query - window + 1 (earlier blocks are never read:
    the KV manager may have freed them, core/kv/sliding.py)."""
    if window is None:
        return np.zeros(first_query.shape, dtype=np.int64)
    return np.maximum(first_query - window + 1, 0) // step.block_size


def decode_groups(step: AttentionStep, rows: np.ndarray, num_kv_heads: int,
                  device: torch.device, window: int | None = None) -> list[DecodeGroup]:
    """Single-token rows grouped by the length of context they read (each group padded to
    its longest); with a window, each row reads only the blocks inside it."""
    bs = step.block_size
    ctx_lens = step.context_lens
    first_block = _first_blocks(step, ctx_lens - 1, window)
    span_lens = ctx_lens - first_block * bs  # positions from the first block read
    rows = rows[np.argsort(span_lens[rows], kind="stable")]
    groups, first = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or span_lens[rows[j]] > _DECODE_GROUP_SPREAD * span_lens[rows[first]]:
            groups.append(rows[first:j])
            first = j
    last_column = step.block_table.shape[1] - 1
    result = []
    for group in groups:
        ctx = ctx_lens[group]
        num_blocks = int((span_lens[group].max() + bs - 1) // bs)
        columns = np.minimum(first_block[group, None] + np.arange(num_blocks)[None, :],
                             last_column)
        table = np.take_along_axis(step.block_table[group], columns, axis=1)
        key_pos = first_block[group, None] * bs + np.arange(num_blocks * bs)[None, :]
        allowed = key_pos < ctx[:, None]
        if window is not None:
            allowed &= key_pos > ctx[:, None] - 1 - window
        bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)
        gather = gather_rows(table, num_kv_heads, step.num_cache_blocks)
        result.append(DecodeGroup(
            token_indices=torch.from_numpy(step.query_starts[group]).to(device),
            gather_ids=torch.from_numpy(gather).to(device),
            num_blocks=num_blocks,
            mask_bias=torch.from_numpy(bias).view(1, len(group), 1, -1).to(device)))
    return result


def prefill_span(step: AttentionStep, row: int, num_kv_heads: int,
                 device: torch.device, window: int | None = None) -> PrefillSpan:
    """The span of a row with several new tokens (a prompt chunk, or a token with the
    proposed tokens after it), with its causal mask over the context it reads (the whole
    context, or with a window the blocks inside the first query's window onwards)."""
    bs = step.block_size
    first = int(step.query_starts[row])
    start, num_new = int(step.num_computed[row]), int(step.query_lens[row])
    num_blocks = (start + num_new + bs - 1) // bs
    first_block = int(_first_blocks(step, np.array([start]), window)[0])
    query_pos = np.arange(start, start + num_new)
    key_pos = np.arange(first_block * bs, num_blocks * bs)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)
    gather = gather_rows(step.block_table[row, first_block:num_blocks], num_kv_heads,
                         step.num_cache_blocks)
    return PrefillSpan(start=first, end=first + num_new,
                       gather_ids=torch.from_numpy(gather).to(device),
                       mask_bias=torch.from_numpy(bias).to(device),
                       plain_causal=start == 0 and (window is None or window >= num_new))


@dataclass
class LayerViews:
    """A step's decode groups and prefill spans for the layers of one attention kind
    (a sliding window, or none), built by the first such layer and shared by the others."""

    decode_groups: list[DecodeGroup]
    prefill_spans: list[PrefillSpan]
    slot_mapping: torch.Tensor | None = None
    """Where these layers write the new K/V, when not at the step's own slots (the
    sliding-window layers' pool: AttentionStep.sliding)."""


def layer_views(step: AttentionStep, num_kv_heads: int, device: torch.device,
                window: int | None, rows: np.ndarray | None = None) -> LayerViews:
    """The torch path's views of `rows` (default: every row), for layers with `window`
    (over the sliding layers' own tables and slots when the step has them)."""
    slots = None
    if window is not None and step.sliding is not None:
        step = step.sliding
        slots = torch.from_numpy(step.slot_mapping).to(device)
    rows = np.arange(len(step.query_lens)) if rows is None else rows
    single = rows[step.query_lens[rows] == 1]
    multi = rows[step.query_lens[rows] > 1]
    return LayerViews(
        decode_groups(step, single, num_kv_heads, device, window) if single.size else [],
        [prefill_span(step, int(i), num_kv_heads, device, window) for i in multi], slots)


def _gather_kv(kv_cache: torch.Tensor, gather_ids: torch.Tensor, groups: int,
               workspace: list[torch.Tensor], kind: str = "auto",
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [kv_heads, groups, tokens, head_dim] each, gathered into `workspace`
    (and, from a quantized cache of format `kind`, dequantized to `dtype`).

    Every layer of a step gathers the same shapes, so the buffers are made once per step:
    fresh multi-megabyte tensors per layer cost page faults on every call.
    """
    _, num_kv_heads, num_blocks, block_size, row = kv_cache.shape
    rows = kv_cache.view(2, num_kv_heads * num_blocks, block_size * row)
    if not workspace:
        workspace.extend(rows.new_empty(2, gather_ids.numel(), block_size * row))
    key, value = workspace
    torch.index_select(rows[0], 0, gather_ids, out=key)
    torch.index_select(rows[1], 0, gather_ids, out=value)
    key, value = key.view(num_kv_heads, groups, -1, row), value.view(num_kv_heads, groups, -1, row)
    if kv_quant.is_quantized(kind):
        return kv_quant.dequantize(key, kind, dtype), kv_quant.dequantize(value, kind, dtype)
    return key, value


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, kind: str = "auto") -> None:
    """Store the new tokens' K and V ([num_tokens, kv_heads, head_dim]) at their slots
    (quantized first when the cache's format `kind` is)."""
    num_kv_heads, num_blocks, block_size, row = kv_cache.shape[1:]
    if kv_quant.is_quantized(kind):
        key, value = kv_quant.quantize(key, kind), kv_quant.quantize(value, kind)
    flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, row)
    flat[0].index_copy_(1, slot_mapping, key.transpose(0, 1))
    flat[1].index_copy_(1, slot_mapping, value.transpose(0, 1))


def attend_decode_groups(query: torch.Tensor, kv_cache: torch.Tensor,
                         groups: list[DecodeGroup], out: torch.Tensor, scale: float,
                         softcap: float | None = None, kind: str = "auto") -> None:
    """Attention of the grouped single-token rows into `out` [tokens, heads * head_dim]."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    for dg in groups:
        num_reqs = dg.token_indices.numel()
        # [kv_heads, requests, group, head_dim]
        q = query.index_select(0, dg.token_indices).view(
            num_reqs, num_kv_heads, group, head_dim).transpose(0, 1)
        k, v = _gather_kv(kv_cache, dg.gather_ids, num_reqs, dg.workspace, kind, query.dtype)
        probs = _softmax(torch.matmul(q, k.transpose(-1, -2)), scale, dg.mask_bias, softcap)
        o = torch.matmul(probs, v)  # [kv_heads, requests, group, head_dim]
        out.index_copy_(0, dg.token_indices, o.transpose(0, 1).reshape(num_reqs, -1))


def attend_prefill_spans(query: torch.Tensor, kv_cache: torch.Tensor,
                         spans: list[PrefillSpan], out: torch.Tensor, scale: float,
                         softcap: float | None = None, kind: str = "auto") -> None:
    """Causal attention of each span's tokens over its context, into `out`."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    for span in spans:
        n = span.end - span.start
        k, v = _gather_kv(kv_cache, span.gather_ids, 1, span.workspace, kind, query.dtype)
        if softcap is None and n * span.mask_bias.shape[1] >= _FUSED_PREFILL_MIN_SCORES:
            # [1, heads, n, head_dim] against [1, kv_heads, context, head_dim]
            q = query[span.start:span.end].transpose(0, 1).unsqueeze(0)
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            if span.plain_causal:
                # The keys are the chunk's own tokens: torch's causal flag (top-left aligned,
                # which is right when there are as many keys as queries) skips the masked
                # half instead of reading a mask over it.
                o = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.sdpa_mask(q.dtype),
                                                   scale=scale, enable_gqa=True)
            out[span.start:span.end] = o[0].transpose(0, 1).reshape(n, -1)
            continue
        # [kv_heads, group, n, head_dim]
        q = query[span.start:span.end].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        probs = _softmax(torch.matmul(q, k.transpose(-1, -2)), scale, span.mask_bias, softcap)
        o = torch.matmul(probs, v)  # [kv_heads, group, n, head_dim]
        out[span.start:span.end] = o.permute(2, 0, 1, 3).reshape(n, -1)


def _softmax(scores: torch.Tensor, scale: float, mask_bias: torch.Tensor,
             softcap: float | None = None) -> torch.Tensor:
    """Scaled (and soft-capped), masked softmax in float32, in the scores' dtype."""
    scaled = scores.float() * scale
    if softcap is not None:
        scaled = torch.tanh(scaled / softcap) * softcap
    probs = torch.softmax(scaled + mask_bias, dim=-1)
    return probs.to(scores.dtype)


@dataclass
class TorchMetadata:
    """What every layer needs for one step on the torch path."""

    backend: "TorchBackend"
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot (block_id * block_size + offset) of each new token."""
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_spans: list[PrefillSpan] = field(default_factory=list)
    step: AttentionStep | None = None
    device: torch.device | None = None
    windowed: dict[int, LayerViews] = field(default_factory=dict)
    """Views of sliding-window layers by window, made on first use."""

    def views(self, window: int | None) -> LayerViews:
        if window is None:
            return LayerViews(self.decode_groups, self.prefill_spans)
        if window not in self.windowed:
            self.windowed[window] = layer_views(self.step, self.backend.num_kv_heads,
                                                self.device, window)
        return self.windowed[window]


class TorchBackend(AttentionBackend):
    """Grouped matmuls for decodes, torch's fused attention for long prefill chunks."""

    name = "torch"
    kv_layout = "heads_first"

    def __init__(self, num_kv_heads: int, kv_cache_dtype: str = "auto") -> None:
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)

    def build_metadata(self, step: AttentionStep, device: torch.device) -> TorchMetadata:
        views = layer_views(step, self.num_kv_heads, device, None)
        return TorchMetadata(self, torch.from_numpy(step.slot_mapping).to(device),
                             decode_groups=views.decode_groups,
                             prefill_spans=views.prefill_spans, step=step, device=device)

    def forward(self, layer: AttentionLayer, qk: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: TorchMetadata,
                rotary: Rotary | None) -> torch.Tensor:
        query, key = split_rotated(layer, qk, rotary)
        kind = self.kv_cache_dtype
        views = meta.views(layer.sliding_window)
        write_kv(kv_cache, key, value,
                 meta.slot_mapping if views.slot_mapping is None else views.slot_mapping, kind)
        out = query.new_empty(query.shape[0], layer.num_heads * layer.head_dim)
        attend_decode_groups(query, kv_cache, views.decode_groups, out, layer.scale,
                             layer.logit_softcap, kind)
        attend_prefill_spans(query, kv_cache, views.prefill_spans, out, layer.scale,
                             layer.logit_softcap, kind)
        return out
