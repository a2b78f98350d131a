"""`treadle bench capacity`: the highest request rate a server sustains under an SLO.

Owns Sarathi-Serve's capacity metric as a benchmark: for each configuration (a
scheduling policy and a chunk size, i.e. `max_num_batched_tokens`; or a peer server),
the highest arrival rate at which the p99 time to first token and the p99 time between
tokens (every inter-token gap of every request) both meet their targets, found by
doubling the rate until a probe misses, then bisecting between the last pass and the
first miss. A probe replays the Azure conversation trace (benchmarks/traces/, with
`treadle.measure.workloads.azure_conv`): its token counts scaled to this machine and its
arrival gaps scaled so that the replay runs at the probed rate; each probe draws fresh
prompt ids (no prefix-cache hits between probes). A request that fails or is still open
`timeout` after it was sent counts as missing both targets. Then goodput (requests per
second that met both targets themselves: TTFT, and the p99 of their own gaps) at
`goodput_factor` x the first configuration's capacity, for every configuration at that
same rate.

The targets are given, or measured (`auto`): 5 x the p99 TTFT and 5 x the median gap of
the first configuration at a light load (one request at a time), as Sarathi-Serve sets
its SLOs from an unloaded system's latencies. The same targets then hold for every
configuration and the peer.

It reads only HTTP (treadle.measure.http_load, the same load generator for every
server); launching servers is the CLI's (treadle/cli/bench_online.py).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from treadle.measure import workloads
from treadle.measure.http_load import RequestResult, run_load, served_model

POLICIES_COMPARED = ("fcfs", "priority", "srpt", "fair", "slo")
"""The policies compared by default, those of them the registry has (config)."""


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    """p99 time to first token."""
    tbt_s: float
    """p99 time between tokens."""

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLO targets must be > 0, got {self}")


@dataclass
class Probe:
    """One load at one rate."""

    rate: float
    num_requests: int
    num_failed: int
    ttft_p99_s: float
    tbt_p99_s: float
    goodput_rps: float
    meets: bool
    duration_s: float


@dataclass
class Search:
    """A configuration's capacity and the probes that found it."""

    capacity_rps: float
    probes: list[Probe] = field(default_factory=list)


def _p99(values: list[float]) -> float:
    """The 99th percentile, infinite where it falls among infinite values (failures) or
    between a finite one and an infinite one (any weight on an infinite value)."""
    if not values:
        return math.inf
    p99 = float(np.percentile(np.minimum(values, 1e30), 99))
    return math.inf if p99 >= 1e20 else p99  # no latency is 1e20 s: a failure's weight


def judge(results: list[RequestResult], rate: float, duration_s: float, slo: SLO) -> Probe:
    """A probe's figures: p99 TTFT over every request and p99 of every gap between tokens
    (a failed request counts as infinitely late for both); goodput: requests per second
    that met both targets themselves (their TTFT, the p99 of their own gaps)."""
    ttfts = [r.ttft if r.ok else math.inf for r in results]
    gaps = [g for r in results if r.ok for g in r.itls]
    failed = sum(not r.ok for r in results)
    if failed:  # no gap to show: as many infinite gaps as failures, each one late
        gaps += [math.inf] * failed
    good = sum(1 for r in results
               if r.ok and r.ttft <= slo.ttft_s and _p99(r.itls or [0.0]) <= slo.tbt_s)
    ttft_p99, tbt_p99 = _p99(ttfts), _p99(gaps)
    return Probe(rate, len(results), failed, ttft_p99, tbt_p99,
                 good / duration_s if duration_s > 0 else 0.0,
                 ttft_p99 <= slo.ttft_s and tbt_p99 <= slo.tbt_s, duration_s)


