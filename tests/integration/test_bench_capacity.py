"""`treadle bench capacity` (issue 50, item 6): the search for the highest rate meeting the
p99 TTFT and TBT targets, the probe's verdict, and one search on a tiny model over HTTP
(the real runs are benchmarks: docs/benchmarks.md)."""

from __future__ import annotations

import math

import pytest

from server_fixtures import running_server
from treadle.bench.capacity import (SLO, Probe, Prober, TraceLoad, common_goodput_rate, judge,
                                    search_capacity, table_rows)
from treadle.measure.http_load import RequestResult
from treadle.models.demo import write_demo_model


def fake_probe(capacity: float, seen: list):
    def probe(rate: float) -> Probe:
        seen.append(rate)
        return Probe(rate, 10, 0, 0.1, 0.01, rate, rate <= capacity, 1.0)
    return probe


def test_doubling_then_bisection_finds_the_capacity_within_the_bracket():
    seen: list[float] = []
    search = search_capacity(fake_probe(3.3, seen), start_rps=0.5)
    assert seen == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert search.capacity_rps == 3.25 and len(search.probes) == 7
    seen.clear()
    # the start misses: halve until a rate meets, then bisect
    search = search_capacity(fake_probe(0.1, seen), 0.5, max_doublings=3, bisections=2)
    assert seen == [0.5, 0.25, 0.125, 0.0625, 0.09375, 0.109375]
    assert search.capacity_rps == 0.09375
    seen.clear()  # nothing meets: 0
    assert search_capacity(fake_probe(0.01, seen), 0.5, max_doublings=2).capacity_rps == 0.0
    assert seen == [0.5, 0.25, 0.125]
    seen.clear()  # never misses: the last rate probed is a lower bound
    assert search_capacity(fake_probe(100, seen), 1.0, max_doublings=2).capacity_rps == 4.0


def test_goodput_is_measured_at_the_factor_times_the_capacity_even_below_the_start():
    """A search whose start rate already missed (capacity 1.49, start 4.77 req/s on a
    machine with slow prefill) measures goodput at 1.5 x 1.49, not 1.5 x 4.77; only a
    capacity of 0 falls back to the start rate."""
    assert common_goodput_rate(1.5, 1.49, 4.77) == pytest.approx(2.235)
    assert common_goodput_rate(1.5, 6.0, 4.0) == pytest.approx(9.0)
    assert common_goodput_rate(1.5, 0.0, 4.0) == pytest.approx(6.0)


def test_a_failed_request_misses_both_targets_and_goodput_counts_each_request():
    slo = SLO(ttft_s=1.0, tbt_s=0.1)
    ok = [RequestResult(True, 0.0, 5, 3, ttft=0.5, itls=[0.05, 0.05]) for _ in range(98)]
    slow = RequestResult(True, 0.0, 5, 3, ttft=0.5, itls=[0.05, 0.5])
    probe = judge(ok + [slow], 1.0, 10.0, slo)
    assert probe.meets and probe.goodput_rps == pytest.approx(9.8)  # the slow one missed
    failed = RequestResult(False, 0.0, 5, error="timed out")
    probe = judge(ok + [failed, failed], 1.0, 10.0, slo)
    assert probe.num_failed == 2 and probe.ttft_p99_s == math.inf and not probe.meets
    # one failure among 12: the p99 falls between a finite TTFT and the failure's
    probe = judge(ok[:11] + [failed], 1.0, 10.0, slo)
    assert probe.ttft_p99_s == math.inf and probe.tbt_p99_s == math.inf


def test_a_search_on_a_tiny_model_over_http(tmp_path):
    model = write_demo_model(tmp_path / "m", seed=5, config_overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2))
    load = TraceLoad(probe_s=2.0, min_requests=6, token_scale=0.02, max_model_len=256,
                     timeout_s=60)
    with running_server(str(model), "--num-kv-blocks", "64") as (base, _):
        easy = Prober(base, load, SLO(ttft_s=60.0, tbt_s=10.0), log=lambda _: None)
        search = search_capacity(easy, start_rps=2.0, max_doublings=1, bisections=0)
        assert [p.rate for p in search.probes] == [2.0, 4.0] and search.capacity_rps == 4.0
        assert [(p.num_requests, p.num_failed) for p in search.probes] == [(6, 0), (8, 0)]
        strict = Prober(base, load, SLO(ttft_s=1e-6, tbt_s=1e-6), log=lambda _: None)
        assert search_capacity(strict, start_rps=2.0, max_doublings=1).capacity_rps == 0.0
    rows = table_rows({"systems": {"a": {"capacity_rps": 2.0, "goodput_rps": 1.0,
                                         "goodput_rate_rps": 3.0},
                                   "b": {"capacity_rps": 1.0, "goodput_rps": 0.5,
                                         "goodput_rate_rps": 3.0}}})
    assert [r["x first"] for r in rows] == [1.0, 0.5]


def test_the_cli_passes_the_search_bounds_and_refuses_negative_ones(monkeypatch, capsys):
    """A short run (docs/scheduling.md's command against vLLM) bounds the search."""
    import treadle.bench.capacity as capacity
    from treadle.cli import main

    seen = {}

    def fake_run(systems, load, slo, goodput_factor, max_doublings, bisections):
        seen.update(names=[s.name for s in systems], probe_s=load.probe_s,
                    max_doublings=max_doublings, bisections=bisections)
        return {"systems": {}}

    monkeypatch.setattr(capacity, "run_capacity", fake_run)
    monkeypatch.setattr("treadle.cli.bench_online.write_result", lambda *a: "out.json")
    assert main(["bench", "capacity", "--policies", "fcfs", "--probe-seconds", "10",
                 "--max-doublings", "4", "--bisections", "1"]) == 0
    assert seen == {"names": ["treadle fcfs chunk 512"], "probe_s": 10.0,
                    "max_doublings": 4, "bisections": 1}
    assert main(["bench", "capacity", "--bisections", "-1"]) == 2
    assert "--bisections must be >= 0" in capsys.readouterr().err


def test_bounds_beside_decodes_are_systems_of_their_own(monkeypatch):
    """`--decode-step-prefill-tokens=-1,0` measures the server without and with the auto
    bound in one run, each named by its bound and launched with it; a bound below -1 is
    refused before any server starts."""
    import treadle.bench.capacity as capacity
    from treadle.cli import main

    seen = []

    def fake_run(systems, load, slo, goodput_factor, max_doublings, bisections):
        seen.extend((s.name, s.start.args[0]) for s in systems)
        return {"systems": {}}

    monkeypatch.setattr(capacity, "run_capacity", fake_run)
    monkeypatch.setattr("treadle.cli.bench_online.write_result", lambda *a: "out.json")
    assert main(["bench", "capacity", "--policies", "fcfs,srpt",
                 "--decode-step-prefill-tokens=-1,0,96"]) == 0
    names = [name for name, _ in seen]
    assert names == [f"treadle {p} chunk 512 {b}" for b in
                     ("no bound", "auto bound", "96 beside decodes") for p in ("fcfs", "srpt")]
    for (name, options), bound in zip(seen, ["-1", "-1", "0", "0", "96", "96"]):
        assert options[options.index("--decode-step-prefill-tokens") + 1] == bound, name
    seen.clear()
    assert main(["bench", "capacity", "--policies", "fcfs"]) == 0
    assert seen == [("treadle fcfs chunk 512", ["--scheduling-policy", "fcfs",
                                                "--max-num-batched-tokens", "512"])]
    assert main(["bench", "capacity", "--decode-step-prefill-tokens", "-2"]) == 2
