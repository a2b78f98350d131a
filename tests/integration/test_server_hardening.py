"""What an adversarial run found (issue 24), each as a test that failed before the fix:
errors that are errors, every malformed input a 400 in the OpenAI shape, auth first,
live gauges after aborts, engine-ended requests as 503 / 500, and a truthful OpenAPI
checked by schemathesis with every check on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_fixtures import running_server, write_tiny_demo

KEY_A, KEY_B = "key-alpha", "key-beta"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
QUOTA = 3000


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def server(tiny_demo, tmp_path_factory):
    """Two tenants; a KV cache (16 blocks = 256 tokens) smaller than the 512-token context.
    No wait bound: ten 200-token streams in 256 tokens of KV thrash, and the default bound
    (20 s) would rightly shed some of the gauges test's ten (tests/integration/
    test_overload.py tests the bound)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"- {{key: {KEY_A}, tenant: alpha}}\n- {{key: {KEY_B}, tenant: beta}}\n")
    with running_server(tiny_demo, "--num-kv-blocks", "16", "--api-keys-file", str(keys),
                        "--tenant-tokens-per-minute", str(QUOTA), "--max-queue-delay", "0") \
            as (base, _):
        yield base


def post(base, path, body=None, headers=A, **kw):
    return httpx.post(base + path, json=body, headers=headers, timeout=60, **kw)


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["message"]
    assert error["param"] is None or not error["param"].isdigit()  # a field, never an offset
    if param is not None:
        assert error["param"] == param, error
    return error


# ----- 1. errors are errors ---------------------------------------------------------------

def test_logit_bias_outside_the_vocabulary_is_a_400(server):
    # Was a 200 with finish_reason "error" and the reason dropped.
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                         "logit_bias": {"999999": 1.0}})
    assert "49152" in assert_openai_error(r, 400, "logit_bias")["message"]


