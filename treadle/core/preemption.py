"""Preemption under KV pressure: which running request gives up its memory, and how.

Owns the two decisions the scheduler makes when a running request needs a block and
none is free: the victim (`choose_memory_victim`: the smallest loss by
`policy.choose_victim`, with the anti-thrash cooldown) and the mode (`take_kv`: swap out
or free for recompute, by `policy.choose_preemption_mode` and the measured costs), and
carries out the KV side of the mode. Where the preempted request goes next (the swapped
set or the front of the waiting queue) and the step's bookkeeping stay with the
scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Sequence

from treadle.config import SchedulerConfig
from treadle.core import policy
from treadle.core.kv.manager import KVCacheManager
from treadle.request import Request


@dataclass
class TakenKV:
    """What preempting one request did to its KV."""

    mode: policy.PreemptionMode
    num_computed_tokens: int
    """Tokens it had computed (swapped out, or lost to recompute)."""
    swap_plan: list[tuple[int, int]] = field(default_factory=list)
    """(device block, swap block) copies the worker makes before the next forward pass."""


class Preemptor:
    """Chooses memory victims and takes their KV away."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig,
                 costs: policy.PreemptionCosts | None) -> None:
        self.kv = kv
        self.config = config
        self.costs = costs
        self.weights = policy.VictimWeights(config.victim_priority_weight,
                                            config.victim_wait_weight)

    def choose_memory_victim(self, request: Request, running: Sequence[Request],
                             admitted: Container[str], now: float, step: int,
                             over_share: Container[str] = ()) -> Request:
        """Who is preempted so that `request` gets a block: any other running request,
        even one already scheduled in this step (its tokens go back to the budget),
        otherwise the request that happens to come last would always preempt itself; but
        not one admitted in this step (it came first in the policy's order). `request`
        itself when there is nobody else. With tenant KV shares, a tenant over its share
        gives up memory before any other (`over_share`), its own request included."""
        candidates = [r for r in running
                      if r is not request and r.request_id not in admitted]
        if over_share:
            greedy = [r for r in candidates if policy.tenant_of(r) in over_share]
            if policy.tenant_of(request) in over_share and not greedy:
                return request
            candidates = greedy or candidates
        if not candidates:
            return request
        return policy.choose_victim(candidates, now, step, self.weights,
                                    self.config.preemption_cooldown_steps)

    def take_kv(self, request: Request) -> TakenKV:
        """Swap the request's KV out or free it for recompute, whichever is cheaper (or
        as configured); the request's own state is the scheduler's to change."""
        held_slots = self.kv.num_allocated_slots(request.request_id)
        mode = policy.choose_preemption_mode(
            self.config.preemption_mode, request.num_computed_tokens, held_slots,
            self.kv.can_swap_out(request), self.costs)
        taken = TakenKV(mode, request.num_computed_tokens)
        if mode == policy.PreemptionMode.SWAP:
            taken.swap_plan = self.kv.swap_out(request)
        else:
            self.kv.free(request)
        return taken
