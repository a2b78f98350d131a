"""The simulated fleet: replicas behind a router, colocated or prefill/decode disaggregated,
driven by one event loop on the simulated clock.

Owns the discrete-event loop (arrivals in trace order, each replica's step start and end,
P/D KV transfers; at equal times arrivals go first, as the real engine drains its input
queue before it schedules), routing each request with the production routers
(treadle/router: each replica seen as a `ReplicaLoad`, at the simulated time), and each
request's record: where it ran, when each token came
out (at the end of its step plus the step model's gap: output processing), and why it
failed if it did. Colocated: every replica prefills and decodes. P/D: a request runs its
prompt (and first token) on a prefill replica; its KV then crosses the link
(`transfer_seconds(num_prompt_tokens)`) to a decode replica chosen by the decode router,
lands there as prefix-cache blocks (Replica.receive_kv), and the rest of its tokens are
generated there. Replicas are stepped only through Replica.start_step / finish_step:
scheduling decisions are the production scheduler's. Nothing here reads the wall clock
except to report how long the simulation took.
"""

from __future__ import annotations

import heapq
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from treadle.router.routers import Router
from treadle.sim.clock import SimClock
from treadle.sim.replica import Replica
from treadle.sim.runner import SIM_TOKEN_ID
from treadle.sim.workload import PromptMaker, SimRequest

_START, _END, _TRANSFER = 0, 1, 2


def _scheduling(sim: SimRequest) -> dict:
    """A simulated request's band and deadlines, as the engine's Request takes them."""
    return {"band": sim.band, "slo_ttft_ms": sim.slo_ttft_ms, "slo_tpot_ms": sim.slo_tpot_ms}


class RequestRecord:
    """What happened to one request (simulated seconds from the first arrival)."""

    __slots__ = ("request", "first_token", "last_token", "num_tokens", "error", "replica",
                 "decode_replica", "transfer_s", "done", "missed")

    def __init__(self, request: SimRequest, replica: int) -> None:
        self.request = request
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.error: str | None = None
        self.replica = replica
        self.decode_replica: int | None = None
        self.transfer_s = 0.0
        self.done = False
        self.missed = False


class SloMonitor:
    """Stops a simulation once it can no longer meet an SLO: when more of the judged
    requests (priority at most `max_priority`, all when None) have missed the TTFT or the
    TPOT target than a p99 (or the goodput target) allows, plus one for the percentile's
    interpolation. A fleet size search uses it so that an overloaded fleet, whose queues
    would grow for the rest of the trace, costs little to rule out."""

    def __init__(self, num_judged: int, ttft_s: float | None, tpot_s: float | None,
                 min_goodput: float | None = None, max_priority: int | None = None) -> None:
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self.max_priority = max_priority
        self.max_late = 0.01 * num_judged + 1
        self.max_missed = ((1.0 - min_goodput) * num_judged + 1
                           if min_goodput is not None else float("inf"))
        self.num_late_ttft = self.num_late_tpot = self.num_missed = 0
        self.failed = False

    def judged(self, record: RequestRecord) -> bool:
        return self.max_priority is None or record.request.priority <= self.max_priority

    def first_token(self, record: RequestRecord, t: float) -> None:
        if (self.ttft_s is not None and t - record.request.arrival > self.ttft_s
                and self.judged(record)):
            self.num_late_ttft += 1
            self.num_missed += 1
            record.missed = True
            self._check()

    def finished(self, record: RequestRecord) -> None:
        if (self.tpot_s is None or record.num_tokens < 2 or record.first_token is None
                or not self.judged(record)):
            return
        if (record.last_token - record.first_token) / (record.num_tokens - 1) > self.tpot_s:
            self.num_late_tpot += 1
            if not record.missed:
                self.num_missed += 1
            self._check()

    def _check(self) -> None:
        self.failed = (self.num_late_ttft > self.max_late or self.num_late_tpot > self.max_late
                       or self.num_missed > self.max_missed)


@dataclass
class FleetResult:
    records: list[RequestRecord]
    itl_s: array
    """Every gap between two outputs of a request (one per step that produced tokens)."""
    replicas: list[Replica]
    end_time: float
    """Simulated time of the last event."""
    wall_s: float
    """Wall-clock seconds the simulation took."""
    num_events: int
    mode: str
    stopped_early: bool = False
    """An SloMonitor ended the run: the SLO was already missed (figures are partial)."""
    info: dict = field(default_factory=dict)


