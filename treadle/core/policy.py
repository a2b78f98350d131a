"""The pure functions of scheduling policy that every policy shares.

Each function looks at requests and numbers and returns a choice; none of them changes
state (the scheduler keeps the clock and passes it in). What to do under KV pressure
(victim loss, anti-thrash cooldown, recompute vs swap, running order), whom to preempt
for a more urgent waiting request, the head-of-line bypass bound, and the request
measures several policies use (tenant, remaining outputs). What is one policy's alone
(its urgency, its defaults) is in its class in `treadle.core.policies`. The scheduler
calls these; tests call them directly. The formulas are written out in
docs/scheduling.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Container, Sequence

from treadle.request import BATCH, Request


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


# ----- what the policies share: bands, tenants, remaining outputs, preemption at admission -----

def band_rank(request: Request) -> int:
    """0 for an interactive request, 1 for a batch one: the band comes before any policy's
    urgency (batch work runs after every interactive request, under every policy)."""
    return 1 if request.band == BATCH else 0


def yield_class(request: Request, scheduling_policy, now: float) -> tuple[int, int]:
    """The request's class for yielding (core/yield_share.py): its band, then the
    policy's class (`SchedulingPolicy.yield_class`); lower is more urgent."""
    return band_rank(request), scheduling_policy.yield_class(request, now)


DEFAULT_TENANT = "default"
"""The tenant of requests that name none."""


def tenant_of(request: Request) -> str:
    return request.tenant if request.tenant is not None else DEFAULT_TENANT


def remaining_outputs(request: Request) -> int:
    """Output tokens the request has still to generate, by its length hint when it has
    one, else by max_tokens."""
    target = (request.length_hint if request.length_hint is not None
              else request.sampling_params.max_tokens)
    return max(0, target - request.num_output_tokens)


def choose_admission_victim(candidate_urgency: float,
                            running: Sequence[tuple[Request, float]],
                            threshold: float,
                            protected: Container[str] = (),
                            candidate_band: int = 0,
                            same_band: bool = True) -> Request | None:
    """The running request to preempt for a waiting one, or None.

    Eligible: running requests of a lower band than the candidate's (a batch request for
    an interactive one: `band_rank`), whatever their urgency; and, when `same_band` (the
    policy preempts at admission), those of its own band at least `threshold` less urgent
    (`urgency(victim) - urgency(candidate) >= threshold`); never a protected one
    (anti-thrash: recently resumed or admitted by preemption; at its preemption bound).
    Of those, the lowest band first, then the least urgent; ties go to the latest
    arrival. A request never preempts one of a higher band.
    """
    def eligible(request: Request, urgency: float) -> bool:
        if request.request_id in protected:
            return False
        band = band_rank(request)
        if band != candidate_band:
            return band > candidate_band
        return same_band and urgency - candidate_urgency >= threshold

    chosen = [(r, u) for r, u in running if eligible(r, u)]
    if not chosen:
        return None
    return max(chosen, key=lambda ru: (band_rank(ru[0]), ru[1], ru[0].arrival_time,
                                       ru[0].request_id))[0]


def may_bypass(num_bypasses: int, max_bypasses: int) -> bool:
    """Whether requests behind a waiting request that does not fit may still be admitted
    past it; once it has been passed `max_bypasses` times it gets the next opening."""
    return num_bypasses < max_bypasses
