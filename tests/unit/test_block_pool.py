"""Block pool and KV cache manager: sharing, LRU eviction, salts, and a hypothesis state machine."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from treadle.core.kv.block_pool import BlockPool
from treadle.core.kv.manager import KVCacheManager
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def req(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_pool_allocate_free_and_double_free():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])
    pool.check_invariants()


def test_a_huge_pool_costs_nothing_until_used_and_keeps_the_queue_order():
    """Ten million blocks: made in well under the ~50 s ten million objects took; blocks
    come fresh in id order, then the freed ones in the order they were freed."""
    import time

    t0 = time.perf_counter()
    pool = BlockPool(10_000_000)
    assert time.perf_counter() - t0 < 1.0 and pool.num_free_blocks == 10_000_000
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    pool.free([a[2], a[0]])
    assert pool.num_free_blocks == 10_000_000 - 1
    small = BlockPool(5)
    taken = small.allocate(4)
    small.free([taken[3], taken[1]])
    assert [b.block_id for b in small.allocate(3)] == [4, 3, 1]  # fresh first, then freed
    small.check_invariants()
    assert [b.ref_cnt for b in small.blocks] == [1, 1, 1, 1, 1] and len(small.blocks) == 5
    with pytest.raises(IndexError):
        small.blocks[5]


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)  # blocks [1,2] and [3,4] are full
    kv.free(a)
    assert kv.pool.num_cached_blocks == 2 and kv.pool.num_free_blocks == 4
    # A request with the same prefix reuses both blocks.
    b = req("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and [blk.block_hash for blk in hits] == kv._hashes["a"][:2]
    # Allocating 3 fresh blocks evicts: the uncached block first, then the chain's tail.
    c = req("c", [7] * 6)
    assert kv.allocate_slots(c, 6)
    assert kv.pool.num_cached_blocks == 1
    remaining = kv.get_computed_blocks(req("d", [1, 2, 3, 4, 0]))[1]
    assert remaining == 2  # the head block [1, 2] survived, its tail [3, 4] went first


def test_different_salts_never_share():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5], salt="tenant-a")
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5], salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5], salt="tenant-a"))[1] == 4


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4]))[1] == 2


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(10)))
    assert not kv.allocate_slots(a, 13)
    assert kv.pool.num_free_blocks == 3 and not kv.holds("a")


class KVManagerMachine(RuleBasedStateMachine):
    """Random allocate / share / grow / free / evict sequences keep every invariant."""

    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
                num_swap_blocks=st.integers(0, 12))
    def setup(self, num_blocks, block_size, num_swap_blocks):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                                 num_swap_blocks=num_swap_blocks)
        self.live: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.counter = 0

    @rule(data=st.data())
    def swap_out(self, data):
        if not self.live:
            return
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if self.kv.can_swap_out(r):
            num_blocks = len(self.kv.block_ids(r.request_id))
            plan = self.kv.swap_out(r)
            assert len(plan) == num_blocks and not self.kv.holds(r.request_id)
            self.swapped[r.request_id] = self.live.pop(r.request_id)

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.swapped:
            return
        r = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        slots = self.kv.num_swapped_slots(r.request_id)
        plan = self.kv.swap_in(r)
        if plan is not None:
            assert len(plan) * self.kv.block_size == slots
            self.live[r.request_id] = self.swapped.pop(r.request_id)
            self.kv.cache_full_blocks(r)

    @rule(data=st.data())
    def abort_swapped(self, data):
        if not self.swapped:
            return
        r = self.swapped.pop(data.draw(st.sampled_from(sorted(self.swapped))))
        self.kv.free_swapped(r)
        self.kv.forget(r)

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), max_size=10))
    def admit(self, prefix, tail):
        tokens = (prefix + tail) or [0]
        r = req(f"r{self.counter}", tokens)
        self.counter += 1
        hits, num_hit = self.kv.get_computed_blocks(r)
        if self.kv.allocate_slots(r, len(tokens) - num_hit, hits):
            r.num_computed_tokens = len(tokens)
            self.kv.cache_full_blocks(r)
            self.live[r.request_id] = r

    @rule(data=st.data())
    def grow(self, data):
        if not self.live:
            return
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r.append_output_token(data.draw(st.integers(0, 3)))
        if self.kv.allocate_slots(r, 1):
            r.num_computed_tokens += 1
            self.kv.cache_full_blocks(r)
        else:  # preempted by recompute: everything it held goes back
            self.kv.free(r)
            del self.live[r.request_id]

    @rule(data=st.data())
    def finish(self, data):
        if not self.live:
            return
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(r)
        self.kv.forget(r)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        pool.check_invariants()
        holders = {}
        for rid in self.live:
            for b in self.kv.primary.held(rid):
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        assert pool.num_free_blocks + len(holders) == pool.num_blocks
        swap_pool = self.kv.swap_pool
        if swap_pool is not None:
            swap_pool.check_invariants()
            held = sum(self.kv.num_swapped_blocks(rid) for rid in self.swapped)
            assert swap_pool.num_free_blocks + held == swap_pool.num_blocks
        if not self.live:
            assert pool.num_free_blocks == pool.num_blocks
        if not self.swapped and swap_pool is not None:
            assert swap_pool.num_free_blocks == swap_pool.num_blocks


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
