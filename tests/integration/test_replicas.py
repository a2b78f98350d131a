"""Engine replicas on a local Ray cluster (2 CPUs, a tiny model): the same greedy outputs as
one engine, the OpenAI front end over them (streaming, disconnects, 429s, /metrics by
replica), and a replica killed mid-stream (its requests get an error event, the others
finish, it comes back)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from replica_fixtures import OPTIONS, serving, tiny_model  # noqa: E402
from treadle.config import EngineConfig  # noqa: E402
from treadle.distributed.config import ReplicaConfig  # noqa: E402
from treadle.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def replica_set(tiny, ray_cluster):
    from treadle.distributed.replica_set import ReplicaSet

    # two sequences at a time per replica: a third one waits there (the fault test)
    replicas = ReplicaSet(EngineConfig.from_options(model=tiny, max_num_seqs=2, **OPTIONS),
                          ReplicaConfig(replicas=2, routing="round-robin"), "tiny")
    yield replicas
    replicas.shutdown()


@pytest.fixture(scope="module")
def server(replica_set):
    with serving(replica_set) as base:
        yield base


def metric(base: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics").text.splitlines():
        key = line.split(" ")[0]
        if key.split("{")[0] in (f"treadle:{name}", f"treadle:{name}_total") and labels in key:
            total += float(line.rsplit(" ", 1)[1])
    return total


PROMPTS = [[5, 6, 7, 8 + i, 9] * (i + 1) for i in range(6)]


def test_greedy_outputs_through_two_replicas_equal_one_engine(tiny, replica_set):
    from treadle import LLM

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def through_replicas():
        async def one(i):
            last = None
            async for out in replica_set.generate(f"eq-{i}", None, PROMPTS[i], params):
                last = out
            assert last.prompt_token_ids == PROMPTS[i]
            return last.outputs[0].token_ids
        return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])

    routed_before = [replica_set.front_metrics.routed.labels("tiny", str(i), "round-robin")
                     ._value.get() for i in range(2)]
    got = asyncio.run(through_replicas())
    llm = LLM(model=tiny, **OPTIONS)
    want = [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    del llm
    assert got == want
    routed = [replica_set.front_metrics.routed.labels("tiny", str(i), "round-robin")
              ._value.get() - routed_before[i] for i in range(2)]
    assert routed == [3, 3]
    assert replica_set.config.model.num_threads == 1


def sse_events(response) -> list:
    return [json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_front_end_streams_aborts_and_labels_metrics(server, replica_set):
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    whole = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        streamed = "".join(e["choices"][0]["text"] for e in sse_events(r) if e["choices"])
    assert streamed == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 16

    text = httpx.get(server + "/metrics").text
    for replica in ("0", "1"):
        assert f'treadle:generation_tokens_total{{model_name="tiny",replica="{replica}"}}' \
            in text
    assert 'treadle:replica_healthy{model_name="tiny",replica="1"} 1.0' in text

    aborted_before = metric(server, "request_success", 'finished_reason="abort"')

    async def vanish(client):
        async with client.stream("POST", server + "/v1/completions", json={
                **body, "max_tokens": 400, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # leave mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*[vanish(client) for _ in range(4)])

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
            replica_set.num_in_flight or metric(server, "num_requests_running")
            or metric(server, "request_success", 'finished_reason="abort"') - aborted_before < 4):
        time.sleep(0.1)
    assert metric(server, "request_success", 'finished_reason="abort"') - aborted_before == 4
    assert replica_set.num_in_flight == 0
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "kv_cache_usage_perc") == 0


def test_tenant_bound_gets_429_across_replicas(replica_set):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    with serving(replica_set, tenant_tokens_per_minute=300) as base:
        first = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        second = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["type"] == "rate_limit_error"
        assert "Retry-After" in second.headers


def test_killed_replica_errors_its_streams_only_and_rejoins(server, replica_set):
    """Six streams, three per replica, two running and one waiting on each: replica 0 is
    killed once the four running ones have sent tokens. Its two running streams end with
    an error event; its waiting one (no token sent) is retried on replica 1 and finishes,
    as do replica 1's; it is out of routing at once, restarts and takes requests again."""
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    retried_before = metric(server, "replica_retried_requests", 'replica="0"')

    async def stream(client, ready):
        events = []
        async with client.stream("POST", server + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    ready.release()
        return events

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            ready = asyncio.Semaphore(0)
            tasks = [asyncio.ensure_future(stream(client, ready)) for _ in range(6)]
            for _ in range(4):  # the four running streams sent a token
                await ready.acquire()
            marks["killed"] = time.monotonic()
            ray.kill(replica_set.actor(0), no_restart=False)
            watcher.start()
            return await asyncio.gather(*tasks)

    marks = {}

    def watch():  # when the restarted replica is back in routing
        deadline = marks["killed"] + 120
        while replica_set.replicas[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        while not replica_set.replicas[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        marks["back"] = time.monotonic()

    watcher = threading.Thread(target=watch, daemon=True)
    results = asyncio.run(main())
    errored = [events for events in results if "error" in events[-1]]
    finished = [events for events in results if "error" not in events[-1]]
    assert len(errored) == 2 and len(finished) == 4
    for events in errored:
        assert "replica 0 died" in events[-1]["error"]["message"]
    for events in finished:
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert metric(server, "replica_retried_requests", 'replica="0"') - retried_before == 1
    assert not replica_set.replicas[0].healthy  # out of routing at once
    ok = httpx.post(server + "/v1/completions", json={**body, "stream": False,
                                                      "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 120
    while not replica_set.replicas[0].healthy and time.monotonic() < deadline:
        time.sleep(0.2)
    assert replica_set.replicas[0].healthy, "the restarted replica did not rejoin"
    watcher.join(10)
    print(f"\nfaults: of the killed replica's 3 streams, 2 with tokens sent errored, the 1 "
          f"without a token was retried on replica 1 and finished (0 lost); the replica was "
          f"back in routing {marks['back'] - marks['killed']:.1f} s after the kill")
    before = metric(server, "generation_tokens", 'replica="0"')
    for _ in range(2):  # round-robin: one of the two lands on the restarted replica
        r = httpx.post(server + "/v1/completions", json={**body, "stream": False,
                                                         "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
    assert metric(server, "generation_tokens", 'replica="0"') - before == 4
