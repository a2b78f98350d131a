"""Overload that says so, early (issue 50, item 4), through the HTTP app: a saturated
server answers 503 and a tenant over its own limits 429, each with Retry-After, decided
before tokenization, the chat template or grammar compilation (a request that would fail
there gets the overload answer, and the tokenizer is never called for it), each counted
by reason in treadle:request_rejections_total; the accepted requests finish."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server_fixtures import write_tiny_demo



@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("demo"))


def rejections(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("treadle:request_rejections_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_refusals_come_before_any_work_on_the_request(tiny_demo):
    from treadle.config import EngineConfig
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.api import build_app
    from treadle.server.auth import KeyRing, Tenant
    from treadle.server.config import ServerConfig

    engine = AsyncEngine(EngineConfig.from_options(model=tiny_demo, dtype="float32",
                                                   num_kv_blocks=64), "tiny")
    real_step, held = engine.core.step, threading.Event()
    held.set()
    engine.core.step = lambda: [] if held.is_set() else real_step()  # nothing starts
    engine.start()
    try:
        keys = {"ka": Tenant("a"), "kb": Tenant("b"), "kc": Tenant("c")}
        app = build_app(engine, ServerConfig(dashboard=False, request_timelines=0,
                                             max_waiting_requests=2,
                                             tenant_max_concurrent_requests=1),
                        KeyRing(keys))
        serving = app.state.serving
        work = []
        for name in ("encode", "chat_token_ids"):  # the tokenizer's two doors
            def counted(*args, _real=getattr(serving, name), _name=name):
                work.append(_name)
                return _real(*args)
            setattr(serving, name, counted)

        def as_(key):
            return {"Authorization": f"Bearer {key}"}

        bad_chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "x", "schema": {"type": "nonsense"}}}}

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=60) as client:
                body = {"prompt": "held", "max_tokens": 3, "ignore_eos": True}
                first = asyncio.ensure_future(client.post("/v1/completions", json=body,
                                                          headers=as_("ka")))
                second = asyncio.ensure_future(client.post("/v1/completions", json=body,
                                                           headers=as_("kb")))
                while serving.admission.num_waiting < 2 or len(work) < 2:
                    await asyncio.sleep(0.01)
                work.clear()
                # tenant a is over its own limit: 429, its bad grammar never compiled
                tenant = await client.post("/v1/chat/completions", json=bad_chat,
                                           headers=as_("ka"))
                # the server is full (2 waiting): 503 for tenant c, before tokenizing
                full = await client.post("/v1/completions", headers=as_("kc"), json={
                    "prompt": "x" * 200_000, "max_tokens": 3})
                refused_work = list(work)
                metrics = (await client.get("/metrics")).text
                held.clear()
                return tenant, full, refused_work, metrics, await first, await second

        tenant, full, refused_work, metrics, first, second = asyncio.run(main())
        assert tenant.status_code == 429, tenant.text
        assert tenant.json()["error"]["type"] == "rate_limit_error"
        assert "tenant_max_concurrent_requests" in tenant.json()["error"]["message"]
        assert int(tenant.headers["retry-after"]) >= 1
        assert full.status_code == 503, full.text
        assert "max_waiting_requests=2" in full.json()["error"]["message"]
        assert int(full.headers["retry-after"]) >= 1
        assert refused_work == []  # neither was tokenized nor templated
        assert not serving.grammars.started  # nor was any grammar compiled
        assert rejections(metrics) == {"tenant_concurrency": 1.0, "queue_requests": 1.0}
        assert first.status_code == 200 and second.status_code == 200
        assert serving.admission.num_waiting == 0 and not serving.admission._tickets
    finally:
        engine.shutdown()


def test_the_wait_bound_refuses_at_once_and_what_it_accepts_finishes(tiny_demo):
    """A burst far beyond what the engine can start within max_queue_delay: the refusals
    come back at once (503, Retry-After), and every accepted request finishes."""
    from treadle.config import EngineConfig
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.api import build_app
    from treadle.server.auth import KeyRing
    from treadle.server.config import ServerConfig

    engine = AsyncEngine(EngineConfig.from_options(model=tiny_demo, dtype="float32",
                                                   num_kv_blocks=64, max_num_seqs=2), "tiny")
    engine.start()
    try:
        app = build_app(engine, ServerConfig(dashboard=False, request_timelines=0,
                                             max_queue_delay=1.0), KeyRing({}))

        async def one(client, k):
            start = time.monotonic()
            r = await client.post("/v1/completions", json={
                "prompt": [7 + k % 50] * 8, "max_tokens": 100, "ignore_eos": True})
            return r, time.monotonic() - start

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=120) as client:
                await one(client, 0)  # the step time is measured from here on
                results = []
                for k in range(60):  # arrivals faster than 2 slots of 100 tokens drain
                    results.append(asyncio.ensure_future(one(client, k)))
                    await asyncio.sleep(0.005)
                done = await asyncio.gather(*results)
                return done, (await client.get("/metrics")).text

        done, metrics = asyncio.run(main())
        codes = [r.status_code for r, _ in done]
        assert set(codes) == {200, 503}, codes
        refused = [t for r, t in done if r.status_code == 503]
        accepted = [t for r, t in done if r.status_code == 200]
        assert all(int(r.headers["retry-after"]) >= 1 for r, _ in done if r.status_code == 503)
        assert max(refused) < min(accepted)  # refused at once, not after queueing
        assert rejections(metrics)["queue_delay"] == len(refused)
    finally:
        engine.shutdown()
