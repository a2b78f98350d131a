"""The soak's traffic and figures, without a server."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treadle.bench.soak import (Outcome, SoakConfig, make_requests, overload_figures,
                                parse_metrics, server_figures, summarize)


def test_requests_are_deterministic_and_follow_the_mix():
    config = SoakConfig(rate=20.0, duration_s=60.0, disconnect_fraction=0.25, seed=4,
                        prompt_len=(10, 300), output_len=(5, 100))
    a, b = make_requests(config, 1000, 2), make_requests(config, 1000, 2)
    assert a == b and a != make_requests(SoakConfig(rate=20.0, duration_s=60.0, seed=5),
                                         1000, 2)
    assert len(a) == pytest.approx(20 * 60, rel=0.1)
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 60
    assert np.mean(np.diff(arrivals)) == pytest.approx(1 / 20, rel=0.1)
    shares = {p: sum(r.priority == p for r in a) / len(a) for p in (-5, 0, 5)}
    assert shares[0] == pytest.approx(0.6, abs=0.05) and shares[5] == pytest.approx(0.2, abs=0.05)
    assert sum(r.disconnect_after is not None for r in a) / len(a) == pytest.approx(0.25, abs=0.05)
    assert all(1 <= r.disconnect_after <= r.max_tokens for r in a if r.disconnect_after)
    assert {r.tenant for r in a} == {0, 1}
    assert all(3 <= t < 1000 for r in a for t in r.prompt_token_ids)
    capped = make_requests(config, 1000, 1, max_model_len=64)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 64 for r in capped)


def test_bad_configs_are_refused():
    for kw in ({"rate": 0}, {"disconnect_fraction": 1.5}, {"priorities": (1, 2)},
               {"prompt_len": (5, 2)}, {"max_in_flight": 0}):
        with pytest.raises(ValueError):
            SoakConfig(**kw)


METRICS = """\
# TYPE treadle:num_requests_running gauge
treadle:num_requests_running{model_name="m"} 3.0
treadle:num_requests_waiting{model_name="m"} 0.0
treadle:kv_cache_usage_perc{model_name="m"} 0.5
# TYPE treadle:num_preemptions counter
treadle:num_preemptions_total{model_name="m"} 12.0
treadle:num_admission_preemptions_total{model_name="m"} 3.0
# TYPE treadle:request_success counter
treadle:request_success_total{model_name="m",finished_reason="length"} 7.0
treadle:request_success_total{model_name="m",finished_reason="abort"} 3.0
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.048576e+08
"""


def test_metrics_figures():
    figures = server_figures(parse_metrics(METRICS))
    assert figures["running"] == 3 and figures["waiting"] == 0  # a zero is a figure
    assert figures["preemptions"] == 12 and figures["requests_ended"] == 10
    assert figures["rss_mib"] == 100 and figures["kv_usage"] == 0.5
    assert figures["swapped"] is None and figures["preemption_tax_s"] is None


def test_summary_goodput_and_per_priority():
    config = SoakConfig(timeout_s=10.0, duration_s=5.0, priorities=(0, 5),
                        priority_weights=(0.5, 0.5))
    requests = make_requests(SoakConfig(rate=2.0, duration_s=5.0, seed=1,
                                        disconnect_fraction=0.0), 100, 1)[:4]
    outcomes = [Outcome(requests[0], "finished", ttft=1.0, e2e=4.0),
                Outcome(requests[1], "finished", ttft=2.0, e2e=9.0),
                Outcome(requests[2], "timed_out"),
                Outcome(requests[3], "shed", error="HTTP 429")]
    start = parse_metrics(METRICS)
    end = dict(start)
    end["treadle:num_preemptions_total"] = 20.0
    end["treadle:num_admission_preemptions_total"] = 5.0
    end['treadle:request_success_total{length}'] = 10.0
    end["treadle:request_success_total{abort}"] = 4.0
    s = summarize(outcomes, config, 20.0, start, end)
    assert s["goodput"]["num_good"] == 2 and s["goodput"]["fraction"] == 0.5
    assert s["goodput"]["requests_per_s"] == pytest.approx(0.1)
    assert s["server"]["preemptions"] == 8 and s["server"]["requests_ended"] == 4
    assert s["server"]["preemptions_per_request"] == 2.0
    assert s["server"]["num_started"] == 2 and s["server"]["preemptions_per_started_request"] == 4
    assert s["server"]["preemptions_admission"] == 2  # policy, not memory: 6 were memory's
    assert s["server"]["memory_preemptions_per_started_request"] == 3
    assert s["all"]["wait_s"]["median"] == pytest.approx(1.5)
    assert s["all"]["num_never_started"] == 1  # the timed-out one (the shed one never ran)
    assert s["timed_out"] == 1 and s["shed"] == 1 and s["error"] == 0
    per = s["per_priority"]
    assert sum(p["num_requests"] for p in per.values()) == sum(
        r.priority in (0, 5) for r in requests)
    assert math.isnan(s["all"]["e2e_s"]["p99"]) is False


def test_overload_figures_accepted_that_timed_out_and_how_fast_refusals_came():
    requests = make_requests(SoakConfig(rate=2.0, duration_s=5.0, seed=1,
                                        disconnect_fraction=0.0), 100, 1)[:5]
    outcomes = [Outcome(requests[0], "finished", ttft=1.0, e2e=4.0, accepted=True),
                Outcome(requests[1], "timed_out", accepted=True),
                Outcome(requests[2], "timed_out"),  # never answered: not accepted
                Outcome(requests[3], "shed", error="HTTP 503: b''", refused_in=0.02),
                Outcome(requests[4], "shed", error="HTTP 429: b''", refused_in=0.04)]
    figures = overload_figures(outcomes)
    assert figures["accepted"] == 2 and figures["accepted_timed_out"] == 1
    assert figures["accepted_timed_out_fraction"] == 0.5
    assert figures["refused_503"] == 1 and figures["refused_429"] == 1
    assert figures["refused_in_s"]["median"] == pytest.approx(0.03)
