"""The sliding-window group's manager: a second block table per request whose blocks
are freed once they fall out of the window.

A model whose layers are partly (Gemma 3: five in six) or wholly (Mistral) sliding-window
layers keeps two layer groups, as vLLM's hybrid KV manager does: the full-attention layers
hold every block of a request (core/kv/full.py's table and pool), the sliding layers hold
only the blocks a query can still see, from their own pool and KV tensors. A query at
position p sees keys p - window + 1 .. p, so before a step whose first new token sits at
position c, every sliding block wholly before position c - window + 1 is freed (and again
after the step, for the next one: `remove_skipped_blocks`); a request then holds at most
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

How the memory splits between the two groups is core/kv/config.py's. No torch here.
"""

from __future__ import annotations

from treadle.core.kv.block_pool import BlockPool, KVBlock
from treadle.core.kv.interface import BlockHashes, SpecManager
from treadle.kv_specs.specs import SlidingWindowSpec
from treadle.request import Request

PLACEHOLDER_BLOCK = 0
"""The id written in a table entry whose block was freed or never held (never read)."""


class SlidingWindowManager(SpecManager):
    """Per request, the sliding layers' blocks by block index: a KVBlock while held, None
    once freed (or never held, before a prefix hit's window)."""

    frees_skipped_blocks = True

    def __init__(self, spec: SlidingWindowSpec, num_blocks: int) -> None:
        self.spec = spec
        self.pool = BlockPool(num_blocks)
        self.block_size = spec.block_size
        self.window = spec.window
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

    def find_longest_cache_hit(self, hashes: BlockHashes, max_blocks: int) -> int:
        """The longest k <= max_blocks for which the sliding pool holds the blocks of the
        window before position k * block_size."""
        if not max_blocks:
            return 0
        block_hashes = hashes(max_blocks)
        for k in range(max_blocks, 0, -1):
            first = self.first_needed_block(k * self.block_size)
            if all(self.pool.lookup(h) is not None for h in block_hashes[first:k]):
                return k
        return 0

    def hit_blocks(self, hashes: BlockHashes, num_hit_blocks: int) -> list[KVBlock] | None:
        """The cached sliding blocks of a k-block hit (the window before it), or None
        when one was evicted since the hit was found."""
        if not num_hit_blocks:
            return []
        first = self.first_needed_block(num_hit_blocks * self.block_size)
        blocks = [self.pool.lookup(h) for h in hashes(num_hit_blocks)[first:num_hit_blocks]]
        return None if any(b is None for b in blocks) else blocks

    # ----- allocation ---------------------------------------------------------------------

    def num_blocks_short(self, request: Request, num_hit_blocks: int, hit: list[KVBlock],
                         num_new_tokens: int) -> int:
        """Blocks missing for the request to hold its new tokens after freeing what falls
        out of the window (negative: spare)."""
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens_after = request.num_kv_tokens + num_hit_blocks * self.block_size \
            + num_new_tokens
        table = self._tables.get(request.request_id, ())
        first = self.first_needed_block(num_computed)
        num_after = -(-num_tokens_after // self.block_size)
        start = max(len(table), first) if not hit else num_computed // self.block_size
        freeable = sum(1 for b in table[:first] if b is not None and b.ref_cnt == 1)
        needed = max(num_after - start, 0) + self.pool.num_reusable_from_free(hit)
        return needed - self.pool.num_free_blocks - freeable

    def allocate(self, request: Request, num_hit_blocks: int, hit: list[KVBlock],
                 num_new_tokens: int) -> None:
        """Hold the blocks of the request's new tokens (the caller checked
        num_blocks_short); `hit`: a new request's prefix-hit blocks (hit_blocks)."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens_after = num_computed + num_new_tokens
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
        self.remove_skipped_blocks(request_id, num_computed)
        num_after = -(-num_tokens_after // self.block_size)
        first = self.first_needed_block(num_computed)
        if len(table) < first:  # blocks skipped whole (never needed): placeholders
            ids.extend([PLACEHOLDER_BLOCK] * (first - len(table)))
            table.extend([None] * (first - len(table)))
        if num_after > len(table):
            new_blocks = self.pool.allocate(num_after - len(table))
            table.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)

    def remove_skipped_blocks(self, request_id: str, next_query_pos: int) -> None:
        """Free the blocks no query from `next_query_pos` on can see."""
        table = self._tables.get(request_id)
        if table is None:
            return
        first = min(self.first_needed_block(next_query_pos), len(table))
        start = self._first_held.get(request_id, 0)
        dropped = [b for b in table[start:first] if b is not None]
        for i in range(start, first):
            table[i] = None
        if first > start:
            self._first_held[request_id] = first
        if dropped:
            self.pool.free(reversed(dropped))

    def cache_blocks(self, request: Request, num_full_blocks: int,
                     hashes: BlockHashes) -> None:
        """Register the request's newly full blocks still held under their prefix hashes."""
        request_id = request.request_id
        table = self._tables.get(request_id)
        start = self._num_cached.get(request_id, 0)
        if table is None or num_full_blocks <= start:
            return
        block_hashes = hashes(num_full_blocks)
        for i in range(start, min(num_full_blocks, len(table))):
            if table[i] is not None:
                self.pool.cache(table[i], block_hashes[i])
        self._num_cached[request_id] = num_full_blocks

    # ----- release ------------------------------------------------------------------------

    def trim(self, request_id: str, num_kept_blocks: int) -> list[int]:
        """Roll back to the first `num_kept_blocks` entries."""
        table = self._tables.get(request_id)
        if table is None or len(table) <= num_kept_blocks:
            return []
        dropped = [b for b in table[num_kept_blocks:] if b is not None]
        del table[num_kept_blocks:]
        del self._ids[request_id][num_kept_blocks:]
        self.pool.free(reversed(dropped))
        return [b.block_id for b in dropped]

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        self._ids.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._first_held.pop(request_id, None)
        if table:
            self.pool.free(reversed([b for b in table if b is not None]))


def SlidingWindowGroup(num_blocks: int, block_size: int, window: int) -> SlidingWindowManager:
    """The sliding group's manager from its three numbers, as the scheduler builds it from
    the engine core's LayerGroups (core/kv/config.py)."""
    return SlidingWindowManager(SlidingWindowSpec(block_size, window=window), num_blocks)
