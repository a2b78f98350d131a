"""Preemption: which running request gives up its KV memory, how, and what that does to the step.

Owns what happens when a running request needs a block and none is free (`make_room`):
the victim (`choose_memory_victim`: a batch request before any interactive one, never
one at its preemption bound while another will do, a tenant over its share first, then
the smallest loss by `policy.choose_victim` with the anti-thrash cooldown), the mode (`take_kv`: swap out or
free for recompute, by `policy.choose_preemption_mode` and the measured costs), and
carrying it out on the step (`preempt`: the victim's tokens leave the plan, its KV is
swapped out or freed, and it waits in the swapped set or at the front of the waiting
queue). Admission preempts its victims through `preempt` too (core/admission.py). Every
function takes the step's plan (core/step_plan.py) and the request; which requests run
is not decided here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from treadle.core import policy
from treadle.core.step_plan import StepPlan
from treadle.request import BATCH, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class TakenKV:
    """What preempting one request did to its KV."""

    mode: policy.PreemptionMode
    num_computed_tokens: int
    """Tokens it had computed (swapped out, or lost to recompute)."""
    swap_plan: list[tuple[int, int]] = field(default_factory=list)
    """(device block, swap block) copies the worker makes before the next forward pass."""


def make_room(plan: StepPlan, request: Request, num_tokens: int) -> bool:
    """Slots for `num_tokens` more of the running request, preempting others while its
    blocks run short; False when it had to preempt itself (nobody else was left)."""
    while not plan.kv.allocate_slots(request, num_tokens):
        victim = choose_memory_victim(plan, request)
        preempt(plan, victim)
        plan.memory_victims.append(victim)
        if victim is request:
            return False
    return True


def choose_memory_victim(plan: StepPlan, request: Request) -> Request:
    """Who is preempted so that `request` gets a block: any other running request,
    even one already scheduled in this step (its tokens go back to the budget),
    otherwise the request that happens to come last would always preempt itself; but
    not one admitted in this step (it came first in the policy's order). `request`
    itself when there is nobody else. In this order of preference:
    - batch requests before any interactive one; a batch request that needs a block
      takes it from another batch request or gives up its own, never an interactive
      request's;
    - never a request at its preemption bound (`max_preemptions`) while another will
      do (admission leaves room for such a request's whole remaining need, so this only
      runs out when blocks are shared);
    - with tenant KV shares, a tenant over its share before any other, its own request
      included;
    - the smallest loss (policy.choose_victim)."""
    candidates = [r for r in plan.idle_running()
                  if r is not request and r.request_id not in plan.admitted]
    batch = [r for r in candidates if r.band == BATCH]
    if batch:
        candidates = batch
    elif request.band == BATCH:
        return request
    unpinned = [r for r in candidates if not plan.is_pinned(r)]
    if not unpinned and not plan.is_pinned(request):
        return request
    candidates = unpinned or candidates
    over_share = plan.over_share()
    if over_share:
        greedy = [r for r in candidates if policy.tenant_of(r) in over_share]
        if (policy.tenant_of(request) in over_share and not greedy
                and not plan.is_pinned(request)):
            return request
        candidates = greedy or candidates
    if not candidates:
        return request
    config = plan.config
    weights = policy.VictimWeights(config.victim_priority_weight, config.victim_wait_weight)
    return policy.choose_victim(candidates, plan.now, plan.step, weights,
                                config.preemption_cooldown_steps)


def take_kv(plan: StepPlan, request: Request) -> TakenKV:
    """Swap the request's KV out or free it for recompute, whichever is cheaper (or
    as configured)."""
    kv = plan.kv
    held_slots = kv.num_allocated_slots(request.request_id)
    mode = policy.choose_preemption_mode(
        plan.config.preemption_mode, request.num_computed_tokens, held_slots,
        kv.can_swap_out(request), plan.preemption_costs)
    taken = TakenKV(mode, request.num_computed_tokens)
    if mode == policy.PreemptionMode.SWAP:
        taken.swap_plan = kv.swap_out(request)
    else:
        kv.free(request)
    return taken


def preempt(plan: StepPlan, request: Request, reason: str = "for KV memory") -> None:
    """Take the running request's KV away, by swap or recompute, and park the request:
    swapped out, or back at the front of the waiting queue with nothing computed."""
    plan.unschedule(request)
    plan.running.remove(request)
    plan.kv_reserve = None  # one running request fewer to leave room for
    taken = take_kv(plan, request)
    rid = request.request_id
    plan.tables_changed.add(rid)
    request.spec_token_ids = []
    request.num_preemptions += 1
    request.queued_since = plan.now  # it waits again (and ages again: policies/priority.py)
    stats = plan.stats
    stats.num_preemptions += 1
    if taken.mode == policy.PreemptionMode.SWAP:
        plan.swap_out.extend(taken.swap_plan)
        plan.swapped_out.append(rid)
        request.status = RequestStatus.SWAPPED
        plan.swapped.append(request)
        plan.fair_share.queued_in(request)
        stats.num_preemptions_swap += 1
        logger.info("preempted request %s %s (mode=swap, %d tokens of KV swapped out)",
                    rid, reason, taken.num_computed_tokens)
    else:
        request.status = RequestStatus.PREEMPTED
        if plan.spec is not None:
            plan.spec.draft_lost(rid)
        request.num_computed_tokens = 0
        request.num_evicted_tokens = 0
        plan.compactions.pop(rid, None)  # its KV is gone anyway
        plan.fair_share.queued_in(request)
        plan.waiting.push_front(request)
        stats.num_preemptions_recompute += 1
        logger.info("preempted request %s %s (mode=recompute, %d computed tokens to "
                    "recompute)", rid, reason, taken.num_computed_tokens)
    plan.preempted.append(request)
