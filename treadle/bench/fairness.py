"""The VTC paper's fairness suites on the real engine, on the wall clock (`treadle bench
fairness --engine real`).

Owns replaying a suite (treadle/measure/fairness.py makes its requests and reads the
figures) into an in-process EngineCore: each request joins at its arrival time, the
engine steps whenever it has work, and a step observer (the engine's StepObservers, the
public way to watch steps) logs each step's tokens per tenant and which tenants were
backlogged (had a request that arrived and is not running: waiting, or preempted) as it
was scheduled. Policies: fcfs, rpm (fcfs behind a per-tenant requests-per-minute limit)
and fair. The engine's capacity for the suite's request size is measured first on a
backlog (`capacity_rps`), and the suite's rates scaled to it.

The simulator runs the same suites far faster than real time (treadle/sim/fairness.py);
this run checks it at a small scale on the machine itself. Must not: change the engine's
behaviour, or time anything but the replay.
"""

from __future__ import annotations

import time
from typing import Any

from treadle.measure import fairness as fm

POLICIES = ("fcfs", "rpm", "fair")


class _ServiceObserver:
    """A step observer: each step's tokens per tenant, and the backlogged tenants."""

    def __init__(self, tenant_of: dict[str, str], log: fm.ServiceLog, start: float) -> None:
        self.tenant_of = tenant_of
        self.log = log
        self.start = start
        self.queued: dict[str, str] = {}
        """Arrived and not running: request id -> tenant."""
        self._backlogged: frozenset[str] = frozenset()

    def record_arrival(self, request) -> None:
        self.queued[request.request_id] = self.tenant_of.get(request.request_id, "?")

    def record_scheduled(self, step: int, output) -> None:
        self._backlogged = frozenset(self.queued.values())
        for rid in output.preempted_request_ids:
            if rid in self.tenant_of:
                self.queued[rid] = self.tenant_of[rid]
        for s in output.scheduled:
            self.queued.pop(s.request_id, None)

    def record_step(self, step: int, t_start: float, t_end: float, output, *rest) -> None:
        served: dict[str, int] = {}
        for s in output.scheduled:
            tenant = self.tenant_of.get(s.request_id)
            if tenant is not None:
                served[tenant] = served.get(tenant, 0) + s.num_scheduled_tokens
        self.log.step(t_end - self.start, served, self._backlogged)

    def record_end(self, request_id: str, reason: str) -> None:
        self.queued.pop(request_id, None)


def _engine(policy: str, tenant_weights: dict[str, float], **options: Any):
    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore

    weights = ",".join(f"{t}={w}" for t, w in tenant_weights.items())
    return EngineCore(EngineConfig.from_options(
        **{"model": "demo", **options, "scheduling_policy": policy, "tenant_weights": weights}))


def replay(engine, requests: list[fm.FairRequest], vocab: int = 4000,
           id_prefix: str = "") -> tuple[fm.ServiceLog, dict[str, list[float]]]:
    """Feed `requests` to the EngineCore at their arrival times, step until all end: the
    service log and each tenant's TTFTs (seconds)."""
    import random

    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    rng = random.Random(0)
    tenant_of = {f"{id_prefix}{i}": r.tenant for i, r in enumerate(requests)}
    log = fm.ServiceLog()
    start = time.monotonic()
    observer = _ServiceObserver(tenant_of, log, start)
    engine.trace.add(observer)
    ttfts: dict[str, list[float]] = {}
    arrival_of: dict[str, float] = {}
    seen_first: set[str] = set()
    i = 0
    while i < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic()
        while i < len(requests) and start + requests[i].arrival <= now:
            r, rid = requests[i], f"{id_prefix}{i}"
            arrival_of[rid] = start + r.arrival
            request = Request(rid, [rng.randrange(300, vocab) for _ in range(r.prompt_len)],
                              SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                             ignore_eos=True),
                              arrival_time=start + r.arrival, tenant=r.tenant,
                              cache_salt=r.tenant)
            engine.add_request(request)  # its arrival reaches the observer (EngineCore.trace)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + requests[i].arrival - time.monotonic()))
            continue
        for out in engine.step():
            if out.new_token_ids and out.request_id not in seen_first:
                seen_first.add(out.request_id)
                ttfts.setdefault(tenant_of[out.request_id], []).append(
                    time.monotonic() - arrival_of[out.request_id])
    return log, ttfts


def capacity_rps(engine, prompt_len: int, output_len: int, num_requests: int = 24) -> float:
    """Requests of this size per second the engine serves at saturation (a backlog of
    `num_requests` arriving together, served to the end)."""
    t0 = time.monotonic()
    replay(engine, [fm.FairRequest(0.0, "A", prompt_len, output_len)] * num_requests,
           id_prefix="capacity-")
    return num_requests / (time.monotonic() - t0)


def run_suite(name: str, policies=POLICIES, duration_scale: float = 0.1,
              token_scale: float = 0.25, window_s: float | None = None,
              tenant_weights: dict[str, float] | None = None, rpm_limit: int | None = None,
              seed: int = 0, capacity: float | None = None, **engine_options: Any) -> dict:
    """Suite `name` under each policy on the real engine (a fresh engine per policy),
    at `duration_scale` of the paper's duration and `token_scale` of its lengths."""
    weights = tenant_weights or {}
    length = max(4, round(fm.PAPER_TOKENS * token_scale))
    if capacity is None:
        capacity = capacity_rps(_engine("fcfs", weights, **engine_options), length, length)
    requests = fm.make_requests(name, capacity, duration_scale, token_scale, seed)
    tenants = sorted({r.tenant for r in requests})
    window = window_s or max(1.0, requests[-1].arrival / 20)
    limit = rpm_limit or max(1, round(capacity * 60 / len(tenants)))
    runs = {}
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        admitted, refused = (fm.rpm_admit(requests, limit) if policy == "rpm"
                             else (requests, 0))
        engine = _engine("fcfs" if policy == "rpm" else policy, weights, **engine_options)
        log, ttfts = replay(engine, admitted)
        engine.shutdown()
        runs[policy] = (log, fm.summarize(log, requests, weights, window, ttfts, refused))
    return {"suite": name, "description": fm.SUITES[name].description,
            "engine": "real (wall clock)", "capacity_rps": capacity,
            "num_requests": len(requests), "tenants": tenants, "weights": weights,
            "rpm_limit": limit, "window_s": window, "duration_s": requests[-1].arrival,
            "runs": runs}