def test_prompt_plus_max_tokens_over_the_whole_kv_cache_is_a_400(server):
    # 300 tokens fit the 512-token context but not the 256-token KV cache.
    r = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 300})
    assert "KV cache" in assert_openai_error(r, 400, "max_tokens")["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 300})
    assert_openai_error(r, 400, "max_tokens")
    # Without max_tokens, a chat's default fits what is left of the KV cache (not the
    # context): a long message leaves a short answer.
    messages = [{"role": "user", "content": "hello there " * 30}]
    num_prompt = post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert 100 < num_prompt < 250
    r = post(server, "/v1/chat/completions", {"messages": messages, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == \
        (num_prompt, 256 - num_prompt, 256)


def test_a_cost_over_the_whole_tenant_quota_is_a_400_not_a_429(server):
    # n=16 x 200 tokens = 3200 > 3000 per minute: no Retry-After could ever let it pass.
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 200, "n": 16})
    error = assert_openai_error(r, 400, "max_tokens")
    assert "tenant_tokens_per_minute" in error["message"] and "retry-after" not in r.headers


# ----- 2. every malformed input is a 400 in the OpenAI shape -------------------------------

SURROGATE = b'{"prompt": "a\\ud800b", "max_tokens": 2}'
MALFORMED = [
    ("/v1/completions", SURROGATE, "prompt"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/tokenize", b'{"prompt": "\\ud83d"}', "prompt"),
    ("/detokenize", b'{"tokens": [1, "\\ud800"]}', "tokens"),
    ("/v1/completions", b'{"prompt": "a\xff\xfe", "max_tokens": 2}', None),  # invalid UTF-8
    ("/v1/completions", b'{"prompt": "a", "max', None),                      # truncated
    ("/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     None),                                                                  # too deep
    ("/v1/completions", b"[1, 2]", None),                                    # not an object
    ("/v1/completions", b"", None),                                          # no body
    ("/v1/completions", b'{"prompt": "a", "max_tokens": "3"}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": '
                             b'[{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "messages.0.content.0.type"),
    ("/tokenize", b"{}", "prompt"),
]


@pytest.mark.parametrize("path, body, param", MALFORMED,
                         ids=[f"{p}-{b[:20]!r}" for p, b, _ in MALFORMED])
def test_malformed_bodies_are_400s_naming_the_field(server, path, body, param):
    # The surrogates were a 500 on completions, chat and /tokenize; the others answered
    # {"detail": ...} or named a character offset as the param.
    r = httpx.post(server + path, content=body, timeout=60,
                   headers={**A, "content-type": "application/json"})
    error = assert_openai_error(r, 400)
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


def test_a_chunked_body_over_the_limit_is_a_413(server):
    def chunks():  # no Content-Length: the size is only found while reading
        for _ in range(9):
            yield b"x" * (1024 * 1024)

    r = httpx.post(server + "/v1/completions", content=chunks(), timeout=60,
                   headers={**A, "content-type": "application/json"})
    assert "max_request_body_bytes" in assert_openai_error(r, 413)["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_unknown_routes_and_methods_answer_in_the_same_shape(server):
    assert_openai_error(httpx.get(server + "/v1/nothing", headers=A), 404)
    r = httpx.delete(server + "/v1/completions", headers=A)
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"


# ----- 3. auth first, everywhere ----------------------------------------------------------

@pytest.mark.parametrize("method, path", [
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"),
    ("GET", "/openapi.json"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions")])
def test_every_route_but_health_and_metrics_needs_a_key(server, method, path):
    # /tokenize, /detokenize, /docs and /openapi.json were open; a keyless malformed
    # request was a 400 (validation ran before authentication).
    r = httpx.request(method, server + path, content=b'{"malformed', timeout=30,
                      headers={"content-type": "application/json"})
    assert_openai_error(r, 401)
    r = httpx.request(method, server + path, timeout=30, content=b"{}",
                      headers={"Authorization": "Bearer wrong", "content-type": "application/json"})
    assert_openai_error(r, 401)
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/metrics").status_code == 200


def test_with_a_key_the_schema_declares_bearer_auth(server):
    spec = httpx.get(server + "/openapi.json", headers=B).json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert spec["paths"]["/tokenize"]["post"]["security"] == [{"bearer": []}, {"apiKey": []}]
    assert spec["components"]["securitySchemes"]["apiKey"] == {  # Anthropic's clients' header
        "type": "apiKey", "in": "header", "name": "x-api-key"}
    assert "security" not in spec["paths"]["/health"]["get"]
    assert httpx.post(server + "/tokenize", json={"prompt": "hi"}, headers=B).status_code == 200


# ----- 4. live gauges, prompt aborts ------------------------------------------------------

def gauges(base: str, swapped: bool = False) -> dict[str, float]:
    from treadle.bench.soak import parse_metrics

    values = parse_metrics(httpx.get(base + "/metrics").text)
    names = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
    return {name: values[f"treadle:{name}"]
            for name in names + (["num_requests_swapped"] if swapped else [])}


def test_gauges_read_zero_soon_after_the_last_request_is_aborted(server):
    # They used to keep their last values (running 10, waiting 43) until another request.
    async def main():
        async def stream(client):
            async with client.stream("POST", server + "/v1/completions", headers=B, json={
                    "prompt": "a long story", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        await asyncio.sleep(3600)  # hold it open until cancelled

        async def in_flight() -> tuple[float, dict]:
            # Read in a thread: a blocking read here would hold back the streams' own
            # sends, and on a fast machine the first requests then finished before the
            # last ones arrived, so the ten were never in the engine at once.
            g = await asyncio.to_thread(gauges, server, True)
            return g["num_requests_running"] + g["num_requests_waiting"] + \
                g["num_requests_swapped"], g

        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.ensure_future(stream(client)) for _ in range(10)]
            deadline = time.monotonic() + 60
            while (seen := await in_flight())[0] < 10:
                assert time.monotonic() < deadline, seen[1]
                await asyncio.sleep(0.05)
            assert seen[1]["kv_cache_usage_perc"] > 0
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return time.monotonic()

    gone = asyncio.run(main())
    # 1 s on a quiet machine; the bound leaves room for a loaded one (was: never).
    while time.monotonic() - gone < 3.0:
        if not any(gauges(server).values()):
            break
        time.sleep(0.05)
    assert gauges(server) == {"num_requests_running": 0, "num_requests_waiting": 0,
                              "kv_cache_usage_perc": 0}


# ----- 1 (cont.). a request the engine ends answers an error status -------------------------

def test_a_non_streaming_request_ended_by_shutdown_is_a_503_with_the_reason(tiny_demo):
    # Was a 200 with finish_reason "error" and the message dropped.
    with running_server(tiny_demo, "--num-kv-blocks", "64", "--shutdown-timeout", "0.3") \
            as (base, proc):
        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                pending = asyncio.ensure_future(client.post(base + "/v1/completions", json={
                    "prompt": "long", "max_tokens": 500, "ignore_eos": True}))
                while (await client.get(base + "/metrics")).text.find(
                        'treadle:num_requests_running{model_name="tiny"} 1.0') < 0:
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                return await pending

        r = asyncio.run(main())
        error = assert_openai_error(r, 503)
        assert "shutting down" in error["message"] and error["type"] == "server_error"
        assert proc.wait(timeout=60) == 0


def test_a_request_ended_by_an_engine_failure_is_a_500_with_the_reason(tiny_demo):
    from treadle.config import EngineConfig
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.api import build_app
    from treadle.server.auth import KeyRing
    from treadle.server.config import ServerConfig

    engine = AsyncEngine(EngineConfig.from_options(model=tiny_demo, dtype="float32",
                                                   num_kv_blocks=32), "tiny")

    def broken_step():
        raise RuntimeError("worker lost")

    engine.core.step = broken_step
    engine.start()
    try:
        app = build_app(engine, ServerConfig(), KeyRing({}))

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post("/v1/completions", json={"prompt": "hi",
                                                                  "max_tokens": 3})

        error = assert_openai_error(asyncio.run(main()), 500)
        assert "worker lost" in error["message"]
    finally:
        engine.shutdown()


# ----- 8. a truthful OpenAPI --------------------------------------------------------------

def test_schemathesis_with_every_check_finds_nothing(tiny_demo, tmp_path):
    """All checks (status codes, content types, headers, schemas, positive data accepted,
    negative data rejected, ...). Bounded: a short context keeps each generation to a few
    tokens, 10 fuzzed examples per operation (the coverage phase is fixed in size), no
    example database, a fixed seed."""
    pytest.importorskip("schemathesis")
    with running_server(tiny_demo, "--num-kv-blocks", "16", "--max-model-len", "24") \
            as (base, _):
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
               "PYTHONPATH": str(Path(__file__).parent)}
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", base + "/openapi.json",
             "--checks", "all", "--max-examples", "10", "--seed", "1", "--workers", "1",
             "--request-timeout", "300", "--max-response-time", "300",  # shared 2-core CI
             "--phases", "examples,coverage,fuzzing",
             "--generation-database", "none", "--suppress-health-check", "all",
             # endless by design (an event a second until the client leaves); its schema
             # is checked in test_dashboard.py, which reads it
             "--exclude-path", "/dashboard/events"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
        failures = result.stdout.split("= FAILURES =")[-1].split("= WARNINGS =")[0]
        assert result.returncode == 0, failures[:8000] + result.stdout[-1500:] + result.stderr[-2000:]
        assert httpx.get(base + "/health").status_code == 200


def test_the_schema_states_the_model_limits_and_the_error_responses(server):
    spec = httpx.get(server + "/openapi.json", headers=A).json()
    request = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["max_tokens"]["anyOf"][0]["maximum"] == 255  # the 256-token KV cache
    assert "256" in request["max_tokens"]["description"]
    responses = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses)
    assert "422" not in responses
    assert "text/event-stream" in responses["200"]["content"]
    assert "Retry-After" in responses["429"]["headers"]
    assert "Retry-After" in responses["503"]["headers"]  # a saturated server's answer
    assert "503" in spec["paths"]["/ready"]["get"]["responses"]
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert json.dumps(spec["components"]["schemas"]["Error"])
