"""Scheduling policy as pure functions of request and cache state.

Each function looks at requests and numbers and returns a choice; none of them changes
state (the scheduler keeps the clock and the fair policy's counters and passes them in).
Two families: what to do under KV pressure (victim loss, anti-thrash cooldown, recompute
vs swap, running order) and the out-of-order scheduling policies (fcfs, priority with
aging, srpt with aging, fair share by virtual token counters, makespan's longest first
with paced admission, preemption at admission, head-of-line bypass). The scheduler
calls them; tests call them directly. The formulas are written out in
docs/scheduling.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

from treadle.config import SCHEDULING_POLICIES
from treadle.request import Request


class PreemptionMode(str, enum.Enum):
    """How a preempted request keeps (or loses) its KV."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True)
class VictimWeights:
    """Weights of the victim loss, in token-equivalents."""

    priority_weight: float = 1000.0
    """Loss added per priority level of urgency (a lower `priority` value is more urgent)."""
    wait_weight: float = 100.0
    """Loss added per second the request has spent in the engine."""


def victim_loss(request: Request, now: float, weights: VictimWeights) -> float:
    """What preempting this request would cost; the smallest loss is preempted first.

        loss = computed_tokens - priority_weight * priority + wait_weight * seconds_in_engine

    computed_tokens is the work the victim would lose (what a recompute must redo).
    Requests with a larger `priority` value (less urgent, vLLM's convention) lose less,
    and so do requests that arrived recently.
    """
    waited = max(0.0, now - request.arrival_time)
    return (request.num_computed_tokens - weights.priority_weight * request.priority
            + weights.wait_weight * waited)


def choose_victim(candidates: Sequence[Request], now: float, step: int,
                  weights: VictimWeights = VictimWeights(),
                  cooldown_steps: int = 0) -> Request:
    """The running request to preempt: the smallest loss, latest arrival on ties.

    Anti-thrash: a request resumed within the last `cooldown_steps` steps is only chosen
    when every candidate was resumed that recently.
    """
    if not candidates:
        raise ValueError("choose_victim needs at least one candidate")
    settled = [r for r in candidates
               if r.resumed_step is None or step - r.resumed_step >= cooldown_steps]
    pool = settled or list(candidates)
    return min(pool, key=lambda r: (victim_loss(r, now, weights), -r.arrival_time))


@dataclass(frozen=True)
class PreemptionCosts:
    """Measured rates behind the choice between recompute and swap."""

    flops_per_token: float
    """Forward FLOPs of one token (2 x parameters)."""
    compute_flops_per_s: float
    """Measured matmul rate of the model's dtype on this machine."""
    kv_bytes_per_token: int
    """Bytes of KV one token holds across all layers."""
    copy_bytes_per_s: float
    """Measured rate of copying KV blocks between device and swap memory."""

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.flops_per_token / self.compute_flops_per_s

    def swap_seconds(self, num_slots: int) -> float:
        """Out and back in again: both copies are paid."""
        return 2 * num_slots * self.kv_bytes_per_token / self.copy_bytes_per_s


def choose_preemption_mode(configured: str, num_computed_tokens: int, num_held_slots: int,
                           swap_has_room: bool, costs: PreemptionCosts | None) -> PreemptionMode:
    """recompute, swap or auto (the cheaper of the two by the measured costs).

    Swap needs room in the swap pool; without it every mode falls back to recompute.
    """
    if not swap_has_room or configured == PreemptionMode.RECOMPUTE.value:
        return PreemptionMode.RECOMPUTE
    if configured == PreemptionMode.SWAP.value or costs is None:
        return PreemptionMode.SWAP
    if costs.swap_seconds(num_held_slots) < costs.recompute_seconds(num_computed_tokens):
        return PreemptionMode.SWAP
    return PreemptionMode.RECOMPUTE


