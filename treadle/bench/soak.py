"""`treadle bench soak`: a bounded mixed-traffic soak against an OpenAI-compatible server.

Owns the soak's traffic and its figures. Traffic: Poisson arrivals at a rate for a fixed
window, at most `max_in_flight` requests open at once (a later arrival waits for a slot,
and that wait counts: every time is measured from the request's arrival), every request
streamed, a fraction of clients disconnecting mid-stream at a random token, priorities
drawn from a mix (e.g. -5 / 0 / +5), two tenants (one API key each), and a client
timeout per request from its arrival. While it runs, a report every `report_interval`
seconds of what /metrics says (server RSS, KV usage, running / waiting / swapped,
preemptions) and what the clients saw. At the end: goodput (requests that finished
within the client's deadline), latency percentiles and waits (time to first token) per
priority, preemptions per request, the preemption tax where /metrics exposes it, and
overload's two figures: the share of accepted requests (HTTP 200) that still timed out,
and how fast the refusals (429 or 503, with Retry-After) came back.
Everything is seeded: the same options send the same requests at the same times.
Must not: reach into a server's internals (it reads only HTTP and /metrics).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass

import numpy as np

from treadle.measure.report import percentiles
from treadle.measure.workloads import cap_lengths

FIRST_ORDINARY_TOKEN_ID = 3


@dataclass(frozen=True)
class SoakConfig:
    rate: float = 6.0
    """Mean arrivals per second (Poisson)."""
    duration_s: float = 240.0
    """Arrivals happen in [0, duration_s); the run then waits for open requests, each
    bounded by its own timeout."""
    max_in_flight: int = 150
    timeout_s: float = 300.0
    """A client gives up this long after its request arrived."""
    disconnect_fraction: float = 0.1
    """Share of clients that leave mid-stream after a random number of tokens."""
    priorities: tuple[int, ...] = (-5, 0, 5)
    priority_weights: tuple[float, ...] = (0.2, 0.6, 0.2)
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    report_interval_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("rate, duration_s and timeout_s must be > 0")
        if self.max_in_flight < 1 or self.report_interval_s <= 0:
            raise ValueError("max_in_flight must be >= 1 and report_interval_s > 0")
        if not 0 <= self.disconnect_fraction <= 1:
            raise ValueError(f"disconnect_fraction must be in [0, 1], "
                             f"got {self.disconnect_fraction}")
        if len(self.priorities) != len(self.priority_weights) or not self.priorities:
            raise ValueError("priorities and priority_weights need the same, non-zero length")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high")


@dataclass(frozen=True)
class SoakRequest:
    arrival: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int
    tenant: int
    """Index of the API key that sends it."""
    disconnect_after: int | None
    """Leave after this many streamed chunks (None: stay to the end)."""


@dataclass
class Outcome:
    """What one client saw; times in seconds from its arrival."""

    request: SoakRequest
    status: str = "pending"
    """finished | disconnected | timed_out | shed (429 or 503) | error"""
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None
    slot_wait: float | None = None
    """Seconds it waited for a client slot (max_in_flight) before being sent; None while
    it has not been sent."""
    accepted: bool = False
    """The server answered 200 (the stream began)."""
    refused_in: float | None = None
    """Seconds from sending to a refusal (429 or 503)."""


def make_requests(config: SoakConfig, vocab_size: int, num_tenants: int,
                  max_model_len: int | None = None) -> list[SoakRequest]:
    """The soak's requests, deterministic for a config and vocabulary; prompt + output
    fit `max_model_len` (workloads.cap_lengths: the prompt is cut first)."""
    if vocab_size <= FIRST_ORDINARY_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ORDINARY_TOKEN_ID}, got {vocab_size}")
    rng = np.random.default_rng(config.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / config.rate)
        if t >= config.duration_s:
            break
        arrivals.append(t)
    weights = np.asarray(config.priority_weights, dtype=float)
    requests = []
    for arrival in arrivals:
        prompt = int(rng.integers(config.prompt_len[0], config.prompt_len[1] + 1))
        output = int(rng.integers(config.output_len[0], config.output_len[1] + 1))
        prompt, output = cap_lengths(prompt, output, max_model_len)
        leaves = rng.random() < config.disconnect_fraction
        requests.append(SoakRequest(
            arrival=float(arrival),
            prompt_token_ids=rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size,
                                          size=prompt).tolist(),
            max_tokens=output,
            priority=int(rng.choice(config.priorities, p=weights / weights.sum())),
            tenant=int(rng.integers(0, num_tenants)),
            disconnect_after=int(rng.integers(1, output + 1)) if leaves else None))
    return requests


# ----- /metrics --------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over labels}; request_success is also
    kept per finished_reason ("treadle:request_success_total{abort}")."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            reason = sample.labels.get("finished_reason")
            if reason is not None:
                key = f"{sample.name}{{{reason}}}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


def server_figures(metrics: dict[str, float]) -> dict:
    """The figures a report prints, from one scrape (None where the server has none)."""
    def get(*names):
        return next((metrics[n] for n in names if n in metrics), None)

    return {
        "rss_mib": (get("process_resident_memory_bytes") / 2**20
                    if get("process_resident_memory_bytes") is not None else None),
        "kv_usage": get("treadle:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                        "vllm:gpu_cache_usage_perc"),
        "running": get("treadle:num_requests_running", "vllm:num_requests_running"),
        "waiting": get("treadle:num_requests_waiting", "vllm:num_requests_waiting"),
        "swapped": get("treadle:num_requests_swapped"),
        "preemptions": get("treadle:num_preemptions_total", "vllm:num_preemptions_total"),
        "preemptions_swap": get("treadle:num_preemptions_swap_total"),
        "preemptions_admission": get("treadle:num_admission_preemptions_total"),
        "requests_ended": sum(v for k, v in metrics.items()
                              if k.startswith("treadle:request_success_total{")),
        "preemption_tax_s": get("treadle:preemption_tax_seconds_total"),
    }


async def scrape(client, url: str) -> dict[str, float]:
    try:
        response = await client.get(url + "/metrics", timeout=30)
        return parse_metrics(response.text) if response.status_code == 200 else {}
    except Exception:  # a slow scrape under overload is a missing report, not a crash
        return {}


async def _settled(client, url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The last scrape, once the server has let go of every request (the aborts of the
    last clients to leave are counted too), or after timeout_s."""
    deadline = time.perf_counter() + timeout_s
    while True:
        metrics = await scrape(client, url)
        figures = server_figures(metrics)
        busy = any(figures[k] for k in ("running", "waiting", "swapped"))
        if not busy or time.perf_counter() > deadline:
            return metrics
        await asyncio.sleep(0.2)


