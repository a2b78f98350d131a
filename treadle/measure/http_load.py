"""Online benchmark: an async load generator for any OpenAI-compatible server.

Owns sending a workload's requests over HTTP at their arrival times (Poisson or gamma
inter-arrivals at a rate, or a trace's own times), streaming every response, and the
figures, defined as in vLLM's `bench serve`: TTFT (send -> first token), TPOT
((E2E - TTFT) / (output tokens - 1)), ITL (each gap between streamed chunks), E2E,
throughput, and goodput (requests per second meeting every SLO). It knows nothing about
treadle's internals: the same code measures any server.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from treadle.measure.report import percentiles
from treadle.measure.workloads import Workload


@dataclass
class RequestResult:
    """What one request saw (seconds, relative to the run's start)."""

    ok: bool
    start: float
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    priority: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def arrival_times(num_requests: int, rate: float | None, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times: all at 0 for an infinite rate, else gamma inter-arrivals of mean 1/rate
    (shape `burstiness`; 1.0 is a Poisson process, lower is burstier)."""
    if rate is None or rate == float("inf"):
        return [0.0] * num_requests
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    return list(np.cumsum(gaps) - gaps[0])


async def _send(client, url: str, model: str, prompt: list[int], max_tokens: int,
                priority: int, headers: dict, t0: float, start: float,
                extra_body: dict | None = None) -> RequestResult:
    result = RequestResult(ok=False, start=start, prompt_tokens=len(prompt), priority=priority)
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
               "temperature": 0.0, "ignore_eos": True, "priority": priority,
               "stream_options": {"include_usage": True}, **(extra_body or {})}
    sent = time.perf_counter()
    last = None
    chunks, counted_by_usage = 0, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=payload,
                                 headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    counted_by_usage = True
                if event.get("choices"):
                    chunks += 1
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - sent
        result.ok = result.ttft is not None
        if not counted_by_usage:  # a server without stream usage: a chunk per token
            result.output_tokens = chunks
    except Exception as exc:  # a failed request is a figure, not a crash of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(url: str, workload: Workload, model: str, rate: float | None = None,
                   burstiness: float = 1.0, max_concurrency: int | None = None,
                   priorities: list[int] | None = None, api_key: str | None = None,
                   seed: int = 0, use_trace_times: bool = False,
                   progress: bool = True, extra_body: dict | None = None,
                   timeout_s: float | None = None) -> tuple[list[RequestResult], float]:
    """Send every request of the workload; returns the results and the run's duration.
    `extra_body`: fields added to every request's body; `timeout_s`: a request still open
    this long after it was sent is abandoned (a failure, "timed out")."""
    import httpx
    from tqdm.auto import tqdm

    requests = workload.requests
    times = ([r.arrival_time for r in requests] if use_trace_times
             else arrival_times(len(requests), rate, burstiness, seed))
    priorities = priorities or [0] * len(requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not progress)
    t0 = time.perf_counter()

    async def one(i: int, client) -> RequestResult:
        delay = times[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async def send() -> RequestResult:
            start = time.perf_counter() - t0
            coro = _send(client, url, model, requests[i].prompt_token_ids,
                         requests[i].max_tokens, priorities[i], headers, t0, start, extra_body)
            try:
                return await asyncio.wait_for(coro, timeout_s)
            except asyncio.TimeoutError:
                return RequestResult(False, start, len(requests[i].prompt_token_ids),
                                     priority=priorities[i], error="timed out")

        if limit is not None:
            async with limit:
                res = await send()
        else:
            res = await send()
        bar.update(1)
        return res

    limits = httpx.Limits(max_connections=max_concurrency or 10_000,
                          max_keepalive_connections=max_concurrency or 10_000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        results = await asyncio.gather(*[one(i, client) for i in range(len(requests))])
    bar.close()
    return list(results), time.perf_counter() - t0


def served_model(url: str, api_key: str | None = None) -> dict:
    """The first model card a server lists at /v1/models ("id"; treadle and vLLM add
    "max_model_len", treadle "vocab_size")."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    if response.status_code != 200:
        raise ValueError(f"{url}/v1/models answered {response.status_code}: "
                         f"{response.text[:200]}")
    return response.json()["data"][0]


def request_records(results: list[RequestResult]) -> list[dict]:
    """One row per request in send order (seconds), for finding which requests were slow."""
    return [{"start_s": r.start, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "ttft_s": r.ttft, "e2e_s": r.e2e,
             "tpot_s": r.tpot, "priority": r.priority, "error": r.error} for r in results]


def summarize(results: list[RequestResult], duration_s: float,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
    """The run's figures (latencies in milliseconds)."""
    ok = [r for r in results if r.ok]

    def ms(values):
        return percentiles([v * 1000 for v in values if v is not None])

    def meets_slo(r: RequestResult) -> bool:
        if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
            return False
        if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > slo_tpot_ms:
            return False
        return True

    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "num_requests": len(results), "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / duration_s,
        "goodput_requests_per_s": sum(1 for r in ok if meets_slo(r)) / duration_s,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": ms(r.ttft for r in ok),
        "tpot_ms": ms(r.tpot for r in ok),
        "itl_ms": ms(gap for r in ok for gap in r.itls),
        "e2e_ms": ms(r.e2e for r in ok),
    }
