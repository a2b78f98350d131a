"""Deadlines: the request with the least slack to its target first (`slo`).

A request may carry a time-to-first-token target (`slo_ttft_ms`) and a time-per-output-
token target (`slo_tpot_ms`). Its urgency is its slack in seconds: its deadline, less
now, less the work it still needs, predicted from the engine's own measured step costs
(core/step_cost.py, refitted after every step):
- before its first token: the deadline is arrival + slo_ttft_ms, the work its remaining
  prompt in chunks of the step budget beside the running decodes;
- after it, with a TPOT target: its next token is due at first token + slo_tpot_ms x
  the tokens generated since, the work one step (least laxity: the request furthest
  behind its pace goes first).
A request whose TTFT was met and that has no TPOT target is `MET`: after every on-time
request, and never preempted for one (once started, it finishes). Requests with no target
(none given) or whose TTFT can no longer be met are best-effort: after those, oldest
first (urgency `BEST_EFFORT` + arrival time), and the first to yield their seats.

Which waiting requests can no longer meet their TTFT is decided as each step starts
(`prepare_step`): the on-time waiting requests are walked in slack order, and each one's
first token predicted: it needs a seat (a free one, or the one the earliest-finishing
holder frees: a running request's finish is its remaining outputs, by max_tokens or its
length hint, at the measured decode step; best-effort holders yield theirs) and the
prompt tokens ahead of it (the running prompts, then those of the waiting ones with less
slack that can still make it) plus its own. One predicted past its deadline is
best-effort from then on (a deadline once missed stays missed), or, under `slo_reject`,
refused at once with an error naming the deadline and the predicted time
(`take_refusals`; only requests never started: a preempted one is served best-effort).
Nothing is dropped silently. Serving the hopeless last is what keeps the on-time ones on
time under overload: earliest-deadline-first alone serves the requests closest to
missing, and past capacity they all miss (the domino effect).

An on-time waiting request preempts at admission only a best-effort running one: the
threshold is half of `BEST_EFFORT` (between two on-time requests a preemption would
trade one deadline for another).
"""

from __future__ import annotations

import heapq
from typing import ClassVar, Iterable

from treadle.config import SchedulerConfig
from treadle.core.decode_gap import decode_step_prefill_tokens
from treadle.core.fair_share import FairShareLedger
from treadle.core.policies.base import SchedulingPolicy
from treadle.core.policy import band_rank, remaining_outputs
from treadle.core.step_cost import StepCostModel
from treadle.request import Request, RequestStatus

BEST_EFFORT = 1e9
"""Seconds of slack that place a request after every on-time one (its urgency is this
plus its arrival time)."""
MET = BEST_EFFORT / 4
"""Seconds of slack of a request whose TTFT was met and that has no TPOT target: after
the on-time ones, before the best-effort ones, and never preempted for an on-time one
(the threshold is BEST_EFFORT / 2): once started, it finishes."""

SLO_REFUSAL = "slo_ttft_ms: the first token cannot come within"
"""How a refusal under `slo_reject` begins (the server answers it with 503)."""

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


def ttft_deadline(request: Request) -> float | None:
    """When its first token is due (the scheduler's clock), or None without a target."""
    if request.slo_ttft_ms is None:
        return None
    return request.arrival_time + request.slo_ttft_ms / 1000.0


