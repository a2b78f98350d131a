"""Multi-token decode steps (speculative tokens) through the real scheduler and KV manager,
with a fake runner that verifies proposals like a real one: the model's token at each
position is a fixed function of the position, proposals are right for a random number of
positions and then wrong, and the runner keeps the agreeing prefix plus its own token.
Outputs must equal the run without proposals, rejected tokens must never reach the prefix
cache, and every block must come back."""

from __future__ import annotations

import random

import pytest

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.kv.hashing import hash_block, root_hash
from treadle.core.kv.manager import KVCacheManager
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.scheduler import Scheduler
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams


def model_token(index: int) -> int:
    """The token the fake model puts at sequence index `index`."""
    return 7 + index % 11


def make_scheduler(num_blocks=64, block_size=4, max_tokens=32, max_seqs=4,
                   preemption_mode="recompute", num_swap_blocks=0, policy="fcfs"):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                        preemption_mode=preemption_mode, scheduling_policy=policy,
                        admission_lookahead_tokens=0, kv_watermark=0.0),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        num_kv_blocks=num_blocks, max_model_len=4096, num_swap_blocks=num_swap_blocks)


def make_requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(8)]  # a prefix some requests share
    requests = []
    for i in range(count):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 500)
                                              for _ in range(rng.randrange(1, 30))]
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 25),
                                                                 ignore_eos=True),
                                eos_token_id=2, arrival_time=float(i)))
    return requests


class FakeVerifyingRunner:
    """Samples model_token at every sampling position and verifies proposals; proposes
    next-step tokens right for a random prefix (with `propose`)."""

    def __init__(self, seed: int, propose: bool) -> None:
        self.rng = random.Random(seed)
        self.propose = propose
        self.num_rejected = 0

    def __call__(self, output) -> ModelRunnerOutput:
        sampled, proposals = {}, {}
        for s in output.scheduled:
            if not s.sample:
                continue
            spec = s.spec_token_ids
            first = s.num_computed_tokens + s.num_scheduled_tokens - len(spec)  # index after
            tokens = []
            for j in range(len(spec) + 1):
                tokens.append(model_token(first + j))
                if j == len(spec) or spec[j] != tokens[-1]:
                    break
            self.num_rejected += len(spec) - (len(tokens) - 1)
            sampled[s.request_id] = tokens
            if self.propose:
                nxt = first + len(tokens)  # index of the token after the new last one
                k = self.rng.randrange(0, 5)
                right = self.rng.randrange(0, k + 1)
                proposals[s.request_id] = [model_token(nxt + j) if j < right else 1
                                           for j in range(k)]
        return ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=proposals)


def check_prefix_cache(kv: KVCacheManager, requests: list[Request]) -> None:
    """Every registered block of a live request holds only computed, accepted tokens: its
    hash is the chain over the request's own tokens, and it lies before num_computed."""
    size = kv.block_size
    for r in requests:
        if r.is_finished or not kv.holds(r.request_id):
            continue
        parent = root_hash(r.cache_salt)
        for i, block_id in enumerate(kv.block_ids(r.request_id)):
            block = kv.pool.blocks[block_id]
            if block.block_hash is None:
                break
            assert (i + 1) * size <= r.num_computed_tokens, (r, i)
            parent = hash_block(parent, r.all_token_ids[i * size:(i + 1) * size])
            assert block.block_hash == parent, (r, i)


def run(scheduler: Scheduler, requests: list[Request], runner) -> list[list[int]]:
    for r in requests:
        scheduler.add_request(r)
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.num_scheduled_tokens <= scheduler.config.max_step_tokens
        for s in out.scheduled:
            if s.spec_token_ids:
                assert s.is_decoding and s.sample
                assert s.num_scheduled_tokens == 1 + len(s.spec_token_ids)
        scheduler.update_from_output(out, runner(out))
        scheduler.kv.pool.check_invariants()
        check_prefix_cache(scheduler.kv, requests)
        steps += 1
        assert steps < 5000, "no progress"
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_equal_the_run_without_proposals(seed, mode):
    swap = 64 if mode == "swap" else 0
    plain = run(make_scheduler(num_blocks=24, preemption_mode=mode, num_swap_blocks=swap),
                make_requests(10, seed), FakeVerifyingRunner(seed, propose=False))
    runner = FakeVerifyingRunner(seed, propose=True)
    sched = make_scheduler(num_blocks=24, preemption_mode=mode, num_swap_blocks=swap)
    requests = make_requests(10, seed)
    spec = run(sched, requests, runner)
    assert spec == plain
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert runner.num_rejected > 0  # rollback was exercised
    assert sched.kv.pool.num_free_blocks == 24
    if sched.kv.swap_pool is not None:
        assert sched.kv.swap_pool.num_free_blocks == 64


def test_proposals_fit_the_budget_the_context_and_max_tokens():
    sched = make_scheduler(max_tokens=8)
    r = Request("r", list(range(3, 9)), SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(r)
    out = sched.schedule()  # the prompt
    sched.update_from_output(out, ModelRunnerOutput({"r": [50]}, spec_token_ids={"r": [1] * 9}))
    out = sched.schedule()
    (s,) = out.scheduled
    # max_tokens 4 with one generated: at most 2 proposals (one token is the model's own)
    assert s.spec_token_ids == [1, 1] and s.num_scheduled_tokens == 3


def test_rejection_frees_blocks_past_the_accepted_tokens():
    sched = make_scheduler(block_size=4)
    r = Request("r", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({"r": [9]}, spec_token_ids={"r": [1] * 8}))
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_scheduled_tokens == 9 and sched.kv.num_held_blocks("r") == 3  # 12 slots
    free_before = sched.kv.pool.num_free_blocks
    sched.update_from_output(out, ModelRunnerOutput({"r": [11]}))  # every proposal refused
    assert r.num_computed_tokens == 4 and r.output_token_ids == [9, 11]
    assert sched.kv.num_held_blocks("r") == 1
    assert sched.kv.pool.num_free_blocks == free_before + 2
    # The worker is told the table changed other than by appending.
    (s,) = sched.schedule().scheduled
    assert s.replaces_block_table and s.new_block_ids == sched.kv.block_ids("r")


def test_step_message_is_incremental():
    sched = make_scheduler(block_size=4)
    r = Request("r", list(range(3, 13)), SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add_request(r)
    out = sched.schedule()
    (first,) = out.scheduled
    assert first.new_request.prompt_token_ids == r.prompt_token_ids
    assert first.new_token_ids == [] and len(first.new_block_ids) == 3
    sched.update_from_output(out, ModelRunnerOutput({"r": [40]}))
    (second,) = sched.schedule().scheduled
    assert second.new_request is None and second.new_token_ids == [40]
    assert second.new_block_ids == [] and not second.replaces_block_table