# ----- the clients ---------------------------------------------------------------------

async def _stream(client, url: str, model: str, key: str | None, outcome: Outcome,
                  arrival_clock: float) -> None:
    req = outcome.request
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
               "stream": True, "temperature": 0.0, "ignore_eos": True,
               "priority": req.priority, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    chunks = 0
    sent = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=payload,
                             headers=headers) as response:
        if response.status_code != 200:
            body = (await response.aread())[:300]
            refused = response.status_code in (429, 503)
            outcome.status = "shed" if refused else "error"
            outcome.refused_in = time.perf_counter() - sent if refused else None
            outcome.error = f"HTTP {response.status_code}: {body!r}"
            return
        outcome.accepted = True
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                outcome.status, outcome.error = "error", str(event["error"])[:300]
                return
            if event.get("usage"):
                outcome.output_tokens = event["usage"]["completion_tokens"]
            if event.get("choices"):
                chunks += 1
                if outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - arrival_clock
                if req.disconnect_after is not None and chunks >= req.disconnect_after:
                    outcome.status = "disconnected"
                    outcome.e2e = time.perf_counter() - arrival_clock
                    return  # leaving the block closes the connection mid-stream
    outcome.e2e = time.perf_counter() - arrival_clock
    outcome.status = "finished" if outcome.ttft is not None else "error"
    if outcome.status == "error":
        outcome.error = "the stream ended without a token"


async def _client(client, url: str, model: str, keys: list[str | None], outcome: Outcome,
                  t0: float, slots: asyncio.Semaphore, timeout_s: float) -> None:
    req = outcome.request
    delay = t0 + req.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    arrival_clock = t0 + req.arrival

    async def attempt():
        async with slots:
            outcome.slot_wait = time.perf_counter() - arrival_clock
            await _stream(client, url, model, keys[req.tenant], outcome, arrival_clock)

    try:
        await asyncio.wait_for(attempt(), timeout=max(0.0, arrival_clock + timeout_s
                                                      - time.perf_counter()))
    except asyncio.TimeoutError:
        outcome.status = "timed_out"
    except Exception as exc:  # a failed request is a figure, not a crash of the soak
        outcome.status, outcome.error = "error", f"{type(exc).__name__}: {exc}"[:300]


