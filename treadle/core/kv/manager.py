"""Which blocks each request holds: prefix lookup, slot allocation, freeing, usage.

The KV cache manager the scheduler uses. It composes one small manager per layer group
(core/kv/interface.py: full attention, sliding window, H2O eviction; which class serves
which spec is `SPEC_MANAGERS`), each with its own block pool, and speaks for all of
them: a prefix hit is the longest every group can serve, an allocation succeeds only
when every group has room, a request is freed, trimmed and cached in every group. The
first group (`primary`) spans a request's whole context: its table is the request's KV
capacity, its pool the one the scheduler counts, and it alone swaps and compacts. The
composite holds each request's chained prefix hashes (core/kv/hashing.py) and the
prefix-cache counters. It never decides *which* request gets memory: the scheduler asks,
this module answers yes or no. KV events (core/kv/events.py): `set_event_sink` attaches
the observer of the request-level group's prefix cache; `reset_prefix_cache` drops every
cached block no request holds. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.core.kv.block_pool import BlockPool, KVBlock
from treadle.core.kv.config import KVCacheConfig
from treadle.core.kv.events import KVEventSink
from treadle.kv_specs.eviction import EvictionBudget
from treadle.core.kv.full import FullAttentionManager
from treadle.core.kv.h2o import H2OManager
from treadle.core.kv.hashing import hash_block, root_hash
from treadle.core.kv.interface import SpecManager
from treadle.core.kv.sliding import SlidingWindowManager
from treadle.kv_specs.specs import FullAttentionSpec, H2OSpec, KVSpec, SlidingWindowSpec
from treadle.core.outputs import KVCompaction
from treadle.request import Request

SPEC_MANAGERS: dict[type[KVSpec], type[SpecManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    H2OSpec: H2OManager,
}
"""Which manager serves each spec: a new spec is one class, its manager and a line here."""


@dataclass
class PrefixCacheStats:
    """Counters of prefix-cache lookups, in tokens."""

    num_queries: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    """Block tables of the requests that hold KV, over one manager per layer group."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_swap_blocks: int = 0, sliding: SlidingWindowManager | None = None,
                 eviction: EvictionBudget | None = None, contiguous: bool = True) -> None:
        """The request-level group of `num_blocks` blocks (under `eviction`'s budget when
        given), with `sliding`'s group beside it when the model has one (the
        scheduler's form; `from_config` builds the same from a KVCacheConfig).
        `contiguous`: each request's blocks come from a run of consecutive ones set
        aside for its prompt and max_tokens where never-used blocks allow (BlockPool's
        extents; only the ids differ, never what is cached, evicted or counted free)."""
        spec = (FullAttentionSpec(block_size) if eviction is None
                else H2OSpec(block_size, budget=eviction))
        primary = SPEC_MANAGERS[type(spec)](spec, num_blocks, contiguous, num_swap_blocks)
        self._compose(primary, () if sliding is None else (sliding,), enable_prefix_caching)

    @classmethod
    def from_config(cls, kv_config: KVCacheConfig, enable_prefix_caching: bool,
                    contiguous: bool = True) -> "KVCacheManager":
        """The manager of every group of the engine core's KV config."""
        self = cls.__new__(cls)
        first, *rest = kv_config.groups
        primary = SPEC_MANAGERS[type(first.spec)](first.spec, first.num_blocks, contiguous,
                                                  kv_config.num_swap_blocks)
        others = tuple(SPEC_MANAGERS[type(g.spec)](g.spec, g.num_blocks) for g in rest)
        self._compose(primary, others, enable_prefix_caching)
        return self

    def _compose(self, primary: FullAttentionManager, others: tuple[SpecManager, ...],
                 enable_prefix_caching: bool) -> None:
        self.primary = primary
        """The request-level group (full attention, or H2O)."""
        self.groups: tuple[SpecManager, ...] = (primary, *others)
        self._others = others
        self._skipping = tuple(m for m in self.groups if m.frees_skipped_blocks)
        """The groups that free blocks as a request moves on (sliding windows)."""
        self._swappable = all(m.spec.supports_swap for m in self.groups)
        self.block_size = primary.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.contiguous = primary.contiguous
        self.pool: BlockPool = primary.pool
        """The request-level group's pool (the capacity the scheduler counts)."""
        self.swap_pool: BlockPool | None = primary.swap_pool
        self.eviction: EvictionBudget | None = primary.spec.eviction
        """The H2O budget of every request, or None (no eviction)."""
        self.sliding: SlidingWindowManager | None = next(
            (m for m in others if isinstance(m, SlidingWindowManager)), None)
        """The sliding-window layers' group (its table goes in the step message), or None
        (every layer sees the whole context)."""
        self._hashes: dict[str, list[bytes]] = {}
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
        return self.primary.block_ids(request_id)

    def num_held_blocks(self, request_id: str) -> int:
        return self.primary.num_held_blocks(request_id)

    def num_allocated_slots(self, request_id: str) -> int:
        return self.primary.num_held_blocks(request_id) * self.block_size

    def num_new_blocks_needed(self, request: Request, num_hit_tokens: int,
                              num_new_tokens: int) -> int:
        """Blocks beyond those of its computed and prefix-hit tokens that the request
        needs for `num_new_tokens` more: an estimate for planning, which counts prefix
        hits as already held (a cached-free hit also leaves the free queue when taken;
        `can_allocate` is exact)."""
        base = request.num_kv_tokens + num_hit_tokens
        return self.num_blocks_for(base + num_new_tokens) - base // self.block_size

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Prefix hashes of the request's first `num_full_blocks` blocks (memoised: the
        list may hold more)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else root_hash(request.cache_salt, request.lora_int_id)
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, tokens[i * size:(i + 1) * size])
            hashes.append(parent)
        return hashes

    def _hashes_of(self, request: Request):
        return lambda num_blocks: self._block_hashes(request, num_blocks)

    # ----- prefix hits and allocation ------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached blocks matching the request's tokens that every group
        can serve, and their tokens (the request-level group's blocks).

        At least one token is always left to compute, so the step that admits the request
        produces its next-token logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes_of(request)
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        for group in self.groups:  # each may only shorten it
            num_hit_blocks = group.find_longest_cache_hit(hashes, num_hit_blocks)
        hits = self.primary.hit_blocks(hashes, num_hit_blocks) if num_hit_blocks else []
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_stats.num_queries += 1
        self.prefix_stats.num_queried_tokens += request.num_tokens
        self.prefix_stats.num_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def _group_hits(self, request: Request,
                    computed_blocks: list[KVBlock]) -> list[list[KVBlock] | None]:
        """Each group's blocks of the prefix hit `computed_blocks` (None where one has
        gone since the hit was found)."""
        num_hit_blocks = len(computed_blocks)
        hashes = self._hashes_of(request)
        return [list(computed_blocks)] + [m.hit_blocks(hashes, num_hit_blocks)
                                          for m in self._others]

    def _num_blocks_short(self, request: Request, num_new_tokens: int,
                          computed_blocks: list[KVBlock], hits) -> int:
        num_hit_blocks = len(computed_blocks)
        short = self.primary.num_blocks_short(request, num_hit_blocks, hits[0], num_new_tokens)
        for group, hit in zip(self._others, hits[1:]):
            if hit is None:
                return max(short, 1)  # a block of the hit was evicted meanwhile
            short = max(short, group.num_blocks_short(request, num_hit_blocks, hit,
                                                      num_new_tokens))
        return short

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[KVBlock] = ()) -> bool:
        hits = self._group_hits(request, computed_blocks)
        return self._num_blocks_short(request, num_new_tokens, computed_blocks, hits) <= 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False if memory is short.

        `computed_blocks` (from get_computed_blocks, only when the request holds nothing
        yet) are shared into its table first. Nothing changes when it returns False.
        """
        if not computed_blocks:
            held = self.primary.held(request.request_id)
            if (held is not None and request.num_kv_tokens + num_new_tokens
                    <= len(held) * self.block_size):
                for group in self._skipping:
                    group.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
                return True  # its blocks have room already (most decode steps)
        hits = self._group_hits(request, computed_blocks)
        if self._num_blocks_short(request, num_new_tokens, computed_blocks, hits) > 0:
            return False
        num_hit_blocks = len(computed_blocks)
        for group, hit in zip(reversed(self.groups), reversed(hits)):
            group.allocate(request, num_hit_blocks, hit, num_new_tokens)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache; then free the
        blocks its next query cannot see."""
        if self.enable_prefix_caching:
            num_full = request.num_computed_tokens // self.block_size
            hashes = self._hashes_of(request)
            for group in self.groups:
                group.cache_blocks(request, num_full, hashes)
        for group in self._skipping:
            group.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    # ----- rollback, eviction, release -----------------------------------------------------

    def trim(self, request: Request) -> list[int]:
        """Roll back: free the blocks past the request's computed tokens (those held only
        for tokens that were scheduled and then rejected, such as refused speculative
        tokens). Returns the freed block ids of its table. Their contents were never
        registered in the prefix cache: only blocks full of computed tokens are
        (cache_full_blocks)."""
        keep = self.num_blocks_for(request.num_kv_tokens)
        for group in self._others:
            group.trim(request.request_id, keep)
        return self.primary.trim(request.request_id, keep)

    def compact(self, request: Request, num_kept: int, num_recent: int) -> KVCompaction | None:
        """Heavy-hitter eviction (the H2O group's `compact`): keep `num_kept` of the
        request's cached tokens in the front of its table; the step message's
        instruction, or None when nothing could change."""
        return self.primary.compact(request, num_kept, num_recent)

    def free(self, request: Request) -> None:
        """Release every block the request holds, in every group (tail first)."""
        for group in self._others:
            group.free(request.request_id)
        self.primary.free(request.request_id)

    def forget(self, request: Request) -> None:
        """Drop the memoised hashes of a request that has ended."""
        self._hashes.pop(request.request_id, None)

    def holds(self, request_id: str) -> bool:
        return self.primary.holds(request_id)

    # ----- swap ---------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        """Whether the request's KV can go to the swap pool now (never when a group has no
        swap plan: such requests are preempted by recompute)."""
        return self._swappable and self.primary.can_swap_out(request)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's KV to the swap pool: (device block, swap block) copies."""
        return self.primary.swap_out(request)

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request's KV back: (swap block, device block) copies, or None
        when the device has too few free blocks (nothing changes then)."""
        return self.primary.swap_in(request)

    def num_swapped_blocks(self, request_id: str) -> int:
        return self.primary.num_swapped_blocks(request_id)

    def num_swapped_slots(self, request_id: str) -> int:
        return self.num_swapped_blocks(request_id) * self.block_size

    def free_swapped(self, request: Request) -> None:
        """Release the swap blocks of a request that ends while swapped out."""
        self.primary.free_swapped(request)

    # ----- events and reset ---------------------------------------------------------------

    def set_event_sink(self, sink: KVEventSink | None) -> None:
        """Tell `sink` what the request-level group's prefix cache stores and drops, and
        which cached blocks a swap parks (None: stop telling)."""
        self.primary.events = sink
        self.pool.on_removed = None if sink is None else sink.blocks_removed

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, in every group (blocks held keep
        their hashes: a running request's prefix stays valid). Returns how many blocks of
        the request-level group were dropped; the event sink hears each, then
        `all_cleared` when nothing cached is left."""
        dropped = self.pool.reset_prefix_cache()
        for group in self._others:
            group.pool.reset_prefix_cache()
        sink = self.primary.events
        if sink is not None and self.pool.num_cached_blocks == 0:
            sink.all_cleared()
        return dropped