class Fleet:
    """Replicas (`replicas`; with `decode_replicas`, these are the prefill pool) behind
    routers, on one simulated clock."""

    def __init__(self, replicas: Sequence[Replica], router: Router, clock: SimClock,
                 prompt_maker: PromptMaker, decode_replicas: Sequence[Replica] = (),
                 decode_router: Router | None = None,
                 transfer_seconds: Callable[[int], float] | None = None,
                 monitor: SloMonitor | None = None, front_end_s: float = 0.0) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.front_end_s = front_end_s
        """Seconds from a request's send to its arrival at the engine (SimConfig.front_end_ms):
        its latencies, measured from the send, include them."""
        self.replicas = list(replicas)
        self.decode_replicas = list(decode_replicas)
        self.disaggregated = bool(self.decode_replicas)
        if self.disaggregated and (decode_router is None or transfer_seconds is None):
            raise ValueError("a P/D fleet needs a decode router and a transfer time")
        self.router = router
        self.decode_router = decode_router
        self.transfer_seconds = transfer_seconds
        self.clock = clock
        self.prompt_maker = prompt_maker
        self.monitor = monitor
        self._heap: list = []
        self._seq = 0
        self._records: dict[str, RequestRecord] = {}
        self._itl = array("d")

    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def run(self, requests: Sequence[SimRequest]) -> FleetResult:
        """Replay `requests` (sorted by arrival) to the end; every request gets a record."""
        wall = time.perf_counter()
        order = sorted(requests, key=lambda r: (r.arrival, r.index))
        records = []
        heap, clock = self._heap, self.clock
        num_events = 0
        i, n = 0, len(order)
        monitor = self.monitor
        front_end = self.front_end_s
        while not (monitor is not None and monitor.failed):
            if i < n and (not heap or order[i].arrival + front_end <= heap[0][0]):
                request = order[i]
                i += 1
                clock.advance_to(request.arrival + front_end)
                records.append(self._arrive(request))
            elif heap:
                t, _, kind, obj = heapq.heappop(heap)
                clock.now = t
                if kind == _END:
                    self._end(obj)
                elif kind == _START:
                    self._start(obj)
                else:
                    self._transfer_done(obj)
            else:
                break
            num_events += 1
        stopped = monitor is not None and monitor.failed
        for record in records:
            if not record.done and record.error is None:
                record.error = ("unfinished: the SLO monitor stopped the simulation" if stopped
                                else "unfinished when the simulation ran out of events")
        return FleetResult(records, self._itl, self.replicas + self.decode_replicas,
                           clock.now, time.perf_counter() - wall, num_events,
                           "disaggregated" if self.disaggregated else "colocated", stopped)

    # ----- events ---------------------------------------------------------------------------

    def _route(self, router: Router, replicas: list[Replica], prompt: list[int],
               tenant: str | None) -> int:
        """The position in `replicas` that the router picks (its prefix trees keyed by
        the tenant, as the server's are; its clock the simulated one)."""
        loads = [replica.load(i) for i, replica in enumerate(replicas)]
        return router.route(prompt, tenant, loads, self.clock.now).replica

    def _arrive(self, sim: SimRequest) -> RequestRecord:
        prompt = self.prompt_maker.prompt(sim)
        index = self._route(self.router, self.replicas, prompt, sim.tenant)
        replica = self.replicas[index]
        record = RequestRecord(sim, index)
        rid = str(sim.index)
        self._records[rid] = record
        max_tokens = 1 if self.disaggregated else sim.output_len
        request = replica.make_request(rid, prompt, max_tokens, sim.arrival + self.front_end_s,
                                       sim.priority, sim.tenant, **_scheduling(sim))
        self._submit(replica, rid, record, request)
        return record

    def _submit(self, replica: Replica, rid, record, request) -> None:
        """Hand a request to a replica: a refusal finishes its record with the error; an
        idle replica starts stepping."""
        error = replica.add(request)
        if error is not None:
            record.error = error
            self._finish(rid, record)
        elif not replica.active:
            self._start(replica)

    def _start(self, replica: Replica) -> None:
        t_end = replica.start_step()
        for out in replica.take_ended():  # refused by the policy (slo_reject)
            record = self._records[out.request_id]
            record.error = out.error
            self._finish(out.request_id, record)
        if t_end is None:
            replica.active = False
        else:
            replica.active = True
            self._push(t_end, _END, replica)

    def _end(self, replica: Replica) -> None:
        outputs, gap = replica.finish_step()
        t = self.clock.now + gap
        records = self._records
        prefill_role = self.disaggregated and replica.role == "prefill"
        for out in outputs:
            rid = out.request_id
            record = records[rid]
            if out.new_token_ids:
                if record.first_token is None:
                    record.first_token = t
                    if self.monitor is not None:
                        self.monitor.first_token(record, t)
                else:
                    self._itl.append(t - record.last_token)
                record.last_token = t
                record.num_tokens += len(out.new_token_ids)
            if out.finished:
                if prefill_role and record.request.output_len > 1:
                    record.transfer_s = self.transfer_seconds(record.request.prompt_len)
                    self._push(t + record.transfer_s, _TRANSFER, rid)
                else:
                    self._finish(rid, record)
        if not replica.scheduler.has_unfinished_requests():
            replica.active = False
        elif gap > 0:
            self._push(t, _START, replica)
        else:
            self._start(replica)

    def _transfer_done(self, rid: str) -> None:
        record = self._records[rid]
        sim = record.request
        prompt = self.prompt_maker.prompt(sim) + [SIM_TOKEN_ID]
        index = self._route(self.decode_router, self.decode_replicas, prompt, sim.tenant)
        replica = self.decode_replicas[index]
        record.decode_replica = index
        request = replica.make_request(rid, prompt, sim.output_len - 1,
                                       sim.arrival + self.front_end_s,
                                       sim.priority, sim.tenant, **_scheduling(sim))
        replica.receive_kv(request, sim.prompt_len)
        self._submit(replica, rid, record, request)

    def _finish(self, rid: str, record: RequestRecord) -> None:
        record.done = True
        del self._records[rid]
        if self.monitor is not None and record.error is None:
            self.monitor.finished(record)
