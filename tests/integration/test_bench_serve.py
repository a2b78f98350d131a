"""The load generator and its figures, against exact inputs and a stub server with
scripted timings."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from server_fixtures import free_port
from treadle.measure.http_load import (RequestResult, arrival_times, request_records, run_load,
                                 summarize)
from treadle.measure.workloads import Workload, WorkloadRequest

TTFT_S, GAP_S = 0.05, 0.02


def test_summarize_exact():
    results = [
        RequestResult(True, 0.0, 10, output_tokens=5, ttft=0.1, e2e=0.5, itls=[0.1] * 4),
        RequestResult(True, 0.0, 20, output_tokens=3, ttft=0.3, e2e=0.7, itls=[0.2, 0.2]),
        RequestResult(False, 0.0, 5, error="HTTP 429"),
    ]
    s = summarize(results, duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert s["num_ok"] == 2 and s["num_failed"] == 1 and s["errors"] == ["HTTP 429"]
    assert s["output_tokens_per_s"] == pytest.approx(8 / 2.0)
    assert s["total_tokens_per_s"] == pytest.approx(38 / 2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["ttft_ms"]["median"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 200) / 2)
    assert s["itl_ms"]["p99"] == pytest.approx(np.percentile([100] * 4 + [200, 200], 99))
    assert s["e2e_ms"]["p90"] == pytest.approx(np.percentile([500, 700], 90))
    # only the first meets TTFT <= 200 ms and TPOT <= 150 ms
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)
    rows = request_records(results)
    assert [r["ttft_s"] for r in rows] == [0.1, 0.3, None]
    assert rows[1]["tpot_s"] == pytest.approx(0.2) and rows[2]["error"] == "HTTP 429"
    assert json.loads(json.dumps(rows)) == rows  # plain JSON, written with the result


def test_arrival_times():
    assert arrival_times(3, None) == [0.0, 0.0, 0.0]
    times = arrival_times(4000, rate=20.0, burstiness=1.0, seed=1)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert np.mean(np.diff(times)) == pytest.approx(1 / 20, rel=0.05)
    bursty = np.diff(arrival_times(4000, rate=20.0, burstiness=0.25, seed=1))
    assert np.std(bursty) > 1.5 * np.std(np.diff(times))  # gamma shape < 1 is burstier
    with pytest.raises(ValueError):
        arrival_times(3, rate=-1)


@pytest.fixture(scope="module")
def stub_server():
    """An OpenAI-style SSE server: first token after 50 ms, then one every 20 ms."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = body["max_tokens"]

        async def events():
            await asyncio.sleep(TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP_S)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_load_generator_against_scripted_timings(stub_server):
    workload = Workload("stub", [WorkloadRequest([1, 2, 3], 6) for _ in range(8)], {})
    results, duration = asyncio.run(run_load(stub_server, workload, model="stub", rate=40.0,
                                             seed=3, progress=False))
    s = summarize(results, duration)
    assert s["num_ok"] == 8 and s["num_failed"] == 0
    assert all(r.output_tokens == 6 and len(r.itls) == 5 for r in results)
    # What holds on a loaded machine too: the server sleeps at least its scripted times,
    # so no figure can be below them (a small allowance for the clocks); a busy machine
    # only adds delay, so the upper bounds are loose. Each request's figures add up.
    clock = 0.002
    for r in results:
        assert r.ttft >= TTFT_S - clock
        assert r.e2e >= TTFT_S + 5 * GAP_S - clock
        # E2E also covers the usage chunk and [DONE] after the last token.
        assert r.ttft + sum(r.itls) <= r.e2e + 1e-6
        assert r.tpot >= sum(r.itls) / 5 - 1e-6
    assert s["ttft_ms"]["median"] < TTFT_S * 1000 + 1000
    assert GAP_S * 1000 / 2 < s["itl_ms"]["median"] < GAP_S * 1000 + 1000
    assert s["tpot_ms"]["median"] >= GAP_S * 1000 - clock * 1000
    starts = sorted(r.start for r in results)
    assert starts[-1] > 0.05  # arrivals were spread by the rate, not all at once


def test_failures_are_counted_not_raised():
    workload = Workload("dead", [WorkloadRequest([1], 2)], {})
    port = free_port()  # nothing listens there
    results, duration = asyncio.run(run_load(f"http://127.0.0.1:{port}", workload, "m",
                                             progress=False))
    s = summarize(results, duration)
    assert s["num_failed"] == 1 and "Connect" in s["errors"][0]
