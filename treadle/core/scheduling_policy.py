"""The scheduling policies as objects: what the scheduler asks a policy, and each answer.

Owns the `SchedulingPolicy` protocol and its five implementations (fcfs, priority, srpt,
fair, makespan), so that the scheduler asks a policy instead of comparing policy names: how
requests are ordered, whether running requests share one order with waiting ones,
whether a waiting request may preempt at admission, whether an urgent prefill runs
alone, and how many requests may run at once (makespan's pacing). The numbers behind
each answer are the pure functions of `treadle.core.policy` (written out in
docs/scheduling.md); the fair policy's counters live in `treadle.core.fair_share`. A
policy holds no request state.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, Protocol

from treadle.core import policy
from treadle.core.fair_share import FairShareLedger
from treadle.core.request_queue import FCFSQueue, PolicyQueue
from treadle.request import Request


class SchedulingPolicy(Protocol):
    """What the scheduler needs from an ordering policy."""

    name: str
    orders_by_urgency: bool
    """True: running prefill chunks, swapped-out and waiting requests share one order,
    most urgent first. False (fcfs): running, then swapped (oldest first), then waiting
    in queue order."""
    preempts_at_admission: bool
    """A waiting request more urgent by the threshold may preempt a running one."""
    admission_threshold: float
    """Urgency gap needed to preempt at admission, in the policy's unit."""
    isolates_urgent_prefill: bool
    """A step that prefills a request of a more urgent class carries nothing of the less
    urgent classes (`Scheduler._defers_to`)."""

    def max_running(self, requests: Iterable[Request]) -> int | None:
        """A cap on the running requests for admissions this step, below max_num_seqs,
        given every request in the scheduler (None: no cap of the policy's own)."""

    def make_queue(self) -> FCFSQueue | PolicyQueue: ...

    def urgency(self, request: Request, now: float) -> float: ...

    def order_key(self, request: Request, now: float) -> tuple: ...

    def order(self, requests: Iterable[Request], now: float) -> Iterator[Request]: ...

    def observe_wait(self, seconds: float) -> None:
        """A request was admitted after waiting `seconds` (policies that age by the mean
        wait use it)."""

    def prepare_step(self, requests: Iterable[Request]) -> None:
        """Called as a step starts, with every request in the scheduler."""


class _UrgencyPolicy:
    """Shared by the four: urgency from `policy.urgency`, order by `policy.order_key`."""

    name = "fcfs"
    orders_by_urgency = True
    isolates_urgent_prefill = False

    def __init__(self, params: policy.OrderParams, ledger: FairShareLedger,
                 admission_preemption: bool, threshold: float | None) -> None:
        self.params = params
        self.ledger = ledger
        self.preempts_at_admission = admission_preemption and policy.preempts_at_admission(
            self.name)
        self.admission_threshold = threshold or policy.default_admission_threshold(self.name)

    def make_queue(self) -> FCFSQueue | PolicyQueue:
        return PolicyQueue()

    def urgency(self, request: Request, now: float) -> float:
        return policy.urgency(request, now, self.params, self.ledger.counters)

    def order_key(self, request: Request, now: float) -> tuple:
        return policy.order_key(request, now, self.params, self.ledger.counters)

    def order(self, requests: Iterable[Request], now: float) -> Iterator[Request]:
        return iter(sorted(requests, key=lambda r: self.order_key(r, now)))

    def observe_wait(self, seconds: float) -> None:
        pass

    def prepare_step(self, requests: Iterable[Request]) -> None:
        pass

    def max_running(self, requests: Iterable[Request]) -> int | None:
        return None


class FCFSPolicy(_UrgencyPolicy):
    name = "fcfs"
    orders_by_urgency = False

    def make_queue(self) -> FCFSQueue | PolicyQueue:
        return FCFSQueue()


