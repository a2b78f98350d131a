"""Fair share between tenants by virtual token counters (VTC, Sheng et al. 2024).

A request's urgency is its tenant's counter: the tokens the tenant has been served over
its weight (core/fair_share.py keeps the counters). Each tenant's requests go oldest
first; the next request comes from the tenant served least so far, picked again after
every admission (which charges the tenant). A waiting request whose tenant is behind by
the threshold (256 virtual tokens by default) may preempt a running one.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar, Iterable, Iterator, Mapping

from treadle.core.policies.base import SchedulingPolicy
from treadle.core.policy import band_rank, tenant_of
from treadle.request import Request


def next_fair(heads: Iterable[Request], tenant_counters: Mapping[str, float]) -> Request:
    """Of each tenant's oldest request, the one whose tenant has received the least
    service so far (the smallest virtual counter); ties go to the earliest arrival."""
    return min(heads, key=lambda r: (tenant_counters.get(tenant_of(r), 0.0),
                                     r.arrival_time, r.request_id))


class FairPolicy(SchedulingPolicy):
    """Urgency: the tenant's virtual token counter (tokens / weight)."""

    default_admission_threshold: ClassVar[float] = 256.0

    def urgency(self, request: Request, now: float) -> float:
        return self.ledger.counters.get(tenant_of(request), 0.0)

    def order(self, requests: Iterable[Request], now: float) -> Iterator[Request]:
        """Each tenant's requests oldest first; the next one from the tenant with the least
        service so far, picked again after every admission (which charges the tenant).
        Every interactive request comes before any batch one."""
        bands: tuple[list[Request], list[Request]] = ([], [])
        for request in requests:
            bands[band_rank(request)].append(request)
        for band in bands:
            yield from self._fair_order(band)

    def _fair_order(self, requests: list[Request]) -> Iterator[Request]:
        by_tenant: dict[str, deque[Request]] = {}
        for request in sorted(requests, key=lambda r: (r.arrival_time, r.request_id)):
            by_tenant.setdefault(tenant_of(request), deque()).append(request)
        while by_tenant:
            request = next_fair((q[0] for q in by_tenant.values()), self.ledger.counters)
            tenant = tenant_of(request)
            by_tenant[tenant].popleft()
            if not by_tenant[tenant]:
                del by_tenant[tenant]
            yield request


POLICY = FairPolicy
"""The policy of this module (what `policy_class` loads for its name)."""
