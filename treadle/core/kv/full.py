"""The full-attention group's manager: every block of a request's context, its swap.

Owns the request-level block table (the one whose length is the request's KV capacity,
`Request.num_kv_tokens`), prefix hits taken whole, runs of consecutive blocks per request
(`contiguous`: BlockPool extents sized for its prompt and max_tokens), and swapping a
preempted request's blocks out to a swap pool and back. It holds no policy: the composite
(core/kv/manager.py) asks, this answers. With a KV event sink attached (`events`,
core/kv/events.py) it announces the blocks it registers and the cached blocks a swap
parks in swap memory. No torch here.
"""

from __future__ import annotations

from treadle.core.kv.block_pool import BlockPool, KVBlock
from treadle.core.kv.events import KVEventSink
from treadle.core.kv.interface import BlockHashes, SpecManager
from treadle.kv_specs.specs import KVSpec
from treadle.request import Request


class FullAttentionManager(SpecManager):
    """Block tables of the layers that see the whole context."""

    def __init__(self, spec: KVSpec, num_blocks: int, contiguous: bool = False,
                 num_swap_blocks: int = 0) -> None:
        """`contiguous`: each request's blocks come from a run of consecutive ones set
        aside for its prompt and max_tokens where never-used blocks allow (only the ids
        differ, never what is cached, evicted or counted free)."""
        self.spec = spec
        self.block_size = spec.block_size
        self.contiguous = contiguous
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self._swapped: dict[str, list[KVBlock]] = {}
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.events: KVEventSink | None = None
        """Told what this group's prefix cache stores and what a swap parks (None: nobody;
        KVCacheManager.set_event_sink attaches one)."""

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- prefix hits ------------------------------------------------------------------

    def find_longest_cache_hit(self, hashes: BlockHashes, max_blocks: int) -> int:
        num = 0
        lookup = self.pool.lookup
        for block_hash in hashes(max_blocks):
            if lookup(block_hash) is None:
                break
            num += 1
        return num

    def hit_blocks(self, hashes: BlockHashes, num_hit_blocks: int) -> list[KVBlock] | None:
        blocks = [self.pool.lookup(h) for h in hashes(num_hit_blocks)[:num_hit_blocks]]
        return None if any(b is None for b in blocks) else blocks

    # ----- allocation -------------------------------------------------------------------

    def held(self, request_id: str) -> list[KVBlock] | None:
        """The request's blocks (the live list), None when it holds none."""
        return self._blocks.get(request_id)

    def num_blocks_short(self, request: Request, num_hit_blocks: int, hit: list[KVBlock],
                         num_new_tokens: int) -> int:
        held = self._blocks.get(request.request_id, ())
        num_tokens_after = request.num_kv_tokens + num_hit_blocks * self.block_size \
            + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens_after) - len(held) - len(hit)
        needed = max(num_new_blocks, 0) + self.pool.num_reusable_from_free(hit)
        return needed - self.pool.num_free_blocks

    def allocate(self, request: Request, num_hit_blocks: int, hit: list[KVBlock],
                 num_new_tokens: int) -> None:
        rid = request.request_id
        blocks = self._blocks.setdefault(rid, [])
        block_ids = self._block_ids.setdefault(rid, [])
        if hit:
            assert not blocks, "prefix hits are only taken by a request that holds no blocks"
            self.pool.touch(hit)
            blocks.extend(hit)
            block_ids.extend(b.block_id for b in hit)
            self._num_cached_blocks[rid] = len(hit)
        num_tokens_after = request.num_kv_tokens + num_hit_blocks * self.block_size \
            + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens_after) - len(blocks)
        if num_new_blocks > 0:
            new_blocks = self._allocate(request, num_new_blocks, len(blocks))
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)

    def _allocate(self, request: Request, num_blocks: int, num_held: int) -> list[KVBlock]:
        """`num_blocks` new blocks for a request holding `num_held`: with `contiguous`,
        from its extent, sized for its prompt and max_tokens."""
        if not self.contiguous:
            return self.pool.allocate(num_blocks)
        final = self.num_blocks_for(request.num_prompt_tokens
                                    + request.sampling_params.max_tokens)
        return self.pool.allocate(num_blocks, request.request_id,
                                  max(final - num_held, num_blocks))

    def cache_blocks(self, request: Request, num_full_blocks: int,
                     hashes: BlockHashes) -> None:
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        if num_full_blocks <= start:
            return
        blocks = self._blocks[rid]
        block_hashes = hashes(num_full_blocks)
        if self.events is None:
            for i in range(start, num_full_blocks):
                self.pool.cache(blocks[i], block_hashes[i])
        else:
            stored = [i for i in range(start, num_full_blocks)
                      if self.pool.cache(blocks[i], block_hashes[i])]
            if stored:
                self.events.blocks_stored(request, stored, block_hashes)
        self._num_cached_blocks[rid] = num_full_blocks

    # ----- release ----------------------------------------------------------------------

    def trim(self, request_id: str, num_kept_blocks: int) -> list[int]:
        blocks = self._blocks.get(request_id)
        if not blocks or len(blocks) <= num_kept_blocks:
            return []
        dropped = blocks[num_kept_blocks:]
        del blocks[num_kept_blocks:]
        del self._block_ids[request_id][num_kept_blocks:]
        self.pool.free(reversed(dropped))
        return [b.block_id for b in dropped]

    def free(self, request_id: str) -> None:
        """Tail first, so the tail of a prefix chain is evicted before its head."""
        blocks = self._blocks.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        self.pool.release(request_id)

    def replace_table(self, request_id: str, blocks: list[KVBlock]) -> None:
        """The request's table is now `blocks` (a compaction rewrote it), none of them
        registered in the prefix cache."""
        self._blocks[request_id] = blocks
        self._block_ids[request_id] = [b.block_id for b in blocks]
        self._num_cached_blocks[request_id] = 0

    # ----- tables -----------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_ids[request_id]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    # ----- swap -------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        held = len(self._blocks.get(request.request_id, ()))
        return self.swap_pool is not None and 0 < held <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's KV to the swap pool: (device block, swap block) copies to make.

        Its device blocks are freed at once: the worker performs the copies before the
        next forward pass, so no later write can reach them first.
        """
        rid = request.request_id
        blocks = self._blocks.pop(rid)
        self._block_ids.pop(rid)
        self._num_cached_blocks.pop(rid, None)
        swap_blocks = self.swap_pool.allocate(len(blocks))
        self._swapped[rid] = swap_blocks
        if self.events is not None:
            self.events.swapped_out(request, [b.block_hash for b in blocks])
        plan = [(d.block_id, s.block_id) for d, s in zip(blocks, swap_blocks)]
        self.pool.free(reversed(blocks))
        self.pool.release(rid)
        return plan

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request's KV back: (swap block, device block) copies, or None
        when the device has too few free blocks (nothing changes then)."""
        rid = request.request_id
        swap_blocks = self._swapped[rid]
        if len(swap_blocks) > self.pool.num_free_blocks:
            return None
        blocks = self._allocate(request, len(swap_blocks), 0)
        del self._swapped[rid]
        self._blocks[rid] = blocks
        self._block_ids[rid] = [b.block_id for b in blocks]
        plan = [(s.block_id, d.block_id) for s, d in zip(swap_blocks, blocks)]
        self.swap_pool.free(swap_blocks)
        if self.events is not None:
            self.events.swap_released(rid)
        return plan

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped.get(request_id, ()))

    def free_swapped(self, request: Request) -> None:
        """Release the swap blocks of a request that ends while swapped out."""
        blocks = self._swapped.pop(request.request_id, None)
        if blocks:
            self.swap_pool.free(blocks)
            if self.events is not None:
                self.events.swap_released(request.request_id)
