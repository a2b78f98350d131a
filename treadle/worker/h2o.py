"""Heavy-hitter (H2O) eviction, the worker's half: attention scores, and compaction.

The engine core decides when a request is compacted and to how many tokens
(kv_specs/eviction.py); the worker holds what that choice needs and the core cannot see:
every cached token's accumulated attention, the probability mass it has received from
every query since it was computed, summed over heads and layers. A compaction keeps the
`num_recent` most recent tokens and the highest-scoring others (ties to the earlier
token), in their order, and moves them to the first slots of the request's new table.

One set of kept tokens per request, shared by all heads and layers: a paged block table
is per request, so per-head selection, as in the H2O paper's own implementation, would
need a table per head. Scores are computed beside the backend's attention, in float32
from the rotated queries and the cached keys (dequantized when the cache is quantized),
so any backend works; the cost is a second attention pass over the tracked rows, which
is why eviction is opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.outputs import KVCompaction
from treadle.worker import kv_quant
from treadle.layers.attention import AttentionStep


def select_kept(scores: torch.Tensor, num_kept: int, num_recent: int) -> torch.Tensor:
    """Indices (ascending) of the tokens a compaction keeps: the last `num_recent`, and the
    `num_kept - num_recent` highest `scores` before them (stable: ties to the earlier)."""
    n = scores.shape[0]
    if num_kept >= n:
        return torch.arange(n)
    num_recent = min(num_recent, num_kept)
    older = n - num_recent
    order = torch.sort(scores[:older], descending=True, stable=True).indices
    heavy = order[:num_kept - num_recent]
    return torch.cat([torch.sort(heavy).values, torch.arange(older, n)])


def _slot_view(cache: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The cache with its block and in-block dimensions as one slot dimension (a view:
    writes reach the cache)."""
    shape = cache.shape
    return cache.view(*shape[:block_dim], -1, *shape[block_dim + 2:])


