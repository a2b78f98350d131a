"""Runs of consecutive KV blocks (BlockPool extents, CacheConfig.contiguous_blocks).

A request's blocks lie side by side however requests interleave; extents yield to others
before any cached block is evicted; and with them the pool, the KV manager and the
scheduler decide exactly what they decide without them: only block ids differ."""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.kv.block_pool import BlockPool
from treadle.core.kv.manager import KVCacheManager
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.policy import PreemptionCosts
from treadle.core.scheduler import Scheduler
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def test_interleaved_growth_keeps_each_owners_blocks_consecutive():
    pool = BlockPool(100)
    held = {"a": [], "b": [], "c": []}
    for step in range(6):
        for owner in held:
            held[owner] += ids(pool.allocate(1, owner, 6 - step))
    assert held == {"a": [0, 1, 2, 3, 4, 5], "b": [6, 7, 8, 9, 10, 11],
                    "c": [12, 13, 14, 15, 16, 17]}
    assert pool.num_free_blocks == 82 and pool.num_reserved_blocks == 0
    pool.check_invariants()
    # Without an owner (the swap pool, the sliding group): the lowest unused id, as before.
    assert ids(pool.allocate(2)) == [18, 19]


def test_an_extent_counts_as_free_and_yields_before_any_cached_block_goes():
    pool = BlockPool(10)
    a = pool.allocate(1, "a", 6)  # ids 0, and 1-5 set aside
    cached = pool.allocate(2)  # ids 6, 7: a finished request's blocks, cached
    pool.cache(cached[0], b"x")
    pool.cache(cached[1], b"y")
    pool.free(cached)
    assert pool.num_free_blocks == 9 and pool.num_reserved_blocks == 5
    # Four blocks for others: the untouched ids 8, 9, then the extent's tail, not the cache.
    assert ids(pool.allocate(4)) == [8, 9, 5, 4]
    assert pool.num_cached_blocks == 2 and pool.num_evictions == 0
    assert ids(pool.allocate(1, "a", 5)) == [1]  # the owner keeps what is left
    assert ids(pool.allocate(3)) == [3, 2, 6]  # then, and only then, the cache's LRU block
    assert pool.num_evictions == 1 and pool.num_cached_blocks == 1
    pool.free(a)
    pool.check_invariants()


def test_an_owner_without_room_takes_half_of_the_largest_extent():
    pool = BlockPool(20)
    assert ids(pool.allocate(1, "a", 20)) == [0]  # 1-19 set aside for a
    assert ids(pool.allocate(2, "b", 8)) == [12, 13]  # the top 8 of a's tail: 12-19
    assert ids(pool.allocate(1, "a", 19)) == [1]  # a keeps 1-11
    assert ids(pool.allocate(1, "b", 6)) == [14]
    assert pool.num_reserved_blocks == 10 + 5
    pool.check_invariants()


def test_release_hands_the_remainder_back_and_runs_merge():
    pool = BlockPool(30)
    a = pool.allocate(2, "a", 10)  # 0, 1; 2-9 set aside
    b = pool.allocate(2, "b", 10)  # 10, 11; 12-19 set aside
    pool.release("a")  # 2-9 spare
    assert pool.num_reserved_blocks == 8 and pool.num_free_blocks == 26
    pool.release("b")  # 12-19 touch the untouched tail: it grows back down to 12
    assert pool.num_reserved_blocks == 0 and pool._fresh == 12 and pool._spare == {2: 10}
    # A new owner's run is carved where it fits most tightly: the spare run 2-9.
    c = pool.allocate(1, "c", 8)
    assert ids(c) == [2]
    pool.free(a + b + c)
    pool.release("c")
    pool.check_invariants()
    assert pool.num_free_blocks == 30


