"""A batch line through the serving object, on a fake engine (no model): it runs as the
batch's owner in the `batch` band where the engine takes one (and without one where it
does not), it never counts against the live requests' overload bounds (a live request
does), a line cut off aborts its engine request, and a line refused because the server
is shutting down answers 503 (which the runner never records)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from starlette.requests import Request

from treadle.batch.lines import InputLine
from treadle.batch.runner import Owner
from treadle.engine.limits import EngineLimits
from treadle.engine.output_processor import CompletionOutput, RequestOutput
from treadle.server.auth import KeyRing, Tenant
from treadle.server.batch_lines import ServingLineExecutor
from treadle.server.completions import create_completion
from treadle.server.config import ServerConfig
from treadle.server.protocol import CompletionRequest
from treadle.server.serving import OpenAIServing

BODY = '{"prompt": [1, 2, 3], "max_tokens": 2}'


class FakeEngine:
    """What the serving object asks of an engine; `generate` answers "ok" once `go` is set,
    noting what it was asked and the overload counters meanwhile."""

    limits = EngineLimits(vocab_size=100, max_model_len=64, num_kv_tokens=1024, block_size=16)
    tokenizer = None
    model_name = "fake"
    lora_enabled = False
    supports_structured_outputs = False
    is_alive = True
    config = SimpleNamespace(scheduler=SimpleNamespace(
        scheduling_policy="fcfs", priority_aging=0.0, max_num_seqs=4,
        max_num_batched_tokens=256))
    stalled = None

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.go = asyncio.Event()
        self.serving: OpenAIServing | None = None

    async def _answer(self, request_id, prompt_token_ids, tenant, extra):
        call = {"tenant": tenant, **extra,
                "num_waiting": self.serving.admission.num_waiting, "closed": False}
        self.calls.append(call)
        try:
            await self.go.wait()
            yield RequestOutput(request_id, None, prompt_token_ids,
                                [CompletionOutput(0, "ok", [7, 8], "length")])
        finally:
            call["closed"] = True


class BandEngine(FakeEngine):
    def generate(self, request_id, prompt, prompt_token_ids, params, priority=0, tenant=None,
                 lora_request=None, band="interactive"):
        return self._answer(request_id, prompt_token_ids, tenant, {"band": band})


class PlainEngine(FakeEngine):
    def generate(self, request_id, prompt, prompt_token_ids, params, priority=0, tenant=None,
                 lora_request=None):
        return self._answer(request_id, prompt_token_ids, tenant, {})


def serving_over(engine: FakeEngine) -> OpenAIServing:
    serving = OpenAIServing(engine, ServerConfig(), KeyRing({}))
    engine.serving = serving
    return serving


def live_request(tenant: str) -> Request:
    async def receive():
        await asyncio.Event().wait()
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [], "query_string": b"", "state": {"key": Tenant(tenant)}},
                   receive)


LINE = InputLine(1, "c1", "/v1/completions", BODY)


def test_a_line_runs_as_its_owner_in_the_batch_band_outside_the_overload_counts():
    async def main():
        engine = BandEngine()
        serving = serving_over(engine)
        engine.go.set()
        result = await ServingLineExecutor(serving)(LINE, Owner("acme"), asyncio.Event())
        live = await create_completion(serving, CompletionRequest.model_validate(
            {"prompt": [1, 2, 3], "max_tokens": 2}), live_request("acme"))
        return result, live, engine.calls, serving.admission

    result, live, calls, admission = asyncio.run(main())
    assert result.status_code == 200 and result.body["choices"][0]["text"] == "ok"
    assert result.body["object"] == "text_completion"
    assert live["choices"][0]["text"] == "ok"
    batch_call, live_call = calls
    assert batch_call["tenant"] == "acme" and batch_call["band"] == "batch"
    assert batch_call["num_waiting"] == 0  # never counted as waiting
    assert live_call["band"] == "interactive" and live_call["num_waiting"] == 1
    assert admission.num_waiting == 0 and sum(admission._in_flight.values()) == 0


def test_an_engine_without_bands_runs_lines_without_one():
    async def main():
        engine = PlainEngine()
        engine.go.set()
        result = await ServingLineExecutor(serving_over(engine))(LINE, Owner("t"),
                                                                 asyncio.Event())
        return result, engine.calls

    result, calls = asyncio.run(main())
    assert result.status_code == 200 and "band" not in calls[0]


def test_a_line_cut_off_aborts_its_engine_request_and_answers_nothing():
    async def main():
        engine = BandEngine()
        cut_off = asyncio.Event()
        task = asyncio.ensure_future(ServingLineExecutor(serving_over(engine))(
            LINE, Owner("t"), cut_off))
        while not engine.calls:
            await asyncio.sleep(0.01)
        cut_off.set()
        return await asyncio.wait_for(task, 5), engine.calls

    result, calls = asyncio.run(main())
    assert result is None and calls[0]["closed"]


def test_a_line_while_shutting_down_is_a_503_and_bad_bodies_are_answered_as_live():
    async def main():
        engine = BandEngine()
        serving = serving_over(engine)
        execute = ServingLineExecutor(serving)
        bad = await execute(InputLine(2, "c2", "/v1/completions",
                                      '{"prompt": [1], "max_tokens": 2, "n": 0}'),
                            Owner("t"), asyncio.Event())
        streamed = await execute(InputLine(3, "c3", "/v1/completions",
                                           '{"prompt": [1], "stream": true}'),
                                 Owner("t"), asyncio.Event())
        serving.shutting_down = True
        late = await execute(LINE, Owner("t"), asyncio.Event())
        return bad, streamed, late, engine.calls

    bad, streamed, late, calls = asyncio.run(main())
    assert bad.status_code == 400 and bad.body["error"]["param"] == "n"
    assert streamed.status_code == 400 and streamed.body["error"]["param"] == "stream"
    assert late.status_code == 503 and calls == []