def client_figures(outcomes: list[Outcome], elapsed: float) -> dict:
    """Counts by status; of the open requests, those sent (holding one of max_in_flight
    slots) and those still queued at the client for a slot."""
    counts = {s: 0 for s in ("pending", "finished", "disconnected", "timed_out", "shed",
                             "error")}
    for o in outcomes:
        counts[o.status] += 1
    arrived = [o for o in outcomes if o.request.arrival <= elapsed]
    open_ = [o for o in arrived if o.status == "pending"]
    in_flight = sum(1 for o in open_ if o.slot_wait is not None)
    return {"arrived": len(arrived), **counts, "in_flight": in_flight,
            "queued_at_client": len(open_) - in_flight}


async def run_soak(url: str, model: str, keys: list[str | None], vocab_size: int,
                   config: SoakConfig, max_model_len: int | None = None, log=print) -> dict:
    """Run the soak; returns every figure (and one record per request)."""
    import httpx

    requests = make_requests(config, vocab_size, len(keys), max_model_len)
    outcomes = [Outcome(r) for r in requests]
    slots = asyncio.Semaphore(config.max_in_flight)
    limits = httpx.Limits(max_connections=config.max_in_flight + 8,
                          max_keepalive_connections=config.max_in_flight + 8)
    reports = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s + 60),
                                 limits=limits) as client:
        start_metrics = await scrape(client, url)
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(_client(client, url, model, keys, o, t0, slots,
                                               config.timeout_s)) for o in outcomes]
        done = asyncio.ensure_future(asyncio.gather(*tasks))
        async with httpx.AsyncClient(timeout=30) as scraper:
            while not done.done():
                await asyncio.wait({done}, timeout=config.report_interval_s)
                elapsed = time.perf_counter() - t0
                report = {"t_s": round(elapsed, 1),
                          **server_figures(await scrape(scraper, url)),
                          "clients": client_figures(outcomes, elapsed)}
                reports.append(report)
                log(format_report(report))
        await done
        duration = time.perf_counter() - t0
        end_metrics = await _settled(client, url)
    summary = summarize(outcomes, config, duration, start_metrics, end_metrics)
    summary["server"].update(peaks(reports))
    return {"config": config.__dict__ | {"priorities": list(config.priorities),
                                         "priority_weights": list(config.priority_weights)},
            "vocab_size": vocab_size, "max_model_len": max_model_len,
            "num_tenants": len(keys), "duration_s": duration,
            "reports": reports, "summary": summary,
            "requests": [record(o) for o in outcomes]}