def search_capacity(probe: Callable[[float], Probe], start_rps: float,
                    max_doublings: int = 8, bisections: int = 3) -> Search:
    """The highest rate whose probe meets the SLO: double from `start_rps` until a probe
    misses (at most `max_doublings` times), or, when `start_rps` already misses, halve
    until one meets (as many times); then bisect `bisections` times between the last
    pass and the first miss (capacity within 2^-bisections of the bracket). 0 when no
    rate probed meets it."""
    search = Search(0.0)
    rate, passed, failed = start_rps, None, None
    for _ in range(max_doublings + 1):
        result = probe(rate)
        search.probes.append(result)
        if not result.meets:
            failed = rate
            break
        passed, rate = rate, rate * 2
    if passed is None:  # the start misses: a system whose batches cost more per step
        for _ in range(max_doublings):  # than one request alone shows
            rate = failed / 2
            result = probe(rate)
            search.probes.append(result)
            if result.meets:
                passed = rate
                break
            failed = rate
    if passed is None:
        return search
    if failed is None:  # never missed: the capacity is at least the last rate probed
        search.capacity_rps = passed
        return search
    for _ in range(bisections):
        rate = (passed + failed) / 2
        result = probe(rate)
        search.probes.append(result)
        if result.meets:
            passed = rate
        else:
            failed = rate
    search.capacity_rps = passed
    return search


@dataclass(frozen=True)
class TraceLoad:
    """How a probe replays the trace."""

    probe_s: float = 40.0
    """Seconds of arrivals per probe: rate x probe_s requests, within the two bounds."""
    min_requests: int = 24
    max_requests: int = 400
    token_scale: float = 0.25
    max_model_len: int = 2048
    timeout_s: float = 120.0
    """A request still open this long after it was sent counts as a failure."""

    def num_requests(self, rate: float) -> int:
        return int(min(self.max_requests, max(self.min_requests, round(rate * self.probe_s))))

    def workload(self, rate: float, num_requests: int, vocab_size: int,
                 seed: int) -> workloads.Workload:
        """The trace's first requests with fresh prompt ids, replayed at `rate`/s."""
        def replay(time_scale: float) -> workloads.Workload:
            return workloads.azure_conv(num_requests=num_requests,
                                        token_scale=self.token_scale, time_scale=time_scale,
                                        max_model_len=self.max_model_len,
                                        vocab_size=vocab_size, seed=seed)

        base = replay(1.0)
        span = base.requests[-1].arrival_time if base.requests else 0.0
        if span <= 0 or len(base.requests) < 2:
            return base
        return replay(rate / ((len(base.requests) - 1) / span))


