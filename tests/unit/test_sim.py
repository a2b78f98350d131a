"""The capacity simulator: the production scheduler on a simulated clock.

A hand-computed timeline, determinism, the scheduler being treadle.core's own (no copy),
P/D, speculative acceptance, routers, the SLO monitor, and the CLI's result shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import treadle.core.scheduler as scheduler_module
from treadle.config import CacheConfig, SchedulerConfig
from treadle.sim.clock import SimClock
from treadle.sim.config import SimConfig
from treadle.sim.fleet import Fleet
from treadle.sim.replica import Replica, ReplicaSpec
from treadle.router.prefix_tree import chunk_hashes
from treadle.router.routers import (LeastLoadRouter, PrefixAwareRouter, PrefixRouterOptions,
                                    ReplicaLoad, RoundRobinRouter)
from treadle.sim.simulate import build, fleet_router, run, simulate
from treadle.sim.step_model import LinearStepModel
from treadle.sim.workload import PromptMaker, SimRequest, scale_rate


def write_csv(path, rows):
    """An Azure-format trace: (seconds, context tokens, generated tokens) rows."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, c, g in rows:
        whole = int(t)
        micros = int(round((t - whole) * 1e6))
        lines.append(f"2023-11-16 18:{whole // 60:02d}:{whole % 60:02d}.{micros:06d},{c},{g}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def trace_csv(tmp_path):
    rows = [(0.05 * i + 0.013 * (i % 7), 40 + 37 * (i % 11), 3 + 5 * (i % 9)) for i in range(80)]
    return write_csv(tmp_path / "trace.csv", rows)


NO_LOOKAHEAD = dict(admission_lookahead_tokens=0, kv_watermark=0.0)
"""Admit on free blocks alone (the engine's default leaves headroom), for tests of preemption."""


def tiny_spec(budget=8, block_size=4, blocks=64, scheduler=None, **kw) -> ReplicaSpec:
    return ReplicaSpec(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4,
                                       **(scheduler or {})),
                       CacheConfig(block_size=block_size), blocks, 0, 1024, 256, 1, **kw)


def fleet_of(spec, model, n=1, maker_size=8):
    clock = SimClock()
    replicas = [Replica(i, spec, model, clock) for i in range(n)]
    return Fleet(replicas, RoundRobinRouter(), clock, PromptMaker(maker_size))


def times(result):
    return {r.request.index: (r.first_token - r.request.arrival, r.last_token - r.request.arrival,
                              r.num_tokens) for r in result.records}


def test_timeline_computed_by_hand():
    # step = 10 ms + 1 ms per prefill token + 2 ms per decode token.
    model = LinearStepModel(0.010, {"prefill_tokens": 0.001, "decode_tokens": 0.002})
    requests = [SimRequest(0, 0.0, 4, 3), SimRequest(1, 0.015, 2, 2)]
    result = fleet_of(tiny_spec(), model).run(requests)
    # [0, .014]: A's prompt (4) -> A1.   [.014, .026]: A decode -> A2 (B arrives at .015).
    # [.026, .040]: A decode + B's prompt (2) -> A3 (done), B1.   [.040, .052]: B -> B2.
    got = times(result)
    assert got[0] == pytest.approx((0.014, 0.040, 3))
    assert got[1] == pytest.approx((0.040 - 0.015, 0.052 - 0.015, 2))
    assert result.end_time == pytest.approx(0.052)
    assert sum(r.scheduler.stats.num_steps for r in result.replicas) == 4


def test_timeline_with_a_gap_and_an_arrival_at_the_step_boundary():
    # 1 ms between steps: tokens come out and the next step starts 1 ms after a step ends.
    model = LinearStepModel(0.010, {"prefill_tokens": 0.001, "decode_tokens": 0.002},
                            gap_intercept=0.001)
    requests = [SimRequest(0, 0.0, 4, 3), SimRequest(1, 0.015, 2, 2)]
    got = times(fleet_of(tiny_spec(), model).run(requests))
    # [0, .014] A1 out at .015; B arrives at .015 and joins the step that starts then:
    # [.015, .029] A decode + B prompt -> A2, B1 at .030; [.030, .044] both decode -> .045.
    assert got[0] == pytest.approx((0.015, 0.045, 3))
    assert got[1] == pytest.approx((0.015, 0.030, 2))