def format_report(report: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    c = report["clients"]
    return (f"[{report['t_s']:7.1f} s] rss {fmt(report['rss_mib'], '.0f')} MiB, kv "
            f"{fmt(report['kv_usage'], '.0%')}, running {fmt(report['running'], '.0f')}, "
            f"waiting {fmt(report['waiting'], '.0f')}, swapped {fmt(report['swapped'], '.0f')}"
            f", preemptions {fmt(report['preemptions'], '.0f')} | clients: arrived "
            f"{c['arrived']}, in flight {c['in_flight']}, queued {c['queued_at_client']}, "
            f"finished {c['finished']}, timed out "
            f"{c['timed_out']}, disconnected {c['disconnected']}, shed {c['shed']}, "
            f"errors {c['error']}")


def record(o: Outcome) -> dict:
    r = o.request
    return {"arrival_s": r.arrival, "priority": r.priority, "tenant": r.tenant,
            "prompt_tokens": len(r.prompt_token_ids), "max_tokens": r.max_tokens,
            "disconnect_after": r.disconnect_after, "status": o.status, "ttft_s": o.ttft,
            "e2e_s": o.e2e, "output_tokens": o.output_tokens, "slot_wait_s": o.slot_wait,
            "accepted": o.accepted, "refused_in_s": o.refused_in, "error": o.error}


def _latencies(outcomes: list[Outcome]) -> dict:
    """E2E of finished requests; waits (arrival -> first token, all of it, in the client's
    slot queue, and after being sent) of every request that got a token."""
    finished = [o for o in outcomes if o.status == "finished"]
    waited = [o.ttft for o in outcomes if o.ttft is not None]
    return {"num_requests": len(outcomes), "num_finished": len(finished),
            "num_timed_out": sum(o.status == "timed_out" for o in outcomes),
            "e2e_s": percentiles(o.e2e for o in finished),
            "wait_s": percentiles(waited),
            "wait_s_max": max(waited) if waited else math.nan,
            "client_queue_s": percentiles(o.slot_wait for o in outcomes
                                          if o.slot_wait is not None),
            "server_wait_s": percentiles(o.ttft - o.slot_wait for o in outcomes
                                         if o.ttft is not None and o.slot_wait is not None),
            "num_never_started": sum(o.ttft is None and o.status != "shed"
                                     for o in outcomes)}


def summarize(outcomes: list[Outcome], config: SoakConfig, duration: float,
              start: dict[str, float], end: dict[str, float]) -> dict:
    """Goodput, latency and waits per priority, preemptions per request, the tax."""
    stayers = [o for o in outcomes if o.request.disconnect_after is None]
    good = [o for o in stayers if o.status == "finished" and o.e2e is not None
            and o.e2e <= config.timeout_s]
    s0, s1 = server_figures(start), server_figures(end)

    def delta(key):
        if s0.get(key) is None or s1.get(key) is None:
            return None
        return s1[key] - s0[key]

    ended = delta("requests_ended")
    preemptions = delta("preemptions")
    counts = client_figures(outcomes, math.inf)
    started = sum(o.ttft is not None for o in outcomes)
    return {
        "num_requests": len(outcomes), **{k: counts[k] for k in (
            "finished", "disconnected", "timed_out", "shed", "error")},
        "overload": overload_figures(outcomes),
        "goodput": {"num_good": len(good), "of_staying_clients": len(stayers),
                    "fraction": len(good) / len(stayers) if stayers else math.nan,
                    "requests_per_s": len(good) / duration,
                    "deadline_s": config.timeout_s},
        "all": _latencies(outcomes),
        "per_priority": {str(p): _latencies([o for o in outcomes if o.request.priority == p])
                         for p in config.priorities},
        "server": {"requests_ended": ended, "preemptions": preemptions,
                   "preemptions_swap": delta("preemptions_swap"),
                   "preemptions_per_request": (preemptions / ended
                                               if preemptions is not None and ended else None),
                   "num_started": started,  # requests that got a first token
                   "preemptions_per_started_request": (
                       preemptions / started if preemptions is not None and started else None),
                   # admission preemptions (an urgent arrival taking a running request's
                   # place) are policy; the rest are memory preemptions, the thrash
                   "preemptions_admission": delta("preemptions_admission"),
                   "memory_preemptions_per_started_request": (
                       (preemptions - (delta("preemptions_admission") or 0)) / started
                       if preemptions is not None and started else None),
                   "preemption_tax_s": delta("preemption_tax_s"),
                   "rss_mib_end": s1.get("rss_mib")},
        "errors": [o.error for o in outcomes if o.status == "error"][:5],
    }


def overload_figures(outcomes: list[Outcome]) -> dict:
    """What overload control is for: of the requests the server accepted (200), how many
    still timed out at the client; of those it refused, by status, how fast it said so."""
    accepted = [o for o in outcomes if o.accepted]
    timed_out = sum(o.status == "timed_out" for o in accepted)
    refused = [o for o in outcomes if o.refused_in is not None]
    return {"accepted": len(accepted), "accepted_timed_out": timed_out,
            "accepted_timed_out_fraction": timed_out / len(accepted) if accepted else math.nan,
            "refused_429": sum(o.error is not None and o.error.startswith("HTTP 429")
                               for o in refused),
            "refused_503": sum(o.error is not None and o.error.startswith("HTTP 503")
                               for o in refused),
            "refused_in_s": percentiles(o.refused_in for o in refused)}


def peaks(reports: list[dict]) -> dict:
    """Maxima and means over the periodic reports (sampled at the report interval)."""
    out = {}
    for key in ("waiting", "running", "swapped", "rss_mib", "kv_usage"):
        values = [r[key] for r in reports if r.get(key) is not None]
        out[f"peak_{key}"] = max(values) if values else None
        out[f"mean_{key}"] = sum(values) / len(values) if values else None
    return out