class PriorityPolicy(_UrgencyPolicy):
    """Lower priority values first, aged: linearly (`priority_aging_rate` levels per
    second), and so that no request waits more than `priority_aging` times the mean wait
    of recent requests (policy.bounded_wait_boost; the mean over the last admissions, fed
    by the scheduler with each admitted request's wait, `observe_wait`)."""

    name = "priority"
    _MEAN_WAIT_WINDOW = 512
    """Admissions the mean wait is taken over: long enough to be the workload's mean, not a
    burst's (a short average would follow the backlog of a burst and loosen the bound
    exactly when it matters)."""

    def __init__(self, params: policy.OrderParams, ledger: FairShareLedger,
                 admission_preemption: bool, threshold: float | None,
                 isolate_urgent_prefill: bool, wait_bound: float = 0.0) -> None:
        super().__init__(params, ledger, admission_preemption, threshold)
        self.isolates_urgent_prefill = isolate_urgent_prefill
        self.wait_bound = wait_bound
        self.mean_wait = 0.0
        self._waits: deque[float] = deque()
        self._waits_sum = 0.0
        self.most_urgent_priority = 0
        """The most urgent priority value among the requests (the scheduler sets it)."""

    def observe_wait(self, seconds: float) -> None:
        """A request was admitted after waiting this long."""
        self._waits.append(seconds)
        self._waits_sum += seconds
        if len(self._waits) > self._MEAN_WAIT_WINDOW:
            self._waits_sum -= self._waits.popleft()
        self.mean_wait = max(self._waits_sum, 0.0) / len(self._waits)

    def prepare_step(self, requests: Iterable[Request]) -> None:
        if self.wait_bound > 0:
            self.most_urgent_priority = min((r.priority for r in requests), default=0)

    def urgency(self, request: Request, now: float) -> float:
        waited = max(0.0, now - request.arrival_time)
        return (policy.priority_urgency(request, now, self.params.priority_aging_rate)
                - policy.bounded_wait_boost(waited, request.priority, self.most_urgent_priority,
                                            self.wait_bound, self.mean_wait))

    def order_key(self, request: Request, now: float) -> tuple:
        return (self.urgency(request, now), request.arrival_time, request.request_id)


class SRPTPolicy(_UrgencyPolicy):
    name = "srpt"


class FairPolicy(_UrgencyPolicy):
    name = "fair"

    def order(self, requests: Iterable[Request], now: float) -> Iterator[Request]:
        """Each tenant's requests oldest first; the next one from the tenant with the least
        service so far, picked again after every admission (which charges the tenant)."""
        by_tenant: dict[str, deque[Request]] = {}
        for request in sorted(requests, key=lambda r: (r.arrival_time, r.request_id)):
            by_tenant.setdefault(policy.tenant_of(request), deque()).append(request)
        while by_tenant:
            request = policy.next_fair((q[0] for q in by_tenant.values()),
                                       self.ledger.counters)
            tenant = policy.tenant_of(request)
            by_tenant[tenant].popleft()
            if not by_tenant[tenant]:
                del by_tenant[tenant]
            yield request


class MakespanPolicy(_UrgencyPolicy):
    """For a batch whose lengths are known (max_tokens or length hints, as in an offline
    run that ignores EOS): the longest remaining output first, and no more requests
    running than `policy.paced_rows` needs to finish the others within the longest one's
    steps (at least `min_rows`). Decode steps keep enough rows that their linears are not
    only reading weights, and the run does not end in a long tail of steps for the few
    longest requests. Never preempts at admission. Holding requests back costs their
    time to first token: it is meant for throughput, not for interactive serving."""

    name = "makespan"

    def __init__(self, params: policy.OrderParams, ledger: FairShareLedger,
                 admission_preemption: bool, threshold: float | None,
                 min_rows: int) -> None:
        super().__init__(params, ledger, admission_preemption, threshold)
        self.min_rows = min_rows

    def max_running(self, requests: Iterable[Request]) -> int | None:
        return policy.paced_rows((policy.remaining_outputs(r) for r in requests),
                                 self.min_rows)


def make_policy(config, ledger: FairShareLedger) -> SchedulingPolicy:
    """The policy a SchedulerConfig names, sharing the scheduler's fair-share ledger."""
    name = config.scheduling_policy
    params = policy.OrderParams(name, config.priority_aging_rate, config.srpt_aging_rate)
    args = (params, ledger, config.admission_preemption, config.admission_preemption_threshold)
    if name == "priority":
        return PriorityPolicy(*args, config.isolate_urgent_prefill, config.priority_aging)
    if name == "makespan":
        return MakespanPolicy(*args, config.makespan_min_rows)
    classes = {"fcfs": FCFSPolicy, "srpt": SRPTPolicy, "fair": FairPolicy}
    return classes[name](*args)
