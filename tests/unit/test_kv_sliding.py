"""The sliding-window layer group (core/kv/sliding.py) inside the KV manager: blocks that
leave the window are freed as a request grows, prefix hits stop where the sliding group
lost its blocks, rollback and free return everything."""

from __future__ import annotations

import random

import pytest

from treadle.core.kv.manager import KVCacheManager
from treadle.core.kv.config import layer_groups
from treadle.core.kv.sliding import SlidingWindowGroup
from treadle.request import Request
from treadle.sampling_params import SamplingParams

BS = 16


def manager(window: int, num_blocks: int = 2048, num_sliding: int = 256,
            prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix,
                          sliding=SlidingWindowGroup(num_sliding, BS, window))


def request(rid: str, prompt: list[int], max_tokens: int = 10_000) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def window_blocks(window: int, first_query: int, last_query: int) -> int:
    """Blocks touching the positions queries first_query..last_query can see."""
    lo = max(0, first_query - window + 1)
    return last_query // BS - lo // BS + 1


def run_step(kv: KVCacheManager, req: Request, num_new: int, rng: random.Random) -> None:
    assert kv.allocate_slots(req, num_new)
    start = req.num_computed_tokens
    held = kv.sliding.num_held_blocks(req.request_id)
    assert held <= window_blocks(kv.sliding.window, start, start + num_new - 1)
    req.num_computed_tokens += num_new
    if req.num_computed_tokens >= req.num_tokens:
        req.append_output_token(rng.randrange(1000))
    kv.cache_full_blocks(req)