def test_front_end_delays_each_arrival_and_counts_in_its_latencies():
    # The hand-computed timeline above with 5 ms of front end: A reaches the engine at
    # .005, B at .020. [.005, .019] A's prompt -> A1; [.019, .031] A decode -> A2 (B joins
    # the queue at .020); [.031, .045] A decode + B's prompt -> A3, B1; [.045, .057] B2.
    model = LinearStepModel(0.010, {"prefill_tokens": 0.001, "decode_tokens": 0.002})
    requests = [SimRequest(0, 0.0, 4, 3), SimRequest(1, 0.015, 2, 2)]
    clock = SimClock()
    fleet = Fleet([Replica(0, tiny_spec(), model, clock)], RoundRobinRouter(), clock,
                  PromptMaker(8), front_end_s=0.005)
    got = times(fleet.run(requests))
    assert got[0] == pytest.approx((0.019, 0.045, 3))
    assert got[1] == pytest.approx((0.045 - 0.015, 0.057 - 0.015, 2))


def test_front_end_ms_reaches_the_fleet_through_the_config(trace_csv):
    base = simulate(SimConfig(trace=trace_csv, step_model="roofline", hardware="a100"))
    later = simulate(SimConfig(trace=trace_csv, step_model="roofline", hardware="a100",
                               front_end_ms=40.0))
    assert later["ttft_ms"]["median"] == pytest.approx(base["ttft_ms"]["median"] + 40.0,
                                                       abs=1.0)
    assert later["tpot_ms"]["median"] == pytest.approx(base["tpot_ms"]["median"], rel=0.05)
    with pytest.raises(ValueError, match="front_end_ms"):
        SimConfig(trace=trace_csv, front_end_ms=-1.0)


def test_chunked_prompt_and_memory_preemption_follow_the_scheduler():
    # A 10-token prompt with an 8-token budget takes two steps (chunked prefill);
    # 4 blocks of 4 tokens cannot hold two requests of 10 + 6 tokens: one is preempted
    # (admitted on free blocks alone; the default headroom would keep the second waiting).
    model = LinearStepModel(0.010, {"prefill_tokens": 0.001, "decode_tokens": 0.001})
    spec = tiny_spec(budget=8, blocks=5, scheduler=NO_LOOKAHEAD)
    requests = [SimRequest(0, 0.0, 10, 6), SimRequest(1, 0.0, 9, 6)]
    result = fleet_of(spec, model).run(requests)
    assert all(r.error is None and r.num_tokens == 6 for r in result.records)
    stats = result.replicas[0].scheduler.stats
    assert stats.num_preemptions >= 1
    assert result.replicas[0].scheduler.kv.pool.num_free_blocks == 5  # every block back