def running_order(running: Sequence[Request],
                  key: Callable[[Request], Any] | None = None) -> list[Request]:
    """Order in which running requests take the step's token budget: decodes first.

    A request with one uncomputed token is decoding (`Request.is_decoding`); one with
    more is mid-prefill (or recomputing). Decodes are cheap and latency-sensitive, so
    they never wait behind a prefill chunk. Within each group the order is kept
    (admission order), or follows `key` (the scheduling policy's order, most urgent
    first) when one is given.
    """
    if key is None:  # a stable partition: the order of sorted(key=not is_decoding)
        decodes = [r for r in running if r.is_decoding]
        if len(decodes) == len(running):
            return decodes
        return decodes + [r for r in running if not r.is_decoding]
    return sorted(running, key=lambda r: (not r.is_decoding, key(r)))


# ----- out-of-order scheduling: the order of requests and preemption at admission -------

DEFAULT_TENANT = "default"
"""The tenant of requests that name none."""

_DEFAULT_THRESHOLDS = {"priority": 0.5, "srpt": 256.0, "fair": 256.0}
"""Urgency gap needed to preempt at admission, per policy, in the policy's own unit.
Half a level for priority: one level apart, a fresh request still displaces one that has
aged less than half a level since it arrived."""


@dataclass(frozen=True)
class OrderParams:
    """What an ordering policy needs besides the requests and the clock: its name and its
    aging rates. (The fair policy's tenant weights only scale the counters' charges.)"""

    policy: str = "fcfs"
    priority_aging_rate: float = 0.0
    """Priority levels gained per second in the engine (priority)."""
    srpt_aging_rate: float = 0.0
    """Tokens of remaining work shed per second in the engine (srpt)."""

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError("scheduling policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}")


def tenant_of(request: Request) -> str:
    return request.tenant if request.tenant is not None else DEFAULT_TENANT


def remaining_work(request: Request) -> int:
    """Tokens the request still has to go through: the ones not in the KV cache (the rest
    of its prompt, or everything after a recompute preemption) plus the outputs it has not
    generated yet, by its length hint when it has one, else by max_tokens."""
    return request.num_uncomputed_tokens + remaining_outputs(request)


def remaining_outputs(request: Request) -> int:
    """Output tokens the request has still to generate, by its length hint when it has
    one, else by max_tokens."""
    target = (request.length_hint if request.length_hint is not None
              else request.sampling_params.max_tokens)
    return max(0, target - request.num_output_tokens)