class Prober:
    """Probes one server: each call replays the trace at a rate and judges it."""

    def __init__(self, url: str, load: TraceLoad, slo: SLO | None,
                 extra_body: dict | None = None, log=print) -> None:
        card = served_model(url)
        self.url, self.model, self.load, self.slo = url, card["id"], load, slo
        self.vocab_size = card.get("vocab_size") or workloads.DEFAULT_VOCAB_SIZE
        self.extra_body, self.log = extra_body, log
        self._seed = 0

    def results(self, rate: float | None, num_requests: int | None = None,
                max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
        """Replay the trace at `rate` (None: every request at once, `max_concurrency` at a
        time); fresh prompt ids each call."""
        self._seed += 1
        load = self.load
        count = num_requests or load.num_requests(rate or 1.0)
        workload = load.workload(rate or 1.0, count, self.vocab_size, self._seed)
        return asyncio.run(run_load(self.url, workload, self.model, progress=False,
                                    use_trace_times=rate is not None,
                                    max_concurrency=max_concurrency,
                                    extra_body=self.extra_body, timeout_s=load.timeout_s))

    def __call__(self, rate: float) -> Probe:
        results, duration = self.results(rate)
        probe = judge(results, rate, duration, self.slo)
        self.log(f"  {rate:7.3f} req/s: p99 TTFT {probe.ttft_p99_s * 1000:8.0f} ms, p99 TBT "
                 f"{probe.tbt_p99_s * 1000:6.0f} ms, failed {probe.num_failed}, goodput "
                 f"{probe.goodput_rps:.3f}/s -> {'meets' if probe.meets else 'misses'}")
        return probe

    def idle_slo(self, num_requests: int = 8, factor: float = 5.0) -> SLO:
        """`auto` targets: `factor` x the p99 TTFT and the median gap, one request at a
        time (the unloaded system)."""
        results, _ = self.results(None, num_requests, max_concurrency=1)
        ok = [r for r in results if r.ok]
        if not ok:
            raise RuntimeError(f"no request succeeded at light load: {results[0].error}")
        gaps = [g for r in ok for g in r.itls]
        return SLO(factor * _p99([r.ttft for r in ok]),
                   factor * float(np.median(gaps)) if gaps else 1.0)


def start_rate(prober: Prober, num_requests: int = 4) -> float:
    """Where the doubling starts: what one request at a time serves (batching only adds)."""
    results, duration = prober.results(None, num_requests, max_concurrency=1)
    ok = sum(r.ok for r in results)
    return max(0.02, ok / duration) if duration > 0 and ok else 0.1


@dataclass(frozen=True)
class System:
    """A server to measure: `start()` is a context manager yielding its base URL."""

    name: str
    start: Callable
    extra_body: dict | None = None
    """Fields every request of this system carries (the slo policy's deadlines)."""


def common_goodput_rate(goodput_factor: float, capacity_rps: float, start_rps: float) -> float:
    """The rate every system's goodput is measured at: `goodput_factor` x the first
    system's capacity, or x its start rate where nothing met the targets (capacity 0).
    Not the larger of the two: a start rate that already misses is often several times
    the capacity (4.8x on a machine with slow prefill), and goodput there says nothing
    about "1.5x capacity"."""
    return goodput_factor * (capacity_rps if capacity_rps > 0 else start_rps)


def run_capacity(systems: list[System], load: TraceLoad, slo: SLO | None,
                 goodput_factor: float = 1.5, log=print, max_doublings: int = 8,
                 bisections: int = 3) -> dict:
    """Each system's capacity under the SLO (measured on the first system when None), and
    its goodput at `goodput_factor` x the first system's capacity, each server started
    once for both (`max_doublings`, `bisections`: the search's, fewer for a short run)."""
    out: dict = {"systems": {}, "goodput_factor": goodput_factor}
    goodput_rate = None
    for system in systems:
        log(f"{system.name}:")
        with system.start() as url:
            prober = Prober(url, load, slo, system.extra_body, log)
            start = start_rate(prober)  # first: it also warms a fresh server up
            if slo is None:
                slo = prober.slo = prober.idle_slo()
                log(f"  SLO (auto, 5x light load): p99 TTFT {slo.ttft_s * 1000:.0f} ms, "
                    f"p99 TBT {slo.tbt_s * 1000:.0f} ms")
            search = search_capacity(prober, start, max_doublings, bisections)
            if goodput_rate is None:
                goodput_rate = common_goodput_rate(goodput_factor, search.capacity_rps, start)
            at_load = prober(goodput_rate)
        log(f"  capacity {search.capacity_rps:.3f} req/s; goodput at {goodput_rate:.3f} req/s: "
            f"{at_load.goodput_rps:.3f} req/s")
        out["systems"][system.name] = {
            "capacity_rps": search.capacity_rps, "start_rps": start,
            "probes": [p.__dict__ for p in search.probes],
            "goodput_rate_rps": goodput_rate, "goodput_rps": at_load.goodput_rps,
            "goodput_probe": at_load.__dict__}
    out["slo"] = None if slo is None else {"ttft_p99_s": slo.ttft_s, "tbt_p99_s": slo.tbt_s}
    out["load"] = load.__dict__
    out["search"] = {"max_doublings": max_doublings, "bisections": bisections}
    return out


def table_rows(result: dict) -> list[dict]:
    """One row per system: capacity, its ratio to the first, goodput at the common rate."""
    systems = result["systems"]
    first = next(iter(systems.values()), {}).get("capacity_rps") or math.nan
    return [{"system": name, "capacity req/s": round(s["capacity_rps"], 3),
             "x first": round(s["capacity_rps"] / first, 2) if first else math.nan,
             "goodput req/s": round(s["goodput_rps"], 3),
             "at req/s": round(s["goodput_rate_rps"], 3)} for name, s in systems.items()]
