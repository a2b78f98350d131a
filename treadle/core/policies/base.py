"""What the scheduler asks a scheduling policy, and the answers every policy shares.

Owns `SchedulingPolicy`, the base class of the policies of this package: how requests
are ordered (the request's band, then `urgency`, then arrival, then request id: batch
work after every interactive request whatever the policy), whether running requests share
one order with waiting ones, whether a waiting request may preempt a running one at
admission and by how much more urgent it must be (`default_admission_threshold`, in the
policy's own unit), whether an urgent prefill runs alone, and how many requests may run
at once. A policy answers from the request, the clock and the fair policy's counters;
it holds no request state and never touches KV memory or the queues' contents.
"""

from __future__ import annotations

import math
from typing import ClassVar, Iterable, Iterator

from treadle.config import SchedulerConfig
from treadle.core.fair_share import FairShareLedger
from treadle.core.policy import band_rank
from treadle.core.request_queue import FCFSQueue, PolicyQueue
from treadle.core.step_cost import StepCostModel
from treadle.request import Request


class SchedulingPolicy:
    """One scheduling policy. A subclass defines `urgency`; the rest has defaults it may
    override. Built from the SchedulerConfig (each policy reads its own knobs there) and
    the scheduler's fair-share ledger."""

    orders_by_urgency: ClassVar[bool] = True
    """True: running prefill chunks, swapped-out and waiting requests share one order,
    most urgent first. False (fcfs): running, then swapped (oldest first), then waiting
    in queue order."""
    may_preempt_at_admission: ClassVar[bool] = True
    """Whether a waiting request more urgent by the threshold may preempt a running one
    under this policy (when `admission_preemption` is on)."""
    default_admission_threshold: ClassVar[float] = math.inf
    """Urgency gap needed to preempt at admission, in the policy's unit, when
    `admission_preemption_threshold` is not given."""
    orders_by_priority: ClassVar[bool] = False
    """Waiting requests start most urgent priority first (what the server's overload
    control predicts waits from)."""

    def __init__(self, config: SchedulerConfig, ledger: FairShareLedger) -> None:
        """`ledger`: the scheduler's fair-share counters."""
        self.name = config.scheduling_policy
        """Its name in the registry (treadle.config.SCHEDULING_POLICIES)."""
        self.ledger = ledger
        self.preempts_at_admission = (config.admission_preemption
                                      and self.may_preempt_at_admission)
        """A waiting request more urgent by the threshold may preempt a running one."""
        self.admission_threshold = (config.admission_preemption_threshold
                                    or self.default_admission_threshold)
        """Urgency gap needed to preempt at admission, in the policy's unit."""
        self.isolates_urgent_prefill = False
        """A step that prefills a request of a more urgent class carries nothing of the
        less urgent classes (`step_fill._defers_to`)."""
        self.step_costs: StepCostModel | None = None
        """The engine's measured step costs (core/step_cost.py), set by the scheduler:
        what a policy that predicts time (`slo`) prices work with."""

    def urgency(self, request: Request, now: float) -> float:
        """One number per request, lower is more urgent, in the policy's unit."""
        raise NotImplementedError

    def yield_class(self, request: Request, now: float) -> int:
        """The request's class within its band for yielding (core/yield_share.py): while
        a request of a lower class is about, the higher classes take a bounded share of
        each step. One class (0) unless the policy has classes of its own."""
        return 0

    def order_key(self, request: Request, now: float) -> tuple:
        """Sort key: band (interactive first), urgency, then arrival, then request id (a
        total order)."""
        return (band_rank(request), self.urgency(request, now), request.arrival_time,
                request.request_id)

    def order(self, requests: Iterable[Request], now: float) -> Iterator[Request]:
        """The requests most urgent first, as things stand at `now` (every interactive
        request before any batch one)."""
        return iter(sorted(requests, key=lambda r: self.order_key(r, now)))

    def make_queue(self) -> FCFSQueue | PolicyQueue:
        """The waiting queue this policy reads its order from."""
        return PolicyQueue()

    def max_running(self, requests: Iterable[Request]) -> int | None:
        """A cap on the running requests for admissions this step, below max_num_seqs,
        given every request in the scheduler (None: no cap of the policy's own)."""
        return None

    def observe_wait(self, seconds: float) -> None:
        """A request was admitted after waiting `seconds` (policies that age by the mean
        wait use it)."""

    def prepare_step(self, requests: Iterable[Request], now: float = 0.0) -> None:
        """Called as a step starts, with every request in the scheduler."""

    def take_refusals(self) -> list[tuple[Request, str]]:
        """Waiting requests the policy refuses, each with the error it ends with (the
        `slo` policy under `slo_reject`); the scheduler ends them. Taken once."""
        return []