class SLOPolicy(SchedulingPolicy):
    """Urgency: slack to the request's next deadline, in seconds; then the requests whose
    targets are met (`MET`); then the best-effort ones (`BEST_EFFORT`)."""

    default_admission_threshold: ClassVar[float] = BEST_EFFORT / 2

    def __init__(self, config: SchedulerConfig, ledger: FairShareLedger) -> None:
        super().__init__(config, ledger)
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.reject = config.slo_reject
        self.late: set[str] = set()
        """Requests that missed (or can no longer meet) their TTFT target."""
        self.num_late = 0
        """Requests found late so far (refused ones included)."""
        self._refusals: list[tuple[Request, str]] = []
        self._num_decodes = 0
        self._default_costs = StepCostModel()

    @property
    def costs(self) -> StepCostModel:
        return self.step_costs if self.step_costs is not None else self._default_costs

    def _chunk_budget(self, num_decodes: int) -> int:
        """A step's tokens for a prompt's chunks beside `num_decodes` decodes: the whole
        budget, or with decodes running the prompt tokens core/decode_gap.py lets a step
        with decodes carry, plus the decodes."""
        budget = self.config.max_num_batched_tokens
        bound = decode_step_prefill_tokens(self.config, self.costs) if num_decodes else None
        return budget if bound is None else min(budget, bound + num_decodes)

    def slack(self, request: Request, now: float) -> float | None:
        """Seconds to spare before its next deadline after its own predicted work; None
        when it has no deadline left to meet (`urgency` tells met from best-effort)."""
        if request.request_id in self.late:
            return None
        if request.first_token_time is None:
            deadline = ttft_deadline(request)
            if deadline is None:
                return None
            work = self.costs.prefill_seconds(request.num_uncomputed_tokens,
                                              self._chunk_budget(self._num_decodes),
                                              self._num_decodes)
            return deadline - now - work
        if request.slo_tpot_ms is None:
            return None
        due = request.first_token_time + request.slo_tpot_ms / 1000.0 * request.num_output_tokens
        return due - now - self.costs.step_seconds(self._num_decodes + 1)

    def urgency(self, request: Request, now: float) -> float:
        slack = self.slack(request, now)
        if slack is not None:
            return slack
        if request.request_id not in self.late and ttft_deadline(request) is not None:
            return MET + request.arrival_time  # its TTFT met, no TPOT target: finish it
        return BEST_EFFORT + request.arrival_time

    def prepare_step(self, requests: Iterable[Request], now: float = 0.0) -> None:
        """Find the requests that can no longer meet their TTFT (see the module): each
        on-time waiting request, in slack order, gets a seat (a free one, else the one
        the earliest-finishing holder frees) and its first token after the prompt tokens
        ahead of it and its own."""
        requests = list(requests)
        self.late &= {r.request_id for r in requests}
        decodes = ahead = 0
        waiting, holders = [], []
        for r in requests:
            deadline = ttft_deadline(r)
            if (deadline is not None and r.first_token_time is not None
                    and r.first_token_time > deadline and r.request_id not in self.late):
                self._mark_late(r)
            if r.status == RequestStatus.RUNNING:
                decodes += r.is_decoding
                if band_rank(r) == 0 and r.request_id not in self.late and (
                        deadline is not None or r.slo_tpot_ms is not None):
                    holders.append(r)  # it keeps its seat (best-effort ones yield theirs)
                    if not r.is_decoding:
                        ahead += r.num_uncomputed_tokens
            elif (deadline is not None and r.first_token_time is None
                  and r.status in _QUEUED and band_rank(r) == 0
                  and r.request_id not in self.late):
                waiting.append(r)
        self._num_decodes = decodes
        if not waiting:
            return
        costs, budget = self.costs, self._chunk_budget(decodes)
        step_s = costs.step_seconds(max(decodes, 1))
        seats_free = self.max_num_seqs - len(holders)
        seat_frees = [now + remaining_outputs(r) * step_s for r in holders]
        heapq.heapify(seat_frees)
        waiting.sort(key=lambda r: (self.slack(r, now), r.arrival_time, r.request_id))
        for r in waiting:
            own = r.num_uncomputed_tokens
            seat = now if seats_free > 0 else (seat_frees[0] if seat_frees else now)
            predicted = max(now + costs.prefill_seconds(ahead + own, budget, decodes),
                            seat + costs.prefill_seconds(own, budget, decodes))
            if predicted <= ttft_deadline(r):
                ahead += own
                if seats_free > 0:
                    seats_free -= 1
                elif seat_frees:
                    heapq.heappop(seat_frees)
                heapq.heappush(seat_frees, predicted + remaining_outputs(r) * step_s)
                continue
            self._mark_late(r)
            if self.reject and r.status == RequestStatus.WAITING:
                self._refusals.append((r, self._refusal(r, predicted, ahead)))

    def _mark_late(self, request: Request) -> None:
        self.late.add(request.request_id)
        self.num_late += 1

    def _refusal(self, request: Request, predicted: float, ahead: int) -> str:
        costs = self.costs
        return (f"{SLO_REFUSAL} {request.slo_ttft_ms:g} ms "
                f"of arrival: predicted at {(predicted - request.arrival_time) * 1000:.0f} ms "
                f"({ahead} prompt tokens ahead of its {request.num_uncomputed_tokens}, at the "
                f"measured {costs.fixed_s * 1000:.1f} ms a step + "
                f"{costs.per_token_s * 1000:.3f} ms a token); refused (slo_reject)")

    def take_refusals(self) -> list[tuple[Request, str]]:
        refusals, self._refusals = self._refusals, []
        return refusals


POLICY = SLOPolicy
"""The policy of this module (what `policy_class` loads for its name)."""