def test_the_scheduler_is_the_production_one(monkeypatch, trace_csv):
    calls = []
    original = scheduler_module.Scheduler.schedule

    def counting(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(scheduler_module.Scheduler, "schedule", counting)
    setup = build(SimConfig(trace=trace_csv, replicas=2))
    result = run(setup)
    for replica in result.replicas:
        assert type(replica.scheduler) is scheduler_module.Scheduler
        assert type(replica.scheduler.kv).__module__ == "treadle.core.kv.manager"
    steps = sum(r.scheduler.stats.num_steps for r in result.replicas)
    assert steps > 0 and len(calls) >= steps
    assert {id(s) for s in calls} == {id(r.scheduler) for r in result.replicas}


def test_admission_check_is_the_engines(trace_csv):
    config = SimConfig(trace=trace_csv, max_model_len=64)
    setup = build(config, {})
    setup.requests[0].prompt_len, setup.requests[0].output_len = 60, 10  # 70 > 64
    result = run(setup)
    assert "exceeds the model's context length of 64 tokens" in result.records[0].error
    assert all(r.error is None for r in result.records[1:])


def _figures(summary):
    drop = {"simulation", "timeseries"}
    return json.dumps({k: v for k, v in summary.items() if k not in drop}, sort_keys=True)


def test_same_seed_same_output_and_prompts_follow_the_seed(trace_csv):
    config = SimConfig(trace=trace_csv, replicas=2, routing="least-load", prefix_groups=3,
                       prefix_len=48, priority_mix=0.3, num_spec_tokens=2)
    options = {"scheduling_policy": "priority", "max_num_batched_tokens": 64}
    a, b = simulate(config, options), simulate(config, options)
    assert _figures(a) == _figures(b)
    assert a["timeseries"] == b["timeseries"]
    hits = sum(r["prefix_cache_hit_tokens"] for r in a["simulation"]["replicas"])
    assert hits > 0  # the shared prefixes reach the production prefix cache
    other = simulate(SimConfig(**{**config.__dict__, "seed": 1}), options)
    assert _figures(other) != _figures(a)


def test_prompt_maker_structure():
    maker = PromptMaker(100, prefix_groups=2, prefix_len=20, prefix_fraction=1.0, seed=3)
    p = [maker.prompt(SimRequest(i, 0.0, 40, 1)) for i in range(100)]
    assert all(len(x) == 40 and max(x) < 256 for x in p)
    groups = [maker.group(i) for i in range(100)]
    for i in range(100):
        for j in range(100):
            if groups[i] == groups[j]:
                assert p[i][:20] == p[j][:20]
            if i != j:
                assert p[i][20:28] != p[j][20:28]  # the marker: no block shared past it
    short = maker.prompt(SimRequest(5, 0.0, 3, 1))
    assert len(short) == 3


def test_rate_scale_superposes_copies():
    base = [SimRequest(i, float(i), 10, 2) for i in range(10)]
    scaled = scale_rate(base, 3)
    assert len(scaled) == 30 and [r.index for r in scaled] == list(range(30))
    assert scaled[-1].arrival <= 9.0 + 1.0  # same duration, three times the rate
    assert len(scale_rate(base, 2.5, seed=1)) in range(20, 31)


def test_disaggregated_prefill_decode(trace_csv):
    setup = build(SimConfig(trace=trace_csv, prefill_replicas=1, decode_replicas=2,
                            num_requests=30), {"block_size": 16})
    result = run(setup)
    assert all(r.error is None and r.num_tokens == r.request.output_len for r in result.records)
    prefill, *decode = result.replicas
    assert prefill.role == "prefill" and all(d.role == "decode" for d in decode)
    multi = [r for r in result.records if r.request.output_len > 1]
    assert sum(d.num_kv_received for d in decode) == len(multi)
    # the transferred blocks are prefix hits on the decode side: every full prompt block
    hit = sum(d.scheduler.kv.prefix_stats.num_hit_tokens for d in decode)
    assert hit == sum(r.request.prompt_len // 16 * 16 for r in multi)
    assert all(r.transfer_s > 0 for r in multi)


def test_speculative_acceptance_as_a_rate(trace_csv):
    def steps(**kw):
        setup = build(SimConfig(trace=trace_csv, num_requests=20, **kw))
        result = run(setup)
        assert all(r.num_tokens == r.request.output_len for r in result.records)
        return result
    plain = steps()
    always = steps(num_spec_tokens=3, spec_acceptance_rate=1.0)
    never = steps(num_spec_tokens=3, spec_acceptance_rate=0.0)
    n = lambda res: sum(r.scheduler.stats.num_steps for r in res.replicas)  # noqa: E731
    assert n(always) < n(plain) == n(never)
    assert sum(r.runner.num_accepted for r in never.replicas) == 0
    assert sum(r.runner.num_accepted for r in always.replicas) > 0


def _prefix_router(balance_abs, hits):
    """The production prefix router (treadle/router), having sent `hits[i]` tokens of the
    prompt [3] * 80 to replica i before."""
    router = PrefixAwareRouter(PrefixRouterOptions(chunk_size=16, balance_abs=balance_abs))
    for replica, tokens in hits.items():
        router.tree(replica).insert(chunk_hashes([3] * tokens, 16, None), 0.0)
    return router


def test_routers():
    # The fleet's routers are the production ones; it shows them each replica as a
    # ReplicaLoad (index, healthy, unfinished requests, waiting, KV usage).
    prompt = [3] * 80
    views = [ReplicaLoad(0, True, 5), ReplicaLoad(1, True, 2), ReplicaLoad(2, True, 2),
             ReplicaLoad(3, True, 30)]
    rr = RoundRobinRouter()
    assert [rr.route(prompt, None, views, 0.0).replica for _ in range(5)] == [0, 1, 2, 3, 0]
    assert LeastLoadRouter().route(prompt, None, views, 0.0).replica == 1
    # the longest hit, unless that replica is far busier than the least loaded
    hits = {2: 32, 3: 64}
    assert _prefix_router(8, hits).route(prompt, None, views, 1.0).replica == 2
    assert _prefix_router(40, hits).route(prompt, None, views, 1.0).replica == 3
    assert len(chunk_hashes([3] * 40, 16, None)) == 2  # 40 tokens: 2 full blocks may hit
    # what the simulator builds for --routing: the router the server builds, sized to a
    # replica's KV cache and block size
    spec = tiny_spec(block_size=4, blocks=64)
    router = fleet_router(SimConfig(routing="prefix"), spec)
    assert type(router) is PrefixAwareRouter
    assert (router.options.chunk_size, router.options.capacity_tokens) == (4, 256)
    assert type(fleet_router(SimConfig(routing="least-load"), spec)) is LeastLoadRouter


def test_cli_result_has_the_bench_serve_shape(trace_csv, tmp_path):
    from treadle.measure.http_load import RequestResult, summarize
    from treadle.cli import main

    out = tmp_path / "out"
    assert main(["simulate", "--trace", trace_csv, "--replicas", "2", "--output", str(out),
                 "--slo-ttft-ms", "500", "--max-num-batched-tokens", "256"]) == 0
    result = json.loads((out / "simulate.json").read_text())
    shape = summarize([RequestResult(True, 0.0, 1, 2, 0.1, 0.2)], 1.0)
    assert set(shape) <= set(result)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[key]) == set(shape[key])
    assert len(result["requests"]) == 80 and result["num_ok"] == 80
    assert result["simulation"]["replica"]["scheduler"]["max_num_batched_tokens"] == 256
    assert (out / "latency.png").stat().st_size > 0 and (out / "timeseries.png").exists()
    assert main(["simulate", "compare", str(out / "simulate.json"),
                 str(out / "simulate.json")]) == 0


def test_bad_options_are_clear_errors(trace_csv):
    with pytest.raises(ValueError, match="routing"):
        SimConfig(routing="random")
    with pytest.raises(ValueError, match="prefill_replicas and decode_replicas"):
        SimConfig(prefill_replicas=2)
    with pytest.raises(ValueError, match="unknown scheduler/cache option"):
        build(SimConfig(trace=trace_csv), {"max_num_seqz": 3})
    with pytest.raises(ValueError, match="hardware must be one of"):
        build(SimConfig(trace=trace_csv, hardware="tpu9"))


def test_mixed_priority_duration_sets_the_arrivals():
    from treadle.sim.simulate import load_requests

    short, _ = load_requests(SimConfig(workload="mixed-priority"), 2048)
    long, desc = load_requests(SimConfig(workload="mixed-priority", mixed_duration_s=160.0),
                               2048)
    assert max(r.arrival for r in short) < 40.0 <= max(r.arrival for r in long) < 160.0
    assert 3 * len(short) < len(long) < 5 * len(short)
    assert {r.priority for r in long} == {0, 1} and desc["mixed_duration_s"] == 160.0
    with pytest.raises(ValueError, match="mixed_duration_s must be > 0"):
        SimConfig(workload="mixed-priority", mixed_duration_s=0.0)


def test_simulator_imports_without_torch():
    from test_core_is_torch_free import _BLOCK_TORCH

    modules = ["treadle.sim." + m for m in ("config", "clock", "step_model", "fit", "hardware",
                                           "roofline", "workload", "runner", "replica",
                                           "fleet", "results", "simulate", "sizing")]
    modules.append("treadle.cli.simulate")  # the command (treadle/cli/simulate.py)
    result = subprocess.run([sys.executable, "-c", _BLOCK_TORCH, *modules],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


SLOW_GPU = """name: slow
peak_flops: 1.0e13
memory_bandwidth: 2.0e11
memory_bytes: 16.0e9
step_overhead: 1.0e-3
network_bandwidth: 1.0e10
"""


def test_size_finds_the_smallest_fleet_and_its_predecessor_fails(tmp_path):
    from treadle.sim.config import SizingConfig
    from treadle.sim.sizing import judge, search

    hw = tmp_path / "slow.yaml"
    hw.write_text(SLOW_GPU)
    csv = write_csv(tmp_path / "busy.csv",
                    [(0.005 * i, 300 + 17 * (i % 13), 5 + i % 7) for i in range(300)])
    config = SimConfig(trace=csv, hardware=str(hw), model_shape="smollm2-135m")
    sizing = SizingConfig(target_ttft_p99_ms=100, target_tpot_p99_ms=20,
                          search_modes="colocated,disaggregated", max_replicas=8)
    result = search(sizing, config, {})
    colocated, disaggregated = result["candidates"]
    n = colocated["replicas"]
    assert n is not None and n > 1
    by_n = {e["replicas"]: e for e in result["evaluations"] if e["mode"] == "colocated"}
    assert by_n[n]["meets"] and not by_n[n - 1]["meets"]
    assert colocated["ttft_p99_ms"] <= 100 and colocated["tpot_p99_ms"] <= 20
    assert disaggregated["prefill"] >= 1 and disaggregated["decode"] >= 1
    assert result["best"]["devices"] == min(c["devices"] for c in result["candidates"])
    # the SLO monitor only cuts short runs that fail anyway
    import dataclasses
    full = judge(run(build(dataclasses.replace(config, replicas=n - 1))), sizing)
    assert by_n[n - 1]["stopped_early"] and not full["meets"]
