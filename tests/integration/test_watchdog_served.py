"""Never "healthy but stuck" (issue 50, item 2): an engine that holds work and makes no
step turns GET /ready to 503 with the reason within `stall_timeout`, counts the stall and
logs what its scheduler held, while GET /health (liveness) stays 200; when steps resume,
so does readiness, and the request that waited finishes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_fixtures import running_server, write_tiny_demo



@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("demo"))


def stalls(metrics_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith("treadle:engine_stalls_total{"))


def test_a_scheduler_that_schedules_nothing_is_not_ready_while_health_stays_200(
        tiny_demo, caplog):
    """vllm #45414: running 0, waiting 6, 0 tok/s for nine minutes while its health probe
    said 200. Here the scheduler is made to schedule nothing while requests wait."""
    from treadle.config import EngineConfig
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.api import build_app
    from treadle.server.auth import KeyRing
    from treadle.server.config import ServerConfig

    engine = AsyncEngine(EngineConfig.from_options(model=tiny_demo, dtype="float32",
                                                   num_kv_blocks=64, stall_timeout=0.5),
                         "tiny")
    real_step = engine.core.step
    stuck = threading.Event()
    stuck.set()

    def step():
        if stuck.is_set():
            time.sleep(0.005)  # what a scheduler that admits nothing returns: no step
            return []
        return real_step()

    engine.core.step = step
    engine.start()
    try:
        app = build_app(engine, ServerConfig(dashboard=False, request_timelines=0),
                        KeyRing({}))

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=60) as client:
                assert (await client.get("/ready")).status_code == 200
                pending = [asyncio.ensure_future(client.post("/v1/completions", json={
                    "prompt": [5 + k] * 8, "max_tokens": 4, "ignore_eos": True}))
                    for k in range(6)]
                deadline = time.monotonic() + 30
                while (ready := await client.get("/ready")).status_code == 200:
                    assert time.monotonic() < deadline, "never reported the stall"
                    await asyncio.sleep(0.05)
                health = await client.get("/health")
                refused = await client.post("/v1/completions", json={"prompt": "x",
                                                                      "max_tokens": 2})
                metrics = (await client.get("/metrics")).text
                stuck.clear()  # the scheduler schedules again
                answers = await asyncio.gather(*pending)
                # the watchdog's thread sees the steps resume at its next sample
                deadline = time.monotonic() + 10
                while (after := await client.get("/ready")).status_code != 200:
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                return ready, health, refused, metrics, answers, after

        with caplog.at_level(logging.ERROR, logger="treadle.engine.watchdog"):
            ready, health, refused, metrics, answers, after = asyncio.run(main())
        assert ready.status_code == 503
        assert "no step for" in ready.json()["error"]["message"]
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        # new work is refused at once while stalled, with the reason and a retry hint
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert 'reason="engine_stalled"' in metrics and stalls(metrics) == 1
        line = next(r.message for r in caplog.records if "stalled" in r.message)
        assert "waiting [" in line and "(waiting, 0/8 tokens" in line and "KV usage" in line
        assert [a.status_code for a in answers] == [200] * 6  # nothing was lost
        assert after.status_code == 200
    finally:
        engine.shutdown()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_stopped_mp_worker_turns_ready_503_within_the_stall_timeout(tiny_demo):
    """The worker of the mp executor stopped with SIGSTOP: /health stayed 200 for the
    whole 300 s worker timeout while no token came. /ready must turn 503 within the stall
    timeout (here 2 s), and back to 200 once the worker runs again."""
    stall_timeout = 2.0
    with running_server(tiny_demo, "--num-kv-blocks", "64", "--distributed-executor-backend",
                        "mp", "--stall-timeout", str(stall_timeout)) as (base, proc):
        [worker] = _children(proc.pid)
        tokens: list[str] = []
        done = threading.Event()

        def stream():
            with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
                    "prompt": "stop the worker", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        tokens.append(line[6:])
            done.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        try:
            while len(tokens) < 3:
                assert not done.is_set(), tokens
                time.sleep(0.01)
            os.kill(worker, signal.SIGSTOP)
            stopped = time.monotonic()
            while httpx.get(base + "/ready", timeout=10).status_code == 200:
                assert time.monotonic() - stopped < stall_timeout + 8, "never not ready"
                time.sleep(0.1)
            noticed = time.monotonic() - stopped
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            assert stalls(httpx.get(base + "/metrics", timeout=10).text) == 1
        finally:
            os.kill(worker, signal.SIGCONT)
        client.join(60)
        assert done.is_set() and tokens[-1] == "[DONE]"
        assert not any('"error"' in t for t in tokens)  # the request finished as asked
        assert httpx.get(base + "/ready", timeout=10).status_code == 200
        assert stall_timeout <= noticed < stall_timeout + 8
        log = Path(proc.log_path).read_text()
        assert "engine stalled: no step for" in log and "running [" in log