@pytest.mark.parametrize("window", [512, 100, 16, 1])
def test_a_10000_token_request_holds_only_its_window_in_the_sliding_group(window):
    kv, rng = manager(window), random.Random(0)
    req = request("r", [rng.randrange(1000) for _ in range(3000)], max_tokens=7000)
    while req.num_computed_tokens < 3000:  # the prompt in chunks of 256
        run_step(kv, req, min(256, 3000 - req.num_computed_tokens), rng)
    while req.num_tokens < 10_000:
        run_step(kv, req, 1, rng)
        # between steps: the window before the next query, nothing more
        need = -(-(window - 1) // BS) + 1
        assert kv.sliding.num_held_blocks("r") <= need
        assert kv.sliding.num_held_blocks("r") >= min(need - 1, 1)
    assert kv.num_held_blocks("r") == -(-req.num_computed_tokens // BS)  # full: everything
    assert len(kv.sliding.block_ids("r")) == kv.num_held_blocks("r")  # tables line up
    assert kv.sliding.pool.num_free_blocks >= 256 - (window // BS + 2)
    kv.free(req)
    assert kv.sliding.pool.num_free_blocks == 256 and kv.pool.num_free_blocks == 2048
    kv.pool.check_invariants()
    kv.sliding.pool.check_invariants()


def test_the_window_entries_point_at_held_blocks_and_those_are_distinct():
    kv, rng = manager(40, num_sliding=16), random.Random(1)
    reqs = [request(f"r{i}", [rng.randrange(1000) for _ in range(50 + 30 * i)]) for i in range(3)]
    for step in range(120):
        for req in reqs:
            run_step(kv, req, 1 if req.num_computed_tokens else req.num_tokens, rng)
    seen = set()
    for req in reqs:
        ids = kv.sliding.block_ids(req.request_id)
        first = kv.sliding.first_needed_block(req.num_computed_tokens)
        live = ids[first:]
        assert not seen & set(live)
        seen |= set(live)
    assert kv.sliding.pool.num_free_blocks == 16 - len(seen)  # the live ones are all held


def test_allocation_fails_whole_when_the_sliding_pool_is_short():
    kv = manager(64, num_sliding=4)
    big = request("big", list(range(200)))
    assert not kv.can_allocate(big, 200)  # 13 sliding blocks for the chunk, 4 exist
    assert not kv.allocate_slots(big, 200)
    assert not kv.holds("big") and kv.pool.num_free_blocks == 2048
    assert kv.allocate_slots(big, 48)  # 3 blocks
    assert kv.sliding.num_held_blocks("big") == 3


def test_prefix_hits_stop_where_the_sliding_group_lost_the_window():
    window = 32
    kv, rng = manager(window, num_sliding=12), random.Random(2)
    prompt = [rng.randrange(1000) for _ in range(160)]  # 10 full blocks
    first = request("a", prompt + [1])
    run_step(kv, first, first.num_tokens, rng)  # its sliding blocks 0..7 are freed now
    second = request("b", prompt + [2])
    hits, num_hit = kv.get_computed_blocks(second)
    # the freed blocks are cached-free: the hit is whole (all 10 blocks) while they last
    assert num_hit == 160
    assert kv.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert kv.sliding.num_held_blocks("b") == window_blocks(window, 160, 160)
    kv.free(first)
    kv.free(second)
    # a request of 12 fresh blocks evicts every cached sliding block (the full pool has
    # fresh ones to spare, so its cached blocks stay)
    filler = request("f", [rng.randrange(1000) for _ in range(12 * BS)])
    assert kv.allocate_slots(filler, 12 * BS)
    kv.free(filler)
    third = request("c", prompt + [3])
    hits, num_hit = kv.get_computed_blocks(third)
    assert num_hit == 0  # the full group still has all 10 blocks, the sliding one none
    assert kv.pool.lookup(kv._hashes["c"][9]) is not None


def test_rollback_trims_both_groups():
    kv, rng = manager(40), random.Random(3)
    req = request("r", [rng.randrange(1000) for _ in range(30)])
    run_step(kv, req, 30, rng)
    assert kv.allocate_slots(req, 1 + 40)  # one token and 40 proposed ones
    req.num_computed_tokens += 1  # all proposals rejected
    kv.trim(req)
    assert len(kv.sliding.block_ids("r")) == kv.num_held_blocks("r") == 2
    kv.free(req)
    assert kv.sliding.pool.num_free_blocks == 256


def test_no_swap_with_a_sliding_group():
    kv = KVCacheManager(64, BS, False, num_swap_blocks=64,
                        sliding=SlidingWindowGroup(16, BS, 32))
    req = request("r", list(range(40)))
    assert kv.allocate_slots(req, 40)
    assert not kv.can_swap_out(req)  # such requests are preempted by recompute


def test_layer_groups_split_the_memory():
    gemma = ["s"] * 5 + [None]
    windows = [512 if w else None for w in gemma] * 3  # Gemma 3 270M: 15 sliding, 3 full
    groups = layer_groups(windows, 1000, 16, max_num_seqs=8, max_step_tokens=512,
                          max_model_len=32768)
    per_request = -(-511 // 16) + 2
    assert groups.num_sliding_blocks == 8 * per_request + 32
    assert groups.num_full_blocks == (1000 * 18 - groups.num_sliding_blocks * 15) // 3
    assert groups.num_full_blocks > 1000  # what the window saves, full layers get
    assert layer_groups([None] * 4, 1000, 16, 8, 512, 4096) is None
    assert layer_groups([4096] * 4, 1000, 16, 8, 512, 4096) is None  # window >= context
    mistral = layer_groups([64] * 4, 1000, 16, 256, 2048, 4096)
    assert mistral.num_sliding_blocks == 1000 and mistral.num_full_layers == 0
    with pytest.raises(ValueError, match="different sliding windows"):
        layer_groups([64, 128, None], 1000, 16, 8, 512, 4096)


def test_the_kv_config_names_each_group_its_layers_and_blocks():
    """The engine core's KV config (made once, handed to every worker) carries the same
    split, each layer's group, and no swap space when a group cannot swap."""
    from treadle.config import EngineConfig
    from treadle.core.kv.config import kv_cache_config
    from treadle.kv_specs.specs import FullAttentionSpec, H2OSpec, SlidingWindowSpec

    config = EngineConfig.from_options(block_size=16, max_num_seqs=8,
                                       max_num_batched_tokens=512, kv_cache_dtype="int8")
    windows = ([512] * 5 + [None]) * 3
    kv = kv_cache_config(config, windows, 32768, 1000, 64)
    # A step's new tokens: the budget and the slack a finishing prompt may take.
    split = layer_groups(windows, 1000, 16, 8, config.scheduler.max_step_tokens, 32768)
    full, sliding = kv.groups
    assert isinstance(full.spec, FullAttentionSpec) and full.layers == (5, 11, 17)
    assert isinstance(sliding.spec, SlidingWindowSpec) and sliding.spec.window == 512
    assert (full.num_blocks, sliding.num_blocks) == (split.num_full_blocks,
                                                   split.num_sliding_blocks)
    assert kv.layer_groups == split and kv.num_blocks == split.num_full_blocks
    assert kv.num_swap_blocks == 0  # the sliding group has no swap plan
    assert [kv.num_blocks_of_layer(i) for i in (0, 5)] == [sliding.num_blocks, full.num_blocks]
    assert {s.cache_dtype for s in kv.specs} == {"int8"}
    plain = kv_cache_config(config, [None] * 4, 4096, 1000, 64)
    assert len(plain.groups) == 1 and plain.primary.layers == (0, 1, 2, 3)
    assert (plain.num_blocks, plain.num_swap_blocks, plain.layer_groups) == (1000, 64, None)
    h2o = EngineConfig.from_options(block_size=16, kv_eviction="h2o", kv_budget_tokens=64)
    assert isinstance(kv_cache_config(h2o, [None] * 4, 4096, 1000, 64).primary.spec, H2OSpec)
    with pytest.raises(ValueError, match="sliding-window layer group .* does not support "
                                         "kv_eviction h2o"):
        kv_cache_config(h2o, windows, 32768, 1000, 64)


def test_the_manager_from_the_kv_config_is_the_schedulers():
    """KVCacheManager.from_config builds what the scheduler's constructor builds."""
    from treadle.config import EngineConfig
    from treadle.core.kv.config import kv_cache_config

    config = EngineConfig.from_options(block_size=BS, max_num_seqs=2,
                                       max_num_batched_tokens=64)
    kv_config = kv_cache_config(config, [32, None], 4096, 300, 0)
    a = KVCacheManager.from_config(kv_config, True)
    split = kv_config.layer_groups
    b = KVCacheManager(split.num_full_blocks, BS, True,
                       sliding=SlidingWindowGroup(split.num_sliding_blocks, BS, split.window))
    for kv in (a, b):
        assert [type(g).__name__ for g in kv.groups] == ["FullAttentionManager",
                                                         "SlidingWindowManager"]
        assert kv.sliding is kv.groups[1] and kv.eviction is None and kv.swap_pool is None
    assert [g.pool.num_blocks for g in a.groups] == [g.pool.num_blocks for g in b.groups]
    for kv in (a, b):
        req = request("r", list(range(3, 103)))
        assert kv.allocate_slots(req, 100)
    assert a.block_ids("r") == b.block_ids("r")
    assert a.sliding.block_ids("r") == b.sliding.block_ids("r")
