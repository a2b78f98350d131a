"""Heavy-hitter eviction in the engine core (kv_specs/eviction.py, core/kv/h2o.py):
the budget arithmetic, compaction of a table (shared blocks copied, rewritten blocks out
of the prefix cache, nothing registered after an eviction), and the scheduler keeping
every request within its budget with correct step messages."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from test_scheduler import NO_LOOKAHEAD, fake_runner, make_request, run_to_completion

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.kv.manager import KVCacheManager
from treadle.kv_specs.eviction import EvictionBudget
from treadle.core.scheduler import Scheduler


def test_budget_arithmetic():
    b = EvictionBudget(budget_tokens=64, recent_tokens=16, block_size=16)
    assert (b.max_step_tokens, b.stride, b.max_prefix_hit_tokens, b.max_blocks()) == \
        (24, 16, 40, 4)
    assert b.num_to_keep(63, 1) is None  # 64 fits
    assert b.num_to_keep(64, 1) == 48  # a decode at the budget frees a stride
    assert b.num_to_keep(60, 24) == 40  # a chunk frees its own size
    small = EvictionBudget(budget_tokens=6, recent_tokens=2, block_size=16)
    assert (small.max_step_tokens, small.stride, small.num_to_keep(6, 1)) == (2, 2, 4)


def eviction_scheduler(num_blocks=64, budget=16, recent=4, block_size=4, **sched):
    cache = CacheConfig(block_size=block_size, kv_eviction="h2o", kv_budget_tokens=budget,
                        kv_recent_tokens=recent)
    config = SchedulerConfig(**{**dict(max_num_batched_tokens=64, max_num_seqs=4,
                                       preemption_mode="recompute"), **NO_LOOKAHEAD, **sched})
    return Scheduler(config, cache, num_kv_blocks=num_blocks, max_model_len=4096)


def test_compaction_copies_shared_blocks_and_leaves_the_prefix_cache():
    kv = KVCacheManager(32, 4, True, eviction=EvictionBudget(16, 4, 4))
    a, b = make_request("a", 12, 4), make_request("b", 12, 4)
    b.prompt_token_ids[:] = b.all_token_ids[:] = a.prompt_token_ids
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8  # two blocks shared (one token is always left to compute)
    assert kv.allocate_slots(b, 4, hits)
    shared = kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == shared
    plan = kv.compact(a, num_kept=6, num_recent=4)
    assert plan.src_block_ids[:2] == shared and plan.num_tokens == 12
    assert len(plan.dst_block_ids) == 2 and not set(plan.dst_block_ids) & set(shared)
    assert a.num_evicted_tokens == 6 and a.num_kv_tokens == 6
    assert kv.block_ids("b")[:2] == shared  # b still reads them as they were
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in shared)
    a.num_computed_tokens = 20
    kv.cache_full_blocks(a)  # nothing registered after an eviction
    assert all(kv.pool.blocks[i].block_hash is None for i in plan.dst_block_ids)
    kv.pool.check_invariants()
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 32


def test_compaction_of_unshared_blocks_rewrites_them_in_place_uncached():
    kv = KVCacheManager(32, 4, True, eviction=EvictionBudget(16, 4, 4))
    a = make_request("a", 16, 4)
    assert kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    kv.cache_full_blocks(a)
    before = list(kv.block_ids("a"))
    plan = kv.compact(a, num_kept=10, num_recent=4)
    assert plan.dst_block_ids == before[:3] and plan.src_block_ids == before
    assert all(kv.pool.blocks[i].block_hash is None for i in before[:3])
    assert kv.pool.blocks[before[3]].block_hash is not None  # freed as it was: still valid
    assert kv.pool.blocks[before[3]].ref_cnt == 0
    kv.pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 60)), min_size=1, max_size=6),
       st.integers(8, 40), st.data())
def test_every_request_stays_within_its_budget(shapes, budget, data):
    recent = data.draw(st.integers(1, budget - 2))
    s = eviction_scheduler(num_blocks=48, budget=budget, recent=recent)
    eviction = s.kv.eviction
    bound = -(-(budget + eviction.max_step_tokens) // 4)
    requests = [make_request(f"r{i}", p, m) for i, (p, m) in enumerate(shapes)]

    def check(scheduler, out):
        for c in out.kv_compactions:
            assert recent <= c.num_kept < c.num_tokens
            assert len(c.dst_block_ids) == -(-c.num_kept // 4)
        for sched in out.scheduled:
            assert sched.num_scheduled_tokens <= eviction.max_step_tokens
            request = scheduler.requests[sched.request_id]
            assert request.num_kv_tokens + sched.num_scheduled_tokens <= budget + \
                eviction.max_step_tokens
            assert sched.num_evicted_tokens == request.num_evicted_tokens
        for request in scheduler.running:
            assert scheduler.kv.num_held_blocks(request.request_id) <= bound
        scheduler.kv.pool.check_invariants()

    run_to_completion(s, requests, on_step=check)
    assert all(r.num_output_tokens == m for r, (_, m) in zip(requests, shapes))
    assert s.kv.pool.num_free_blocks == 48
    long = [r for r, (p, m) in zip(requests, shapes) if p + m - 1 > budget]
    assert s.stats.num_kv_compactions >= len(long) > 0 or not long


def test_recompute_preemption_forgets_the_evictions():
    s = eviction_scheduler(num_blocks=6, budget=16, recent=4)
    a, b = make_request("a", 30, 20), make_request("b", 30, 20)
    preempted = []

    def check(scheduler, out):
        for rid in out.preempted_request_ids:
            preempted.append(rid)
            request = scheduler.requests[rid]
            assert request.num_evicted_tokens == 0 and request.num_computed_tokens == 0
            assert rid not in {c.request_id for c in out.kv_compactions}

    run_to_completion(s, [a, b], on_step=check)
    assert preempted and a.num_output_tokens == b.num_output_tokens == 20


def test_a_step_message_carries_positions_and_cache_slots_apart():
    s = eviction_scheduler(budget=16, recent=4)
    r = make_request("r", 40, 3)
    s.add_request(r)
    seen = []
    while s.has_unfinished_requests():
        out = s.schedule()
        seen += [(x.num_computed_tokens, x.num_evicted_tokens, x.num_scheduled_tokens)
                 for x in out.scheduled]
        s.update_from_output(out, fake_runner(out))
    # chunks of max_step_tokens = 6; the cache never passes 16 tokens
    assert [c for c, _, _ in seen][:3] == [0, 6, 12]
    assert all(c - e + n <= 16 for c, e, n in seen)
    assert seen[-1][1] > 0