def _slots(block_ids: list[int], indices: np.ndarray, block_size: int) -> np.ndarray:
    table = np.asarray(block_ids, dtype=np.int64)
    return table[indices // block_size] * block_size + indices % block_size


@dataclass
class _Row:
    request_id: str
    first: int
    num_new: int
    context: int
    slots: torch.Tensor
    """Cache slot of each of its context's tokens, in cache order."""


class StepScores:
    """One step's observer (set on the attention metadata): adds each layer's attention
    of the step's queries to the requests' scores."""

    def __init__(self, tracker: "HeavyHitterTracker", rows: list[_Row]) -> None:
        self.tracker = tracker
        self.rows = rows

    def observe(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, rotary) -> None:
        """query: [tokens, heads, head_dim] before rotation; kv_cache: the layer's cache,
        this step's keys already written."""
        tracker = self.tracker
        if rotary is not None:
            query = rotary.apply(query)
        keys = _slot_view(kv_cache, tracker.block_dim)[0]
        group = layer.num_heads // layer.num_kv_heads
        for row in self.rows:
            if tracker.block_dim == 2:  # heads_first: [kv_heads, slots, row]
                k = keys.index_select(1, row.slots)
            else:  # blocks_first: [slots, kv_heads, row]
                k = keys.index_select(0, row.slots).transpose(0, 1)
            k = (kv_quant.dequantize(k, tracker.kv_cache_dtype) if tracker.quantized
                 else k.float())
            k = k.repeat_interleave(group, dim=0)  # [heads, ctx, d]
            q = query[row.first:row.first + row.num_new].float().transpose(0, 1)
            logits = q @ k.transpose(1, 2) * layer.scale  # [heads, new, ctx]
            if layer.logit_softcap is not None:
                logits = torch.tanh(logits / layer.logit_softcap) * layer.logit_softcap
            ctx, new = row.context, row.num_new
            q_pos = torch.arange(ctx - new, ctx)[:, None]
            logits = logits.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
            mass = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [ctx]
            tracker.scores[row.request_id][:ctx] += mass.to(torch.float64)


class HeavyHitterTracker:
    """Per request, the accumulated attention of each cached token; compactions."""

    def __init__(self, block_size: int, block_dim: int, kv_cache_dtype: str = "auto") -> None:
        self.block_size = block_size
        self.block_dim = block_dim
        """The cache tensors' block dimension (worker/kv_cache.py KV_LAYOUTS)."""
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = kv_quant.is_quantized(kv_cache_dtype)
        self.scores: dict[str, torch.Tensor] = {}
        """request id -> float64 [tokens in its cache] (float64: sums over thousands of
        queries and every layer and head stay exact enough to rank)."""
        self.positions: dict[str, torch.Tensor] = {}
        """request id -> int64 [tokens in its cache]: each cached token's position."""

    def drop(self, request_ids) -> None:
        """Forget requests that finished or lost their KV (a recompute starts afresh)."""
        for request_id in request_ids:
            self.scores.pop(request_id, None)
            self.positions.pop(request_id, None)

    def _scores(self, request_id: str, num_tokens: int, first_position: int | None = None
                ) -> torch.Tensor:
        """Its scores, grown to `num_tokens` with zeros (new tokens, prefix hits); the
        new entries' positions follow from `first_position`, that of the cache's entry
        num_tokens - 1 less the new ones (None: continue from the last known)."""
        scores = self.scores.get(request_id)
        if scores is None or scores.shape[0] < num_tokens:
            old = 0 if scores is None else scores.shape[0]
            grown = torch.zeros(num_tokens, dtype=torch.float64)
            if scores is not None:
                grown[:old] = scores
            self.scores[request_id] = scores = grown
            known = self.positions.get(request_id, torch.zeros(0, dtype=torch.int64))
            start = (int(known[-1]) + 1 if old else 0) if first_position is None \
                else first_position
            self.positions[request_id] = torch.cat(
                [known[:old], torch.arange(start, start + num_tokens - old)])
        return scores

    def step_observer(self, step: AttentionStep, request_ids: list[str],
                      positions: np.ndarray) -> StepScores:
        """The observer of one step whose rows (in the runner's order) are these requests;
        `positions`: each row's first new token's position."""
        bs = step.block_size
        rows = []
        for i, request_id in enumerate(request_ids):
            ctx = int(step.context_lens[i])
            known = self.scores.get(request_id)
            num_known = 0 if known is None else known.shape[0]
            # entries past num_known: (prefix hits and) this step's tokens, positions
            # running up to the last new token's
            first = int(positions[i]) + int(step.query_lens[i]) - (ctx - num_known)
            cache_index = np.arange(ctx)
            slots = step.block_table[i, cache_index // bs] * bs + cache_index % bs
            self._scores(request_id, ctx, first)
            rows.append(_Row(request_id, int(step.query_starts[i]), int(step.query_lens[i]),
                             ctx, torch.from_numpy(slots)))
        return StepScores(self, rows)

    def compact(self, compactions: list[KVCompaction], kv_caches: list[torch.Tensor]) -> int:
        """Carry out the step's compactions on every layer's cache; returns tokens moved."""
        moved = 0
        for c in compactions:
            scores = self._scores(c.request_id, c.num_tokens)[:c.num_tokens]
            kept = select_kept(scores, c.num_kept, c.num_recent)
            src = _slots(c.src_block_ids, kept.numpy(), self.block_size)
            dst = _slots(c.dst_block_ids, np.arange(c.num_kept), self.block_size)
            self.scores[c.request_id] = scores[kept].clone()
            self.positions[c.request_id] = self.positions[c.request_id][:c.num_tokens][kept]
            change = src != dst  # kept tokens already in place stay
            if not change.any():
                continue
            src_t = torch.from_numpy(src[change])
            dst_t = torch.from_numpy(dst[change])
            dim = self.block_dim
            for cache in kv_caches:
                flat = _slot_view(cache, dim)
                flat.index_copy_(dim, dst_t.to(cache.device),
                                 flat.index_select(dim, src_t.to(cache.device)))
            moved += int(change.sum())
        return moved
