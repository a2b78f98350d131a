"""Priority classes: lower `priority` values run first (vLLM's convention).

Strict classes by default. A request's urgency is its priority, less (opt-in)
`priority_aging_rate` levels per second it has waited to run (not while it runs) and the
boost that keeps its wait within `priority_aging` times the mean wait of recent requests
(`bounded_wait_boost`). A waiting request more urgent by the threshold (half a level by
default) may preempt a running one; a step that prefills a request of a more urgent class
carries nothing of the less urgent ones (`isolate_urgent_prefill`); and while a more
urgent class is about, the less urgent ones take a bounded share of each step
(`priority_yield`, core/yield_share.py) by their `yield_class`: the class a request's aged
urgency rounds to, so that aging lifts it out of yielding as it lifts it in the order.
"""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar, Iterable

from treadle.config import SchedulerConfig
from treadle.core.fair_share import FairShareLedger
from treadle.core.policies.base import SchedulingPolicy
from treadle.request import Request


def priority_urgency(request: Request, now: float, aging_rate: float) -> float:
    """Effective priority: `priority - aging_rate * seconds_waited` (lower runs first):
    a request ages while it waits to run (from arrival, and again once preempted), not
    while it runs, so a long answer never ages out of being preempted for a more urgent
    request (vllm #40004: a running request must stay preemptible at the max_num_seqs
    bottleneck).

    The order it gives among requests that have only waited never changes with time: a
    request of priority p arriving at a outranks every request of priority q arriving
    after a + (p - q) / aging_rate. That is the bound on how long aging lets it be
    passed before it first runs.
    """
    return request.priority - aging_rate * request.waited(now)


def bounded_wait_boost(waited: float, priority: int, most_urgent_priority: int,
                       bound: float, mean_wait: float) -> float:
    """Levels of priority a waiting request gains so that its wait stays within `bound`
    times the mean wait: growing linearly with its wait, it reaches one level beyond the
    most urgent class present exactly when the request has waited bound x mean_wait, from
    when on it outranks every fresh request (and the ones aged less than it). 0 when the
    bound is off (bound <= 0) or nothing has waited yet (mean_wait <= 0)."""
    if bound <= 0 or mean_wait <= 0:
        return 0.0
    span = max(0, priority - most_urgent_priority) + 1
    return span * waited / (bound * mean_wait)


class PriorityPolicy(SchedulingPolicy):
    """Lower priority values first, aged: linearly (`priority_aging_rate` levels per
    second), and so that no request waits more than `priority_aging` times the mean wait
    of recent requests (`bounded_wait_boost`; the mean over the last admissions, fed by
    the scheduler with each admitted request's wait, `observe_wait`)."""

    default_admission_threshold: ClassVar[float] = 0.5
    """Half a level: one level apart, a fresh request still displaces one that has aged
    less than half a level since it arrived."""
    orders_by_priority: ClassVar[bool] = True
    _MEAN_WAIT_WINDOW = 512
    """Admissions the mean wait is taken over: long enough to be the workload's mean, not a
    burst's (a short average would follow the backlog of a burst and loosen the bound
    exactly when it matters)."""

    def __init__(self, config: SchedulerConfig, ledger: FairShareLedger) -> None:
        super().__init__(config, ledger)
        self.isolates_urgent_prefill = config.isolate_urgent_prefill
        self.yields_by_class = config.priority_yield
        self.aging_rate = config.priority_aging_rate
        self.wait_bound = config.priority_aging
        self.mean_wait = 0.0
        self._waits: deque[float] = deque()
        self._waits_sum = 0.0
        self.most_urgent_priority = 0
        """The most urgent priority value among the requests (set as each step starts)."""

    def observe_wait(self, seconds: float) -> None:
        """A request was admitted after waiting this long."""
        self._waits.append(seconds)
        self._waits_sum += seconds
        if len(self._waits) > self._MEAN_WAIT_WINDOW:
            self._waits_sum -= self._waits.popleft()
        self.mean_wait = max(self._waits_sum, 0.0) / len(self._waits)

    def prepare_step(self, requests: Iterable[Request], now: float = 0.0) -> None:
        if self.wait_bound > 0 or self.yields_by_class:
            self.most_urgent_priority = min((r.priority for r in requests), default=0)

    def yield_class(self, request: Request, now: float) -> int:
        if not self.yields_by_class:
            return 0
        # The class its aged urgency rounds to (half a level, the admission threshold,
        # lifts it one class); aging lifts a request at most to the most urgent class
        # present, never above it (or fresh requests of that class would yield to it).
        aged = math.floor(self.urgency(request, now) + 0.5)
        return max(min(request.priority, aged), self.most_urgent_priority)

    def urgency(self, request: Request, now: float) -> float:
        waited = request.waited(now)
        return (priority_urgency(request, now, self.aging_rate)
                - bounded_wait_boost(waited, request.priority, self.most_urgent_priority,
                                     self.wait_bound, self.mean_wait))


POLICY = PriorityPolicy
"""The policy of this module (what `policy_class` loads for its name)."""
