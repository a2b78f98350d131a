"""The fair policy's ledger: virtual token counters per tenant (VTC, Sheng et al. 2024).

Owns each tenant's counter (tokens served over its weight), the tenants' weights, and
which tenants have requests queued (waiting or swapped out), which the counter lift
needs. The scheduler charges it for every token it schedules and tells it when a request
enters or leaves the queues; the formulas are the pure functions below (`vtc_charge`,
`vtc_lift`), and each tenant's share of the KV cache under `tenant_kv_share`
(`tenant_share_blocks`, by the same weights). The fair policy (core/policies/fair.py)
orders by these counters; nothing here decides which request runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from treadle.core import policy
from treadle.request import Request


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


def tenant_share_blocks(num_blocks: int, weight: float, active_weights: float) -> int:
    """A tenant's share of the cache's blocks while the tenants of `active_weights`
    (their summed weights, its own included) compete for it (`tenant_kv_share`)."""
    return int(num_blocks * weight / active_weights)


class FairShareLedger:
    """Virtual token counters of the tenants, with the counter lift on re-arrival."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights: dict[str, float] = dict(weights or {})
        self.counters: dict[str, float] = {}
        """Virtual tokens served per tenant (tokens / weight)."""
        self.num_queued: Counter[str] = Counter()
        """Requests waiting or swapped out, per tenant with any."""
        self._last_left: str | None = None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def set_weight(self, tenant: str, weight: float) -> None:
        """Weight of a tenant's share (unlisted tenants weigh 1)."""
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant weight must be a positive number, got {weight!r}")
        self.weights[tenant] = float(weight)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge(self, request: Request, num_tokens: int) -> None:
        """Account tokens scheduled for the request (negative: tokens given back)."""
        # policy.tenant_of and vtc_charge, inlined: called for every request of
        # every step.
        tenant = request.tenant if request.tenant is not None else policy.DEFAULT_TENANT
        counters = self.counters
        counters[tenant] = counters.get(tenant, 0.0) + num_tokens / self.weights.get(tenant, 1.0)

    def queued_in(self, request: Request) -> None:
        """A request enters the waiting or swapped set; a tenant that starts waiting again
        has its counter lifted (vtc_lift)."""
        tenant = policy.tenant_of(request)
        if self.num_queued[tenant] == 0:
            waiting = [self.counter(t) for t, n in self.num_queued.items() if n > 0]
            last = self.counter(self._last_left) if self._last_left is not None else None
            self.counters[tenant] = vtc_lift(self.counter(tenant), waiting, last)
        self.num_queued[tenant] += 1

    def queued_out(self, request: Request) -> None:
        """A request leaves the waiting or swapped set (admitted, or ended)."""
        tenant = policy.tenant_of(request)
        self.num_queued[tenant] -= 1
        if self.num_queued[tenant] == 0:
            del self.num_queued[tenant]
            self._last_left = tenant