def paced_rows(remaining: Iterable[int], min_rows: int) -> int:
    """The makespan policy's cap on running requests: enough that the remaining outputs
    of every request (`remaining`, one figure each) are spread over as many steps as the
    longest of them needs, and never fewer than `min_rows`.

    The longest request decodes one token a step however the others are scheduled, so
    the run lasts at least that many steps; `ceil(sum / max)` rows a step finish the
    others within them. Running more at once ends the short requests early and leaves the
    long ones to decode alone, in steps whose time goes to reading the weights for a few
    rows; running fewer stretches the run past the longest request."""
    total, longest = 0, 0
    for n in remaining:
        total += n
        longest = max(longest, n)
    if longest == 0:
        return max(min_rows, 1)
    return max(min_rows, -(-total // longest))


def priority_urgency(request: Request, now: float, aging_rate: float) -> float:
    """Effective priority: `priority - aging_rate * seconds_in_engine` (lower runs first).

    The order it gives among waiting requests never changes with time: a request of
    priority p arriving at a outranks every request of priority q arriving after
    a + (p - q) / aging_rate. That is the bound on how long aging lets it be passed.
    """
    return request.priority - aging_rate * max(0.0, now - request.arrival_time)


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


def srpt_urgency(request: Request, now: float, aging_rate: float) -> float:
    """Shortest remaining work first, aged: `remaining_work - aging_rate * seconds_in_engine`.

    A request with W tokens of work outranks every request of w tokens arriving more than
    (W - w) / aging_rate seconds after it.
    """
    return remaining_work(request) - aging_rate * max(0.0, now - request.arrival_time)


def urgency(request: Request, now: float, params: OrderParams,
            tenant_counters: Mapping[str, float] | None = None) -> float:
    """One number per request, lower is more urgent, in the policy's unit.

    fcfs: arrival time (seconds). priority: effective priority (levels). srpt: effective
    remaining work (tokens). fair: the tenant's virtual token counter (tokens / weight).
    makespan: minus the outputs still to generate (tokens; longest first).
    """
    if params.policy == "makespan":
        return -float(remaining_outputs(request))
    if params.policy == "priority":
        return priority_urgency(request, now, params.priority_aging_rate)
    if params.policy == "srpt":
        return srpt_urgency(request, now, params.srpt_aging_rate)
    if params.policy == "fair":
        return (tenant_counters or {}).get(tenant_of(request), 0.0)
    return request.arrival_time


def order_key(request: Request, now: float, params: OrderParams,
              tenant_counters: Mapping[str, float] | None = None) -> tuple:
    """Sort key of the policy: urgency, then arrival, then request id (a total order)."""
    return (urgency(request, now, params, tenant_counters), request.arrival_time,
            request.request_id)


def admission_order(requests: Iterable[Request], now: float, params: OrderParams,
                    tenant_counters: Mapping[str, float] | None = None) -> list[Request]:
    """The requests most urgent first, under the policy, as things stand at `now`.

    For `fair` this is the order of the next pick only: each admission charges its
    tenant's counter, so the scheduler picks again after every admission (`next_fair`).
    """
    return sorted(requests, key=lambda r: order_key(r, now, params, tenant_counters))


def next_fair(heads: Iterable[Request], tenant_counters: Mapping[str, float]) -> Request:
    """Of each tenant's oldest request, the one whose tenant has received the least
    service so far (the smallest virtual counter); ties go to the earliest arrival."""
    return min(heads, key=lambda r: (tenant_counters.get(tenant_of(r), 0.0),
                                     r.arrival_time, r.request_id))


def vtc_charge(counter: float, num_tokens: int, weight: float) -> float:
    """A tenant's virtual counter after it was served `num_tokens` (prompt or output):
    counters grow by tokens over weight, so a tenant of weight 3 is charged a third."""
    return counter + num_tokens / weight


def vtc_lift(counter: float, waiting_counters: Sequence[float],
             last_left_counter: float | None) -> float:
    """The counter of a tenant that starts waiting again (the VTC counter lift).

    It is raised to the smallest counter among tenants still waiting, or, with nobody
    waiting, to the counter of the tenant that left the queue last: a tenant that was
    away banks no credit to take from the others when it returns.
    """
    if waiting_counters:
        return max(counter, min(waiting_counters))
    if last_left_counter is not None:
        return max(counter, last_left_counter)
    return counter


def default_admission_threshold(policy: str) -> float:
    return _DEFAULT_THRESHOLDS.get(policy, float("inf"))


def preempts_at_admission(policy: str) -> bool:
    """fcfs never preempts for a waiting request: no waiting request is ahead in line of a
    running one by arrival. Nor does makespan: a running request loses nothing of its
    remaining length by waiting, so preempting it would only add work."""
    return policy not in ("fcfs", "makespan")


def choose_admission_victim(candidate_urgency: float,
                            running: Sequence[tuple[Request, float]],
                            threshold: float,
                            protected: Container[str] = ()) -> Request | None:
    """The running request to preempt for a waiting one, or None.

    Eligible: running requests at least `threshold` less urgent than the candidate
    (`urgency(victim) - urgency(candidate) >= threshold`) and not protected (anti-thrash:
    requests recently resumed or admitted by preemption). Of those, the least urgent;
    ties go to the latest arrival.
    """
    eligible = [(r, u) for r, u in running
                if u - candidate_urgency >= threshold and r.request_id not in protected]
    if not eligible:
        return None
    return max(eligible, key=lambda ru: (ru[1], ru[0].arrival_time, ru[0].request_id))[0]


def may_bypass(num_bypasses: int, max_bypasses: int) -> bool:
    """Whether requests behind a waiting request that does not fit may still be admitted
    past it; once it has been passed `max_bypasses` times it gets the next opening."""
    return num_bypasses < max_bypasses