class TwinPools(RuleBasedStateMachine):
    """The same requests through a KV manager with extents and one without: every answer,
    count, prefix hit and eviction agrees; only block ids may differ."""

    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4]),
                num_swap_blocks=st.integers(0, 12))
    def setup(self, num_blocks, block_size, num_swap_blocks):
        self.kvs = [KVCacheManager(num_blocks, block_size, True, num_swap_blocks,
                                   contiguous=c) for c in (True, False)]
        self.live: dict[str, list[Request]] = {}
        self.swapped: dict[str, list[Request]] = {}
        self.counter = 0

    def _both(self, fn, pair):
        results = [fn(kv, r) for kv, r in zip(self.kvs, pair)]
        assert results[0] == results[1] or (results[0] is not None) == (results[1] is not None)
        return results[0]

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), max_size=10), max_tokens=st.integers(1, 40))
    def admit(self, prefix, tail, max_tokens):
        tokens = (prefix + tail) or [0]
        rid = f"r{self.counter}"
        self.counter += 1
        pair = [Request(rid, tokens, SamplingParams(max_tokens=max_tokens)) for _ in self.kvs]

        def admit_one(kv, r):
            hits, num_hit = kv.get_computed_blocks(r)
            ok = kv.allocate_slots(r, len(tokens) - num_hit, hits)
            if ok:
                r.num_computed_tokens = len(tokens)
                kv.cache_full_blocks(r)
            return ok, num_hit
        if self._both(admit_one, pair)[0]:
            self.live[rid] = pair

    @rule(data=st.data())
    def grow(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        token = data.draw(st.integers(0, 3))

        def grow_one(kv, r):
            r.append_output_token(token)
            if kv.allocate_slots(r, 1):
                r.num_computed_tokens += 1
                kv.cache_full_blocks(r)
                return True
            kv.free(r)
            return False
        if not self._both(grow_one, self.live[rid]):
            del self.live[rid]

    @rule(data=st.data())
    def finish(self, data):
        if not self.live:
            return
        pair = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self._both(lambda kv, r: (kv.free(r), kv.forget(r)), pair)

    @rule(data=st.data())
    def swap_out(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self._both(lambda kv, r: kv.can_swap_out(r), self.live[rid]):
            self._both(lambda kv, r: len(kv.swap_out(r)), self.live[rid])
            self.swapped[rid] = self.live.pop(rid)

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.swapped:
            return
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        if self._both(lambda kv, r: kv.swap_in(r) is not None, self.swapped[rid]):
            self.live[rid] = self.swapped.pop(rid)

    @invariant()
    def agree(self):
        if not hasattr(self, "kvs"):
            return
        a, b = self.kvs
        for kv in self.kvs:
            kv.pool.check_invariants()
        assert a.pool.num_free_blocks == b.pool.num_free_blocks
        assert a.pool.num_evictions == b.pool.num_evictions
        assert set(a.pool._cached) == set(b.pool._cached)
        assert a.prefix_stats == b.prefix_stats
        for rid in self.live:
            blocks_a, blocks_b = a.primary.held(rid), b.primary.held(rid)
            assert [x.block_hash for x in blocks_a] == [x.block_hash for x in blocks_b]
            assert [x.ref_cnt for x in blocks_a] == [x.ref_cnt for x in blocks_b]


TestTwinPools = TwinPools.TestCase
TestTwinPools.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _decisions(contiguous: bool, policy: str, mode: str, seed: int) -> list:
    """Every step's decisions (block ids left out) of a randomized run under memory
    pressure: which requests ran how many tokens, preemptions, swaps, finishes."""
    rng = random.Random(seed)
    now = [0.0]
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=12, preemption_mode=mode,
                        scheduling_policy=policy, kv_watermark=0.0,
                        admission_lookahead_tokens=0),
        CacheConfig(block_size=4, enable_prefix_caching=True, contiguous_blocks=contiguous),
        num_kv_blocks=40, max_model_len=4096, num_swap_blocks=24,
        preemption_costs=PreemptionCosts(1e6, 1e9, 1000, 1e9) if mode == "auto" else None,
        clock=lambda: now[0])
    shared = [rng.randrange(3, 500) for _ in range(24)]
    pending = []
    for i in range(40):
        prefix = shared[:rng.randrange(0, 25)] if rng.random() < 0.5 else []
        prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))]
        pending.append((rng.uniform(0, 3.0), prompt, rng.randrange(1, 50), rng.randrange(3)))
    pending.sort(key=lambda r: r[0])
    log, i = [], 0
    while i < len(pending) or sched.has_unfinished_requests():
        while i < len(pending) and pending[i][0] <= now[0]:
            _, prompt, max_tokens, priority = pending[i]
            sched.add_request(Request(str(i), prompt, SamplingParams(
                max_tokens=max_tokens, ignore_eos=True), arrival_time=now[0],
                priority=priority))
            i += 1
        if rng.random() < 0.02 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        log.append(([(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.sample)
                     for s in out.scheduled], out.preempted_request_ids,
                    out.swapped_request_ids, len(out.swap_out), len(out.swap_in),
                    out.finished_request_ids, sched.kv.pool.num_free_blocks))
        sampled = {s.request_id: [7] for s in out.scheduled if s.sample}
        log.append(repr(sched.update_from_output(out, ModelRunnerOutput(sampled))))
        now[0] += 0.05
    log.append((repr(sched.stats), repr(sched.kv.prefix_stats)))
    return log


def test_the_scheduler_decides_the_same_with_and_without_runs():
    for policy, mode, seed in (("fcfs", "recompute", 0), ("priority", "swap", 1),
                               ("srpt", "auto", 2), ("fcfs", "swap", 3)):
        with_runs = _decisions(True, policy, mode, seed)
        assert with_runs == _decisions(False, policy, mode, seed), (policy, mode, seed)
        assert any(step[1] for step in with_runs[::2][:-1]), "no preemption was exercised"


def test_the_engines_block_tables_are_runs():
    """A scheduler with extents: each decoding request's table is consecutive ids."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                      CacheConfig(block_size=4), num_kv_blocks=200, max_model_len=512)
    for i in range(4):
        prompt = list(range(100 * i + 3, 100 * i + 13 + 5 * i))  # no shared prefix
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=30,
                                                                 ignore_eos=True)))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for r in sched.running:
            table = sched.kv.block_ids(r.request_id)
            assert table == list(range(table[0], table[0] + len(table))), table
        sched.update_from_output(out, ModelRunnerOutput(
            {s.request_id: [7] for s in out.scheduled if s.sample}))
