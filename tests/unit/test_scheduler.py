"""Scheduler tests with a fake runner: budgets, admission timing, chunking, preemption, freeing."""

from __future__ import annotations

import random

import pytest

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.scheduler import Scheduler
from treadle.request import FinishReason, Request, RequestStatus
from treadle.sampling_params import SamplingParams


NO_LOOKAHEAD = dict(admission_lookahead_tokens=0, kv_watermark=0.0)
"""Preemption is what these tests exercise: admit on free blocks alone."""


def make_scheduler(max_tokens=64, max_seqs=4, num_blocks=64, block_size=4,
                   prefix_caching=True, chunked=True, max_model_len=4096,
                   preemption_mode="recompute", num_swap_blocks=0, cooldown=8,
                   wait_weight=100.0, finish_first=True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                        enable_chunked_prefill=chunked, preemption_mode=preemption_mode,
                        preemption_cooldown_steps=cooldown, victim_wait_weight=wait_weight,
                        finish_prompts_first=finish_first, **NO_LOOKAHEAD),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_kv_blocks=num_blocks, max_model_len=max_model_len, num_swap_blocks=num_swap_blocks)


def make_request(rid, prompt_len, max_tokens, priority=0, arrival=None, seed=0):
    rng = random.Random(f"{rid}-{seed}")
    prompt = [rng.randrange(3, 1000) for _ in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=2, arrival_time=arrival, priority=priority)


def fake_runner(output):
    """Samples a token that depends only on the sampled position (like a real model would
    depend only on the sequence), for every request that reaches its last token."""
    return ModelRunnerOutput(sampled_token_ids={
        s.request_id: [7 + (s.num_computed_tokens + s.num_scheduled_tokens) % 11]
        for s in output.scheduled if s.sample})


def run_to_completion(scheduler, requests, max_steps=10_000, on_step=None):
    for r in requests:
        scheduler.add_request(r)
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if on_step is not None:
            on_step(scheduler, out)
        scheduler.update_from_output(out, fake_runner(out))
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_budgets_never_exceeded_and_all_blocks_freed():
    sched = make_scheduler(max_tokens=32, max_seqs=3, num_blocks=128)
    requests = [make_request(f"r{i}", prompt_len=1 + 13 * i, max_tokens=5 + i) for i in range(10)]

    def check(s, out):
        # The budget, and the slack a prompt may take to finish (32 // 8 = 4 tokens).
        assert out.num_scheduled_tokens <= s.config.max_step_tokens == 36
        assert len(out.scheduled) <= 3
        assert len(s.running) <= 3
        # decodes come before prefill chunks in the flat batch
        kinds = [x.num_scheduled_tokens > 1 for x in out.scheduled]
        assert kinds == sorted(kinds)

    run_to_completion(sched, requests, on_step=check)
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.finish_reason == FinishReason.LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert sched.kv.pool.num_free_blocks == 128
    sched.kv.pool.check_invariants()


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    sched = make_scheduler(max_tokens=16, max_seqs=4, num_blocks=64)
    short = make_request("short", prompt_len=4, max_tokens=20)
    long = make_request("long", prompt_len=50, max_tokens=2)
    sched.add_request(short)
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = sched.schedule()
        by_id = {s.request_id: s for s in out.scheduled}
        assert "short" in by_id and by_id["short"].num_scheduled_tokens == 1  # decode keeps running
        chunks.append(by_id["long"].num_scheduled_tokens)
        assert by_id["long"].sample == (sum(chunks) == 50)
        sched.update_from_output(out, fake_runner(out))
    assert chunks == [15, 15, 15, 5]


def _tokens(out):
    return {s.request_id: s.num_scheduled_tokens for s in out.scheduled}


@pytest.mark.parametrize("finish_first", [True, False])
def test_step_that_finishes_a_prompt_takes_no_partial_chunk(finish_first):
    """A 36-token prompt in 16-token steps ends with 4 tokens; a 30-token prompt behind it
    would get the other 12 and still need a step: with finish_prompts_first it waits and
    then runs whole, so the first prompt's last step is short and the second loses no
    step."""
    sched = make_scheduler(max_tokens=16, max_seqs=4, num_blocks=64, prefix_caching=False,
                           finish_first=finish_first)
    first = make_request("first", prompt_len=36, max_tokens=3)
    second = make_request("second", prompt_len=30, max_tokens=3)
    sched.add_request(first)
    sched.add_request(second)
    steps = []
    while second.num_output_tokens == 0:
        out = sched.schedule()
        steps.append(_tokens(out))
        sched.update_from_output(out, fake_runner(out))
    if finish_first:
        assert steps == [{"first": 16}, {"first": 16}, {"first": 4},
                         {"first": 1, "second": 15}, {"first": 1, "second": 15}]
    else:
        assert steps == [{"first": 16}, {"first": 16}, {"first": 4, "second": 12},
                         {"first": 1, "second": 15}, {"first": 1, "second": 3}]


@pytest.mark.parametrize("finish_first", [True, False])
def test_last_chunk_of_a_split_prompt_runs_without_other_prefills(finish_first):
    """A 20-token prompt in 16-token steps ends with 4 tokens: with finish_prompts_first
    that step carries no other prompt, even a whole one that fits (the split prompt has
    waited two steps already); decodes still run with it."""
    sched = make_scheduler(max_tokens=16, max_seqs=4, num_blocks=64, prefix_caching=False,
                           finish_first=finish_first)
    early = make_request("early", prompt_len=3, max_tokens=10)
    sched.add_request(early)
    out = sched.schedule()
    assert _tokens(out) == {"early": 3}
    sched.update_from_output(out, fake_runner(out))
    split = make_request("split", prompt_len=20, max_tokens=3)
    short = make_request("short", prompt_len=3, max_tokens=3)
    sched.add_request(split)
    sched.add_request(short)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append(_tokens(out))
        sched.update_from_output(out, fake_runner(out))
    if finish_first:
        assert steps == [{"early": 1, "split": 15}, {"early": 1, "split": 5},
                         {"early": 1, "split": 1, "short": 3}]
    else:
        assert steps == [{"early": 1, "split": 15}, {"early": 1, "split": 5, "short": 3},
                         {"early": 1, "split": 1, "short": 1}]


def _decoding(sched, num: int) -> list[Request]:
    """`num` requests past their prompts (4 tokens each), decoding one token a step."""
    requests = [make_request(f"d{i}", prompt_len=4, max_tokens=50) for i in range(num)]
    for r in requests:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    assert all(r.is_decoding for r in requests)
    return requests


@pytest.mark.parametrize("finish_first", [True, False])
def test_a_prompt_left_short_by_the_decodes_finishes_over_the_budget(finish_first):
    """Six decodes take six of a 64-token budget; a 64-token prompt behind them would run
    58 tokens and then 6 in a step of their own (every weight read again for 6 tokens,
    its first token a step later). With finish_prompts_first it runs whole: the step
    passes the budget by 6, within the slack of 64 // 8."""
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=128, prefix_caching=False,
                           finish_first=finish_first)
    _decoding(sched, 6)
    prompt = make_request("prompt", prompt_len=64, max_tokens=3)
    sched.add_request(prompt)
    steps = []
    while prompt.num_output_tokens == 0:
        out = sched.schedule()
        steps.append(_tokens(out)["prompt"])
        sched.update_from_output(out, fake_runner(out))
    assert steps == ([64] if finish_first else [58, 6])
    assert sched.config.finish_slack == (8 if finish_first else 0)


def test_a_rest_past_the_slack_is_chunked_within_the_budget():
    """Nine decodes leave a 64-token prompt a rest of 9, past the slack of 8: it is split,
    and no step passes the budget."""
    sched = make_scheduler(max_tokens=64, max_seqs=12, num_blocks=128, prefix_caching=False)
    _decoding(sched, 9)
    prompt = make_request("prompt", prompt_len=64, max_tokens=3)
    sched.add_request(prompt)
    out = sched.schedule()
    assert _tokens(out)["prompt"] == 55 and out.num_scheduled_tokens == 64


def test_short_prompts_waiting_keep_their_room_over_the_slack():
    """A running prompt whose rest would fit the slack still leaves its room to a short
    prompt waiting behind it (SGLang #22831's protection, short_prompt_room): 70 tokens
    left in a 64-token step would run whole alone; with a 10-token prompt waiting, the
    long one takes 54 and the short one its 10, within the budget."""
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=128, prefix_caching=False)
    long = make_request("long", prompt_len=134, max_tokens=3)
    sched.add_request(long)
    out = sched.schedule()
    assert _tokens(out) == {"long": 64}
    sched.update_from_output(out, fake_runner(out))
    sched.add_request(make_request("short", prompt_len=10, max_tokens=3))
    assert _tokens(sched.schedule()) == {"long": 54, "short": 10}


def test_a_running_prompt_alone_finishes_over_the_budget():
    """The same 70 tokens left with nobody waiting: they run in one step."""
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=128, prefix_caching=False)
    sched.add_request(make_request("long", prompt_len=134, max_tokens=3))
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    assert _tokens(sched.schedule()) == {"long": 70}


def test_one_prompt_a_step_runs_over_the_budget():
    """Prompts of 60, 10 and 5 tokens in a 64-token step: the second finishes over the
    budget (a rest of 6); the budget is then spent and the third waits a step."""
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=128, prefix_caching=False)
    for name, length in (("a", 60), ("b", 10), ("c", 5)):
        sched.add_request(make_request(name, prompt_len=length, max_tokens=3))
    out = sched.schedule()
    assert _tokens(out) == {"a": 60, "b": 10}
    sched.update_from_output(out, fake_runner(out))
    assert _tokens(sched.schedule()) == {"a": 1, "b": 1, "c": 5}


@pytest.mark.parametrize("num_blocks,chunks", [(64, [62, 64]), (35, [62, 62])])
def test_finishing_over_the_budget_never_preempts(num_blocks, chunks):
    """A 126-token prompt beside two decodes runs 62 tokens a step; its second chunk would
    finish it over the budget (a rest of 2), which needs one block more than a budget
    chunk. With 35 blocks that block is not free: the prompt takes its budget chunk, and
    nobody is preempted for the slack."""
    sched = make_scheduler(max_tokens=64, max_seqs=4, num_blocks=num_blocks,
                           prefix_caching=False)
    _decoding(sched, 2)
    long = make_request("long", prompt_len=126, max_tokens=3)
    sched.add_request(long)
    steps = []
    for _ in chunks:
        out = sched.schedule()
        assert not out.preempted_request_ids
        steps.append(_tokens(out)["long"])
        sched.update_from_output(out, fake_runner(out))
    assert steps == chunks
    assert long.is_decoding == (num_blocks == 64)


def test_a_tighter_bound_than_the_budget_is_not_stretched():
    """With decode_step_prefill_tokens 40 a prompt beside decodes gets 40 tokens a step,
    even when the rest (4) is within the slack: that bound keeps decodes' gaps short."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                        decode_step_prefill_tokens=40, **NO_LOOKAHEAD),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_kv_blocks=128, max_model_len=4096)
    _decoding(sched, 2)
    prompt = make_request("prompt", prompt_len=44, max_tokens=3)
    sched.add_request(prompt)
    assert _tokens(sched.schedule())["prompt"] == 40


def test_whole_prompts_still_share_the_step_that_finishes_one():
    sched = make_scheduler(max_tokens=36, max_seqs=8, num_blocks=64, prefix_caching=False)
    a, b, c = (make_request(n, prompt_len=10, max_tokens=2) for n in "abc")
    d = make_request("d", prompt_len=20, max_tokens=2)
    e = make_request("e", prompt_len=5, max_tokens=2)
    for r in (a, b, c, d, e):
        sched.add_request(r)
    out = sched.schedule()
    # a, b and c finish their prompts together; d would get 6 of its 20: it waits, and
    # e, which would fit whole, does not pass it.
    assert _tokens(out) == {"a": 10, "b": 10, "c": 10}
    sched.update_from_output(out, fake_runner(out))
    assert _tokens(sched.schedule()) == {"a": 1, "b": 1, "c": 1, "d": 20, "e": 5}


def test_waiting_request_admitted_in_step_after_a_finish():
    sched = make_scheduler(max_tokens=64, max_seqs=2)
    a = make_request("a", prompt_len=3, max_tokens=2)
    b = make_request("b", prompt_len=3, max_tokens=10)
    c = make_request("c", prompt_len=3, max_tokens=10)
    for r in (a, b, c):
        sched.add_request(r)
    step = 0
    while not a.is_finished:
        out = sched.schedule()
        assert "c" not in {s.request_id for s in out.scheduled}
        sched.update_from_output(out, fake_runner(out))
        step += 1
    out = sched.schedule()
    assert "c" in {s.request_id for s in out.scheduled}
    assert a.request_id in out.finished_request_ids


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(max_tokens=16, max_seqs=4, chunked=False)
    sched.add_request(make_request("big", prompt_len=17, max_tokens=1))
    out = sched.schedule()
    assert out.is_empty  # cannot ever fit unchunked: the engine rejects it at ingest


def test_preemption_under_memory_pressure_finishes_everything():
    # 6 blocks of 4 tokens: far less than the running set wants.
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=6, block_size=4,
                           prefix_caching=False)
    requests = [make_request(f"r{i}", prompt_len=5, max_tokens=12) for i in range(5)]
    run_to_completion(sched, requests)
    assert sched.stats.num_preemptions > 0
    for r in requests:
        assert r.num_output_tokens == 12
    assert sched.kv.pool.num_free_blocks == 6


def test_preempted_request_resumes_with_identical_tokens():
    """The fake runner's token depends only on position, so outputs must match an easy run."""
    def outputs(num_blocks):
        sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=num_blocks, block_size=4)
        requests = [make_request(f"r{i}", prompt_len=3 + i, max_tokens=10) for i in range(4)]
        run_to_completion(sched, requests)
        return [r.output_token_ids for r in requests], sched.stats.num_preemptions

    relaxed, n0 = outputs(256)
    tight, n1 = outputs(5)
    assert n0 == 0 and n1 > 0
    assert tight == relaxed


def test_abort_frees_blocks():
    sched = make_scheduler(num_blocks=32)
    r = make_request("x", prompt_len=20, max_tokens=50)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    assert sched.kv.pool.num_free_blocks < 32
    sched.finish_request("x", RequestStatus.FINISHED_ABORTED)
    assert r.finish_reason == FinishReason.ABORT
    assert sched.kv.pool.num_free_blocks == 32
    assert not sched.has_unfinished_requests()
    assert "x" in sched.schedule().finished_request_ids


def test_prefix_cache_hit_skips_cached_blocks():
    sched = make_scheduler(max_tokens=64, num_blocks=64, block_size=4)
    first = make_request("first", prompt_len=18, max_tokens=1)
    run_to_completion(sched, [first])
    second = Request("second", first.prompt_token_ids[:16] + [999, 998],
                     SamplingParams(max_tokens=1), eos_token_id=2)
    sched.add_request(second)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_computed_tokens == 16 and s.num_scheduled_tokens == 2
    assert s.new_request.prompt_token_ids[16:] == [999, 998]
    assert sched.kv.prefix_stats.num_hit_tokens == 16


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("dup", 3, 2))
    with pytest.raises(ValueError, match="dup"):
        sched.add_request(make_request("dup", 3, 2))


@pytest.mark.parametrize("mode, swap_blocks", [("recompute", 0), ("swap", 64), ("auto", 64)])
def test_preemption_storm_all_finish(mode, swap_blocks):
    """Five requests that all outgrow a 7-block cache (the largest needs 6 blocks).

    Under swap (and auto, which with no cost model swaps while there is room) every
    request is preempted at least once. Under recompute the victim loss keeps choosing
    the requests with the least computed work, so not every request is hit; all must
    still finish with exactly their token counts.
    """
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=7, block_size=4,
                           prefix_caching=False, preemption_mode=mode,
                           num_swap_blocks=swap_blocks, cooldown=4, wait_weight=0.0)
    requests = [make_request(f"r{i}", prompt_len=2, max_tokens=16 + i, arrival=float(i))
                for i in range(5)]
    swaps = {"out": 0, "in": 0}

    def count(s, out):
        swaps["out"] += len(out.swap_out)
        swaps["in"] += len(out.swap_in)

    run_to_completion(sched, requests, on_step=count)
    for r in requests:
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.output_token_ids == [7 + (2 + k) % 11 for k in range(r.num_output_tokens)]
    stats = sched.stats
    assert stats.num_preemptions > 0
    assert stats.num_preemptions == stats.num_preemptions_swap + stats.num_preemptions_recompute
    if mode == "recompute":
        assert stats.num_preemptions_swap == 0 and swaps["out"] == 0
    else:
        assert all(r.num_preemptions >= 1 for r in requests), \
            [r.num_preemptions for r in requests]
        assert stats.num_preemptions_swap > 0 and swaps["out"] == swaps["in"] > 0
    assert sched.kv.pool.num_free_blocks == 7
    if sched.kv.swap_pool is not None:
        assert sched.kv.swap_pool.num_free_blocks == 64


def test_swapped_requests_resume_before_new_admissions():
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=4, block_size=4,
                           prefix_caching=False, preemption_mode="swap", num_swap_blocks=16)
    a = make_request("a", prompt_len=4, max_tokens=12, arrival=0.0)
    b = make_request("b", prompt_len=4, max_tokens=12, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    while not sched.swapped:
        out = sched.schedule()
        sched.update_from_output(out, fake_runner(out))
    late = make_request("late", prompt_len=4, max_tokens=2, arrival=2.0)
    sched.add_request(late)
    swapped = sched.swapped[0]
    while True:
        out = sched.schedule()
        if "late" in {s.request_id for s in out.scheduled}:
            # Only once the swapped request is back in (this step or earlier).
            assert swapped.status != RequestStatus.SWAPPED
            break
        assert swapped.status == RequestStatus.SWAPPED or not sched.swapped
        sched.update_from_output(out, fake_runner(out))


def test_abort_of_swapped_request_frees_swap_blocks():
    sched = make_scheduler(max_tokens=64, max_seqs=8, num_blocks=4, block_size=4,
                           prefix_caching=False, preemption_mode="swap", num_swap_blocks=16)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=12, arrival=float(i)))
    while not sched.swapped:
        out = sched.schedule()
        sched.update_from_output(out, fake_runner(out))
    victim = sched.swapped[0]
    sched.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.swap_pool.num_free_blocks == 16 and not sched.swapped


def test_recompute_resume_is_chunked_even_without_chunked_prefill():
    """Regression: with chunked prefill off, a request preempted by recompute whose
    prompt + generated tokens outgrew the token budget could never resume."""
    sched = make_scheduler(max_tokens=16, max_seqs=4, num_blocks=9, block_size=4,
                           prefix_caching=False, chunked=False, cooldown=0)
    requests = [make_request(f"r{i}", prompt_len=14, max_tokens=12, arrival=float(i))
                for i in range(2)]
    run_to_completion(sched, requests, max_steps=500)
    assert sched.stats.num_preemptions > 0
    assert all(r.num_output_tokens == 12 for r in requests)
    assert sched.kv.pool.num_free_blocks == 9


def test_a_request_the_runner_reports_failed_ends_alone_with_an_error():
    """A per-request component of the worker (a grammar, an adapter's load) failed for one
    request: it ends with finish reason 'error' and its blocks are freed; what the step
    sampled for it is dropped; the others finish as if nothing happened."""
    scheduler = make_scheduler()
    free_at_start = scheduler.kv.pool.num_free_blocks
    requests = [make_request(f"r{i}", 10, 6) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    outputs = []
    for step in range(50):
        out = scheduler.schedule()
        result = fake_runner(out)
        if step == 2:
            result.failed = {"r1": "structured_outputs: the grammar failed while generating"}
        outputs += scheduler.update_from_output(out, result)
        if not scheduler.has_unfinished_requests():
            break
    by_request = {}
    for o in outputs:
        by_request.setdefault(o.request_id, []).append(o)
    failed = by_request["r1"][-1]
    assert failed.finish_reason is FinishReason.ERROR and failed.new_token_ids == []
    assert failed.error == "structured_outputs: the grammar failed while generating"
    assert requests[1].status is RequestStatus.FINISHED_ERROR
    for rid in ("r0", "r2"):
        assert sum(len(o.new_token_ids) for o in by_request[rid]) == 6
        assert by_request[rid][-1].finish_reason is FinishReason.LENGTH
    scheduler.schedule()  # the finished requests' blocks go back on the next step
    assert scheduler.kv.pool.num_free_blocks == free_at_start
