"""The server driven as users drive it: the official openai client, raw HTTP for errors,
vanishing clients, overload, auth, fuzzing, and SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from server_fixtures import running_server, write_tiny_demo
from treadle.measure.scrape import metric_total


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def server(tiny_demo):
    # No wait bound: fifty 400-token streams at once predict a wait over the default 20 s
    # on a loaded machine, and these tests are about the API, not admission (the overload
    # tests below and tests/integration/test_overload.py run with the bound).
    with running_server(tiny_demo, "--num-kv-blocks", "256", "--max-queue-delay", "0") \
            as (base, proc):
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


# ----- the OpenAI client ----------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    spec = httpx.get(server + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                 "/detokenize", "/health", "/metrics"):
        assert path in spec["paths"]


def test_completion_and_usage(client):
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert isinstance(choice.text, str)


def test_streamed_text_equals_non_streamed(client):
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say something about the sea."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 15
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_n_and_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, n=3,
                                    temperature=1.0, seed=7, logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert out.usage.completion_tokens == 18
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt="Stop test", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[4:6] if len(text) >= 6 else None
    if not stop or not stop.strip():
        pytest.skip("generated text too short to pick a stop string")
    out = client.completions.create(model="tiny", prompt="Stop test", max_tokens=16,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[:text.index(stop)]


# ----- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, field", [
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 7}, 400, "temperature"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "stop": ["a"] * 40}, 400, "stop"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(400)}}, 400, "logit_bias"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [5, 99999999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
])
def test_bad_requests_name_the_field(server, body, status, field):
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field or field in error["message"]


def test_too_long_prompt_states_both_lengths(server):
    r = httpx.post(server + "/v1/completions",
                   json={"model": "tiny", "prompt": [5] * 500, "max_tokens": 100})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "500" in message and "512" in message


def test_body_size_limit(server):
    r = httpx.post(server + "/v1/completions", content=b"x" * (9 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_tokenize_roundtrip(server):
    ids = httpx.post(server + "/tokenize", json={"prompt": "héllo wörld 日本"}).json()["tokens"]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"] == \
        "héllo wörld 日本"


# ----- vanishing clients ------------------------------------------------------------------

def test_fifty_disconnects_abort_and_free_everything(server):
    async def vanish(client: httpx.AsyncClient):
        async with client.stream("POST", server + "/v1/completions", json={
                "model": "tiny", "prompt": "Tell me a long story", "max_tokens": 400,
                "stream": True, "ignore_eos": True}) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= 2:
                        return  # leave mid-stream

    async def behave(client: httpx.AsyncClient):
        r = await client.post(server + "/v1/completions", json={
            "model": "tiny", "prompt": "A patient client", "max_tokens": 30,
            "ignore_eos": True, "temperature": 0}, timeout=120)
        return r.json()

    aborted_before = metric_total(server, "request_success", 'finished_reason="abort"')

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            results = await asyncio.gather(behave(client), *[vanish(client) for _ in range(50)])
        return results[0]

    good = asyncio.run(main())
    assert good["choices"][0]["finish_reason"] == "length"
    assert good["usage"]["completion_tokens"] == 30
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (metric_total(server, "num_requests_running") == 0
                and metric_total(server, "kv_cache_usage_perc") == 0
                and metric_total(server, "request_success", 'finished_reason="abort"')
                - aborted_before >= 50):
            break
        time.sleep(0.2)
    assert metric_total(server, "request_success", 'finished_reason="abort"') - aborted_before == 50
    assert metric_total(server, "num_requests_running") == 0
    assert metric_total(server, "num_requests_waiting") == 0
    assert metric_total(server, "kv_cache_usage_perc") == 0


def test_metrics_exposition(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
                 "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
                 "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "batch_slot_efficiency"):
        assert f"treadle:{name}" in text, name
    assert metric_total(server, "generation_tokens") >= 3


# ----- auth, overload, fuzzing, shutdown (each on its own server) --------------------------

def test_auth_and_tenants(tiny_demo, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: alpha-key, tenant: alpha, weight: 2}\n"
                    "- {key: beta-key, tenant: beta}\n")
    with running_server(tiny_demo, "--num-kv-blocks", "64", "--api-key", "plain-key",
                        "--api-keys-file", str(keys)) as (base, _):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(base + "/v1/completions", json=body,
                         headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        for key in ("plain-key", "alpha-key", "beta-key"):
            ok = httpx.post(base + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/metrics").status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401


def test_overload_gets_503_quickly_and_accepted_finish(tiny_demo):
    # A saturated server is a 503 with Retry-After (429 is a tenant over its own limits:
    # issue 50 item 4; it was a 429 before).
    with running_server(tiny_demo, "--num-kv-blocks", "64", "--max-waiting-requests", "4",
                        "--max-num-seqs", "2") as (base, proc):
        async def one(client):
            start = time.monotonic()
            r = await client.post(base + "/v1/completions", json={
                "model": "tiny", "prompt": "overload", "max_tokens": 200, "ignore_eos": True})
            return r.status_code, time.monotonic() - start, r.headers.get("retry-after")

        async def main():
            async with httpx.AsyncClient(timeout=300,
                                         limits=httpx.Limits(max_connections=200)) as client:
                return await asyncio.gather(*[one(client) for _ in range(60)])

        results = asyncio.run(main())
        codes = [c for c, _, _ in results]
        assert set(codes) <= {200, 503}
        assert codes.count(503) >= 40 and codes.count(200) >= 4
        refused = [(t, ra) for c, t, ra in results if c == 503]
        assert all(ra is not None and int(ra) >= 1 for _, ra in refused)
        # Refused at once, not after queueing: every refusal came back before the first
        # accepted request (200 tokens) finished; this holds on a loaded machine too.
        accepted = [t for c, t, _ in results if c == 200]
        assert max(t for t, _ in refused) < min(accepted)
        assert httpx.get(base + "/health").status_code == 200


def test_sigterm_drains_then_aborts_and_exits_zero(tiny_demo):
    # The drain window (0.5 s) must outlive the late request's arrival (~0.1 s after the
    # signal) but not the long stream (~450 more tokens), so that something is aborted.
    with running_server(tiny_demo, "--num-kv-blocks", "128", "--shutdown-timeout", "0.5") \
            as (base, proc):
        events = []

        async def long_stream():
            async with httpx.AsyncClient(timeout=60) as client:
                async with client.stream("POST", base + "/v1/completions", json={
                        "model": "tiny", "prompt": "long", "max_tokens": 500, "stream": True,
                        "ignore_eos": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 3:
                                proc.send_signal(signal.SIGTERM)

        async def late_request():
            await asyncio.sleep(0.3)
            while len(events) < 3:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(timeout=10) as client:
                return (await client.post(base + "/v1/completions", json={
                    "model": "tiny", "prompt": "late", "max_tokens": 2})).status_code

        async def main():
            return await asyncio.gather(long_stream(), late_request())

        _, late_status = asyncio.run(main())
        assert late_status == 503
        assert events[-1] == "[DONE]"
        assert any('"error"' in e and "shutting down" in e for e in events)
        assert proc.wait(timeout=30) == 0
