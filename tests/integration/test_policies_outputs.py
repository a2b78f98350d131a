"""Greedy outputs are identical under every scheduling policy (the policy changes when a
request runs, never what it produces), on a tiny model with a tight KV cache so that
requests are preempted at admission and under memory pressure; and the per-step trace
of such a run reads back and plots."""

from __future__ import annotations

import random

import pytest

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams

NUM_REQUESTS = 14


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama-policies"), "llama")


def workload():
    """(arrival step, prompt, max_tokens, priority, tenant, length hint) per request."""
    rng = random.Random(7)
    items = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 512) for _ in range(rng.choice([1, 5, 17, 40, 90]))]
        items.append((i // 2, prompt, rng.randint(6, 24), rng.randint(0, 3),
                      rng.choice(["a", "b", None]), rng.choice([None, 4])))
    # The last arrival is urgent and short: it must preempt at admission.
    items.append((NUM_REQUESTS // 2 + 1, [9, 8, 7], 5, -5, "b", 2))
    return items


def run(model_dir, **options):
    config = EngineConfig.from_options(model=model_dir, dtype="float32", block_size=4,
                                       **options)
    engine = EngineCore(config)
    items = workload()
    requests = {}
    step = 0
    while step <= items[-1][0] or engine.has_unfinished_requests():
        for i, (arrival, prompt, max_tokens, priority, tenant, hint) in enumerate(items):
            if arrival == step:
                r = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True),
                            priority=priority, tenant=tenant, length_hint=hint)
                assert engine.add_request(r) is None
                requests[r.request_id] = r
        engine.step()
        step += 1
        assert step < 2000
    assert engine.scheduler.kv.pool.num_free_blocks == engine.num_kv_blocks
    return {rid: r.output_token_ids for rid, r in requests.items()}, engine.stats()


@pytest.fixture(scope="module")
def reference(model_dir):
    outputs, stats = run(model_dir, scheduling_policy="fcfs", num_kv_blocks=2048,
                         max_num_batched_tokens=512, preemption_mode="recompute")
    assert stats["num_preemptions"] == 0
    return outputs


def check_policy(model_dir, reference, policy, mode):
    outputs, stats = run(model_dir, scheduling_policy=policy, num_kv_blocks=40,
                         makespan_min_rows=2,  # paced below max_num_seqs
                         max_num_batched_tokens=32, max_num_seqs=4, preemption_mode=mode,
                         swap_space="1MiB", admission_preemption_threshold=1.0,
                         admission_preemption_wait_steps=0,  # preempt: the path under test
                         tenant_weights="a=1,b=2", max_head_bypasses=2,
                         admission_lookahead_tokens=0, kv_watermark=0.0)
    assert outputs == reference
    assert stats["num_preemptions"] > 0
    if policy not in ("fcfs", "makespan"):  # the two never preempt at admission
        assert stats["num_admission_preemptions"] > 0


@pytest.mark.executors("uni")
@pytest.mark.parametrize("policy", ["fcfs", "priority", "srpt", "fair", "makespan"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_identical_under_every_policy(model_dir, reference, policy, mode):
    """The policy is the scheduler's, in the engine's own process: its choices reach the
    worker as steps and preemptions, whatever the executor, so the matrix runs on one
    (the mp executor's twin below takes both preemption modes under one policy)."""
    check_policy(model_dir, reference, policy, mode)


@pytest.mark.executors("mp")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_identical_with_the_worker_in_a_child_process(model_dir, reference,
                                                                     mode):
    """The mp executor's part of the matrix above: a policy that preempts at admission
    and under memory pressure, by recompute and by swap (the swap copies run in the
    child process), gives the same greedy outputs."""
    check_policy(model_dir, reference, "priority", mode)


def test_trace_records_every_token_and_plots(model_dir, reference, tmp_path):
    from treadle.bench.trace_plot import plot_trace, timeline
    from treadle.engine.trace import read_trace

    path = tmp_path / "run.jsonl"
    outputs, stats = run(model_dir, scheduling_policy="priority", num_kv_blocks=40,
                         max_num_batched_tokens=32, max_num_seqs=4,
                         preemption_mode="recompute", trace=str(path))
    assert outputs == reference
    trace = read_trace(path)
    assert trace.policy == "priority"
    assert len(trace.arrivals) == len(workload())
    assert len(trace.steps) == stats["num_steps"]
    finished = {rid for s in trace.steps for rid, _ in s.finished}
    assert finished == set(trace.arrivals)
    items = workload()
    tokens = trace.tokens_by_request()
    for rid, arrival in trace.arrivals.items():
        prompt, max_tokens = items[int(rid)][1], items[int(rid)][2]
        assert arrival.num_prompt_tokens == len(prompt)
        # every token computed once, plus what preemption by recompute had to redo
        assert tokens[rid] >= len(prompt) + max_tokens - 1
    if stats["num_preemptions"]:
        assert any(s.preempted for s in trace.steps)
    lines = timeline(trace)
    assert {seg.state for segs in lines.values() for seg in segs} >= {"prefill", "decode"}
    png = plot_trace(path, tmp_path / "run.png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
