"""Which blocks each request holds: prefix lookup, slot allocation, freeing, usage.

Owns the block table of every request that holds KV (a list of block ids the worker reads
as-is) and the chained prefix hashes of requests' full blocks. It never decides *which*
request gets memory: the scheduler asks, this module answers yes or no.

Prefix hash of full block i: BLAKE2b-128 over (hash of block i-1, the block's token ids
as little-endian int64). The chain starts from a hash of the request's `cache_salt` and its
LoRA adapter's id, so requests with different salts (tenants) or different adapters (or
one with an adapter and one without) never share a block. No torch here.

With a sliding-window layer group (`sliding`, core/kv_sliding.py) every request also has
a second table, for the sliding layers, whose blocks are freed as they leave the window;
allocation succeeds only when both groups have room, and prefix hits are shortened to
what the sliding group still holds.

With heavy-hitter eviction (`eviction`, core/kv_eviction.py) a table holds a request's
kept tokens only (`Request.num_kv_tokens`); `compact` moves them to its front and frees
the rest. A block is registered in the prefix cache only while its request has evicted
nothing, and a block a compaction rewrites is first taken out of it (copied to a fresh
block when another request shares it), so nobody finds a block whose contents changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.core.kv.block_pool import BlockPool, KVBlock
from treadle.core.kv.hashing import hash_block, root_hash
from treadle.core.kv.eviction import EvictionBudget
from treadle.core.kv.sliding import SlidingWindowGroup
from treadle.core.outputs import KVCompaction
from treadle.request import Request

@dataclass
class PrefixCacheStats:
    """Counters of prefix-cache lookups, in tokens."""

    num_queries: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    """Block tables of the requests that hold KV, on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_swap_blocks: int = 0, sliding: SlidingWindowGroup | None = None,
                 eviction: EvictionBudget | None = None, contiguous: bool = True) -> None:
        """`contiguous`: each request's blocks come from a run of consecutive ones set
        aside for its prompt and max_tokens where never-used blocks allow (BlockPool's
        extents; only the ids differ, never what is cached, evicted or counted free)."""
        if sliding is not None and eviction is not None:
            raise ValueError("kv_eviction h2o does not support models with sliding-window "
                             "layers")
        self.block_size = block_size
        self.eviction = eviction
        """The H2O budget of every request, or None (no eviction)."""
        self.sliding = sliding
        """The sliding-window layers' group, or None (every layer sees the whole context)."""
        self.enable_prefix_caching = enable_prefix_caching
        self.contiguous = contiguous
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self._swapped: dict[str, list[KVBlock]] = {}
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: it grows as blocks are allocated)."""
        return self._block_ids[request_id]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def num_allocated_slots(self, request_id: str) -> int:
        return self.num_held_blocks(request_id) * self.block_size

    def num_new_blocks_needed(self, request: Request, num_hit_tokens: int,
                              num_new_tokens: int) -> int:
        """Blocks beyond those of its computed and prefix-hit tokens that the request
        needs for `num_new_tokens` more: an estimate for planning, which counts prefix
        hits as already held (a cached-free hit also leaves the free queue when taken;
        `can_allocate` is exact)."""
        base = request.num_kv_tokens + num_hit_tokens
        return self.num_blocks_for(base + num_new_tokens) - base // self.block_size

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Prefix hashes of the request's first `num_full_blocks` blocks (memoised)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else root_hash(request.cache_salt, request.lora_int_id)
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, tokens[i * size:(i + 1) * size])
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached blocks matching the request's tokens, and their tokens.

        At least one token is always left to compute, so the step that admits the request
        produces its next-token logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.eviction is not None:
            max_hit_blocks = min(max_hit_blocks,
                                 self.eviction.max_prefix_hit_tokens // self.block_size)
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(request, max_hit_blocks):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.sliding is not None and hits:
            hashes = self._hashes[request.request_id]
            del hits[self.sliding.usable_hit(hashes, len(hits)):]
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_stats.num_queries += 1
        self.prefix_stats.num_queried_tokens += request.num_tokens
        self.prefix_stats.num_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[KVBlock] = ()) -> bool:
        return self._num_blocks_short(request, num_new_tokens, computed_blocks) <= 0

    def _num_blocks_short(self, request: Request, num_new_tokens: int,
                          computed_blocks: list[KVBlock]) -> int:
        held = self._blocks.get(request.request_id, ())
        num_tokens_after = (request.num_kv_tokens + len(computed_blocks) * self.block_size
                            + num_new_tokens)
        num_new_blocks = self.num_blocks_for(num_tokens_after) - len(held) - len(computed_blocks)
        needed = max(num_new_blocks, 0) + self.pool.num_reusable_from_free(computed_blocks)
        short = needed - self.pool.num_free_blocks
        if self.sliding is None:
            return short
        hit = self._sliding_hit(request, len(computed_blocks))
        if hit is None:
            return max(short, 1)  # a sliding block of the hit was evicted meanwhile
        computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(short, self.sliding.num_blocks_short(request.request_id, computed,
                                                        num_tokens_after, hit))

    def _sliding_hit(self, request: Request, num_hit_blocks: int) -> list[KVBlock] | None:
        if not num_hit_blocks:
            return []
        return self.sliding.hit_blocks(self._hashes[request.request_id], num_hit_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False if memory is short.

        `computed_blocks` (from get_computed_blocks, only when the request holds nothing
        yet) are shared into its table first. Nothing changes when it returns False.
        """
        if not computed_blocks:
            held = self._blocks.get(request.request_id)
            if (held is not None and request.num_kv_tokens + num_new_tokens
                    <= len(held) * self.block_size):
                if self.sliding is not None:
                    self.sliding.release_out_of_window(request.request_id,
                                                       request.num_computed_tokens)
                return True  # its blocks have room already (most decode steps)
        if self._num_blocks_short(request, num_new_tokens, computed_blocks) > 0:
            return False
        rid = request.request_id
        if self.sliding is not None:
            self.sliding.allocate(
                rid, request.num_computed_tokens + len(computed_blocks) * self.block_size,
                request.num_computed_tokens + len(computed_blocks) * self.block_size
                + num_new_tokens, self._sliding_hit(request, len(computed_blocks)))
        blocks = self._blocks.setdefault(rid, [])
        block_ids = self._block_ids.setdefault(rid, [])
        if computed_blocks:
            assert not blocks, "prefix hits are only taken by a request that holds no blocks"
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            block_ids.extend(b.block_id for b in computed_blocks)
            self._num_cached_blocks[rid] = len(computed_blocks)
        num_tokens_after = (request.num_kv_tokens + len(computed_blocks) * self.block_size
                            + num_new_tokens)
        num_new_blocks = self.num_blocks_for(num_tokens_after) - len(blocks)
        if num_new_blocks > 0:
            new_blocks = self._allocate(request, num_new_blocks, len(blocks))
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return True

    def _allocate(self, request: Request, num_blocks: int, num_held: int) -> list[KVBlock]:
        """`num_blocks` new blocks for a request holding `num_held`: with `contiguous`,
        from its extent, sized for its prompt and max_tokens."""
        if not self.contiguous:
            return self.pool.allocate(num_blocks)
        final = self.num_blocks_for(request.num_prompt_tokens
                                    + request.sampling_params.max_tokens)
        return self.pool.allocate(num_blocks, request.request_id,
                                  max(final - num_held, num_blocks))

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache; then free the
        sliding blocks its next query cannot see."""
        self._cache_full_blocks(request)
        if self.sliding is not None:
            self.sliding.release_out_of_window(request.request_id, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request) -> None:
        if not self.enable_prefix_caching or request.num_evicted_tokens:
            return  # after an eviction its blocks no longer hold its prefix
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        blocks = self._blocks[rid]
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached_blocks[rid] = num_full
        if self.sliding is not None:
            self.sliding.cache_full_blocks(rid, hashes, num_full)

    def trim(self, request: Request) -> list[int]:
        """Roll back: free the blocks past the request's computed tokens (those held only
        for tokens that were scheduled and then rejected, such as refused speculative
        tokens). Returns the freed block ids. Their contents were never registered in
        the prefix cache: only blocks full of computed tokens are (cache_full_blocks)."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        keep = self.num_blocks_for(request.num_kv_tokens)
        if self.sliding is not None:
            self.sliding.trim(rid, keep)
        if not blocks or len(blocks) <= keep:
            return []
        dropped = blocks[keep:]
        del blocks[keep:]
        del self._block_ids[rid][keep:]
        self.pool.free(reversed(dropped))
        return [b.block_id for b in dropped]

    def compact(self, request: Request, num_kept: int, num_recent: int) -> KVCompaction | None:
        """Heavy-hitter eviction: keep `num_kept` of the request's cached tokens in the
        front of its table (which ones, the worker chooses) and free the blocks past them.
        Returns the step message's instruction, or None when a shared block cannot be
        copied for lack of a free block (nothing changes then)."""
        rid = request.request_id
        blocks = self._blocks[rid]
        num_tokens = request.num_kv_tokens
        src_block_ids = self._block_ids[rid][:self.num_blocks_for(num_tokens)]
        num_keep_blocks = self.num_blocks_for(num_kept)
        kept, tail = blocks[:num_keep_blocks], blocks[num_keep_blocks:]
        num_shared = sum(1 for b in kept if b.ref_cnt > 1)
        if num_shared > self.pool.num_free_blocks + sum(1 for b in tail if b.ref_cnt == 1):
            return None
        self.pool.free(reversed(tail))
        copies = iter(self.pool.allocate(num_shared)) if num_shared else None
        for i, block in enumerate(kept):
            if block.ref_cnt > 1:  # another request reads it as it is: rewrite a copy
                self.pool.free([block])
                kept[i] = next(copies)
            else:
                self.pool.uncache(block)
        self._blocks[rid] = kept
        self._block_ids[rid] = [b.block_id for b in kept]
        self._num_cached_blocks[rid] = 0
        request.num_evicted_tokens += num_tokens - num_kept
        return KVCompaction(rid, num_tokens, num_kept, num_recent, src_block_ids,
                            list(self._block_ids[rid]))

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (evicted before the head)."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if self.sliding is not None:
            self.sliding.free(rid)
        if blocks:
            self.pool.free(reversed(blocks))
        self.pool.release(rid)

    # ----- swap ---------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        if self.sliding is not None:
            return False  # no swap plan for the sliding group: such requests recompute
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
        return plan

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped.get(request_id, ()))

    def num_swapped_slots(self, request_id: str) -> int:
        return self.num_swapped_blocks(request_id) * self.block_size

    def free_swapped(self, request: Request) -> None:
        """Release the swap blocks of a request that ends while swapped out."""
        blocks = self._swapped.pop(request.request_id, None)
        if blocks:
            self.swap_pool.free(blocks)

    def forget(self, request: Request) -> None:
        """Drop the memoised hashes of a request that has ended."""
        self._hashes.pop(request.request_id, None)

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks
