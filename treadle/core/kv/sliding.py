"""The sliding-window layer group's blocks: a second block table per request whose blocks
are freed once they fall out of the window.

A model whose layers are partly (Gemma 3: five in six) or wholly (Mistral) sliding-window
layers keeps two layer groups, as vLLM's hybrid KV manager does: the full-attention layers
hold every block of a request (kv_cache_manager's table and pool), the sliding layers hold
only the blocks a query can still see, from their own pool and KV tensors. A query at
position p sees keys p - window + 1 .. p, so before a step whose first new token sits at
position c, every sliding block wholly before position c - window + 1 is freed (and again
after the step, for the next one); a request then holds at most
ceil((window - 1) / block_size) + 1 sliding blocks between steps, plus the blocks of the
tokens it computes in a step.

Block table entries of freed blocks keep a stale id: the attention backends read a
sliding layer's keys only from the block of its first query's window onwards
(worker/attention/torch_backend.py), never the entries before.

Prefix caching: the sliding group's full blocks are registered under the same chained
hashes as the full group's. A prefix hit of k blocks is usable only if the sliding pool
still has the blocks inside the window before position k * block_size (cached, or
cached-free and not yet evicted); the hit is shortened to the longest such k. So a hit
never goes beyond what the sliding layers can attend from: blocks freed out of the window
and since evicted cut it short.

`split_blocks` sizes both pools from one memory budget. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.core.kv.block_pool import BlockPool, KVBlock

PLACEHOLDER_BLOCK = 0
"""The id written in a table entry whose block was freed or never held (never read)."""


@dataclass(frozen=True)
class LayerGroups:
    """How a model's KV memory splits between its full and its sliding layers."""

    window: int
    num_full_layers: int
    num_sliding_layers: int
    num_full_blocks: int
    """Blocks of the full group (the request-level capacity: every token of a context
    holds one slot there). Without full layers it is bookkeeping only (no tensors)."""
    num_sliding_blocks: int


def layer_groups(layer_windows: list[int | None] | tuple, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> LayerGroups | None:
    """The two groups' block counts for the memory of `num_blocks` whole-model blocks, or
    None when no layer slides (or the window covers the whole context).

    Memory is counted in layer-blocks: num_blocks * num_layers of them. The sliding pool
    gets what the most requests the scheduler runs at once can hold (each its window plus
    two partial blocks, and together one step's worth of new tokens), and never more than
    it would without a window; the full layers get the rest. Both the engine core and the
    worker call this with the same figures, so they agree without a message."""
    windows = {w for w in layer_windows if w is not None}
    if not windows:
        return None
    if len(windows) > 1:
        raise ValueError(f"layers with different sliding windows {sorted(windows)} are not "
                         "supported (one sliding group)")
    window = windows.pop()
    if window >= max_model_len:
        return None  # the window never cuts anything: plain full attention
    num_layers = len(layer_windows)
    num_sliding = sum(w is not None for w in layer_windows)
    num_full = num_layers - num_sliding
    per_request = -(-(window - 1) // block_size) + 2
    need = max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)
    num_sliding_blocks = min(num_blocks, need)
    if num_full:
        num_full_blocks = (num_blocks * num_layers - num_sliding_blocks * num_sliding) // num_full
    else:  # bookkeeping only: room for every request's whole context, within reason
        contexts = max_num_seqs * -(-max_model_len // block_size)
        num_full_blocks = max(num_blocks, min(contexts, 16 * num_blocks))
    return LayerGroups(window, num_full, num_sliding, num_full_blocks, num_sliding_blocks)


class SlidingWindowGroup:
    """Per request, the sliding layers' blocks by block index: a KVBlock while held, None
    once freed (or never held, before a prefix hit's window)."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.window = window
        self._tables: dict[str, list[KVBlock | None]] = {}
        self._ids: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}
        self._first_held: dict[str, int] = {}
        """Index of the first entry that may still hold a block (earlier ones are None)."""

    def first_needed_block(self, first_query_pos: int) -> int:
        """The first block a query at this position (or later) can still see."""
        return max(0, first_query_pos - self.window + 1) // self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The request's sliding block table (the live list; freed entries stale)."""
        return self._ids[request_id]

    def num_held_blocks(self, request_id: str) -> int:
        table = self._tables.get(request_id, ())
        return sum(block is not None for block in table)

    # ----- prefix hits --------------------------------------------------------------------

    def usable_hit(self, hashes: list[bytes], num_hit_blocks: int) -> int:
        """The longest k <= num_hit_blocks for which the sliding pool holds the blocks of
        the window before position k * block_size."""
        for k in range(num_hit_blocks, 0, -1):
            first = self.first_needed_block(k * self.block_size)
            if all(self.pool.lookup(h) is not None for h in hashes[first:k]):
                return k
        return 0

    def hit_blocks(self, hashes: list[bytes], num_hit_blocks: int) -> list[KVBlock] | None:
        """The cached sliding blocks of a k-block hit (the window before it), or None
        when one was evicted since usable_hit."""
        first = self.first_needed_block(num_hit_blocks * self.block_size)
        blocks = [self.pool.lookup(h) for h in hashes[first:num_hit_blocks]]
        return None if any(b is None for b in blocks) else blocks

    # ----- allocation ---------------------------------------------------------------------

    def num_blocks_short(self, request_id: str, num_computed: int, num_tokens_after: int,
                         hit: list[KVBlock] = ()) -> int:
        """Blocks missing for the request to hold [num_computed, num_tokens_after) after
        freeing what falls out of the window (negative: spare)."""
        table = self._tables.get(request_id, ())
        first = self.first_needed_block(num_computed)
        num_after = -(-num_tokens_after // self.block_size)
        start = max(len(table), first) if not hit else num_computed // self.block_size
        freeable = sum(1 for b in table[:first] if b is not None and b.ref_cnt == 1)
        needed = max(num_after - start, 0) + self.pool.num_reusable_from_free(hit)
        return needed - self.pool.num_free_blocks - freeable

    def allocate(self, request_id: str, num_computed: int, num_tokens_after: int,
                 hit: list[KVBlock] = ()) -> None:
        """Hold the blocks of [num_computed, num_tokens_after) (the caller checked
        num_blocks_short); `hit`: a new request's prefix-hit blocks (hit_blocks)."""
        table = self._tables.setdefault(request_id, [])
        ids = self._ids.setdefault(request_id, [])
        if hit:
            assert not table, "prefix hits are only taken by a request that holds no blocks"
            num_hit = num_computed // self.block_size
            first = num_hit - len(hit)
            table.extend([None] * first)
            ids.extend([PLACEHOLDER_BLOCK] * first)
            self.pool.touch(hit)
            table.extend(hit)
            ids.extend(b.block_id for b in hit)
            self._num_cached[request_id] = num_hit
            self._first_held[request_id] = first
        self.release_out_of_window(request_id, num_computed)
        num_after = -(-num_tokens_after // self.block_size)
        first = self.first_needed_block(num_computed)
        if len(table) < first:  # blocks skipped whole (never needed): placeholders
            ids.extend([PLACEHOLDER_BLOCK] * (first - len(table)))
            table.extend([None] * (first - len(table)))
        if num_after > len(table):
            new_blocks = self.pool.allocate(num_after - len(table))
            table.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)

    def release_out_of_window(self, request_id: str, next_query_pos: int) -> int:
        """Free the blocks no query from `next_query_pos` on can see; how many."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        first = min(self.first_needed_block(next_query_pos), len(table))
        start = self._first_held.get(request_id, 0)
        dropped = [b for b in table[start:first] if b is not None]
        for i in range(start, first):
            table[i] = None
        if first > start:
            self._first_held[request_id] = first
        if dropped:
            self.pool.free(reversed(dropped))
        return len(dropped)

    def cache_full_blocks(self, request_id: str, hashes: list[bytes], num_full: int) -> None:
        """Register the request's newly full blocks still held under their prefix hashes."""
        table = self._tables.get(request_id)
        if table is None:
            return
        start = self._num_cached.get(request_id, 0)
        for i in range(start, min(num_full, len(table))):
            if table[i] is not None:
                self.pool.cache(table[i], hashes[i])
        self._num_cached[request_id] = max(start, num_full)

    def trim(self, request_id: str, keep: int) -> None:
        """Roll back to the first `keep` blocks (kv_cache_manager.trim)."""
        table = self._tables.get(request_id)
        if table is None or len(table) <= keep:
            return
        dropped = [b for b in table[keep:] if b is not None]
        del table[keep:]
        del self._ids[request_id][keep:]
        self.pool.free(reversed(dropped))

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        self._ids.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._first_held.pop(request_id, None)
        if table:
            self.pool.free(reversed([b for b in table if b is not None]))
