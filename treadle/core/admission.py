"""Admission: whether a waiting or swapped-out request joins the step, which running requests
to preempt so that a more urgent one does, and taking it in.

Owns `try_admit(plan, request)`, which the scheduler calls for each request it offers
the step in its policy's order, and the questions behind it: `fit` (is there a request
slot, budget and KV memory for it in this step, and with how many tokens — the memory
with headroom: a watermark plus the growth the running requests and this one can be
expected to need soon, `kv_growth`, so that admitting it rarely forces preempting
another; and within its tenant's share of the cache when tenants compete) and
`plan_admission_victims` (the least urgent running requests whose memory and budget
would make it fit, under `policy.choose_admission_victim`: batch requests for an
interactive one under every policy, less urgent ones of its own band where the policy
preempts at admission). A request at its preemption bound (`StepPlan.is_pinned`) is
resumed only when the cache can hold it to its end beside the other pinned requests'
remaining needs, which every admission leaves free (`pinned_reserve`), and is never a
victim again: so no request is preempted more than `max_preemptions` times. Block
arithmetic is the KV manager's (`KVCacheManager.num_new_blocks_needed`,
`num_held_blocks`, `num_swapped_blocks`); this module only adds up what it answers.
Every function takes the step's plan (core/step_plan.py) and the request; the order
requests are offered in is the scheduler's (core/step_fill.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from treadle.core import policy
from treadle.core.kv.block_pool import KVBlock
from treadle.core.kv.manager import KVCacheManager
from treadle.core.preemption import preempt
from treadle.core.step_plan import StepPlan
from treadle.request import BATCH, Request, RequestStatus


class Admission(enum.Enum):
    ADMITTED = "admitted"
    FULL = "full"
    """No request slot or no token left in this step: nothing behind can be admitted."""
    NO_FIT = "no_fit"
    """Too large for the free KV memory (or the budget, unchunked): smaller ones may fit."""
    DEFERRED = "deferred"
    """Held back by `finish_prompts_first` (see `StepPlan.holds_back`): it starts next
    step, and nothing behind it starts now."""


@dataclass
class StepRoom:
    """What is left of the step for admissions."""

    budget: int
    """Tokens left in the step's budget."""
    num_running: int
    max_num_seqs: int
    kv_reserve: int = 0
    """Free blocks an admission must leave (watermark + expected growth of the running
    requests); 0 with nothing running, so that something always runs."""
    lookahead_tokens: int = 0
    """Tokens of its own growth an admitted request must also find room for."""
    tenant_room: int | None = None
    """Blocks the request's tenant may still take (its share, when tenants compete)."""

    @property
    def full(self) -> bool:
        return self.num_running >= self.max_num_seqs or self.budget == 0


@dataclass(slots=True)
class PrefixHit:
    """The cached prefix a waiting request starts from (none for a swapped-out one: its
    own blocks come back)."""

    num_tokens: int
    blocks: list[KVBlock]


def try_admit(plan: StepPlan, request: Request) -> Admission:
    """Admit a waiting or swapped-out request if it fits, preempting running requests for
    it when that makes it fit: batch ones for an interactive request (under every
    policy, at once), less urgent ones of its band where the policy preempts at
    admission (unless a slot frees soon)."""
    swapped = request.status == RequestStatus.SWAPPED
    if not _adapter_fits(plan, request):
        return Admission.NO_FIT  # preempting for it would not free a slot for sure
    kv = plan.kv
    if swapped or kv.holds(request.request_id):
        hit = PrefixHit(0, [])
    else:
        blocks, num_hit_tokens = kv.get_computed_blocks(request)
        hit = PrefixHit(num_hit_tokens, blocks)
    outcome, num_tokens = fit(plan, request, hit)
    if outcome not in (Admission.ADMITTED, Admission.DEFERRED):
        victims = _admission_victims(plan, request, hit)
        if victims:
            for victim in victims:
                preempt(plan, victim, f"for more urgent {request.request_id}")
                plan.stats.num_admission_preemptions += 1
            outcome, num_tokens = fit(plan, request, hit)
            if outcome is Admission.ADMITTED:
                plan.protected_until[request.request_id] = (
                    plan.step + plan.config.preemption_cooldown_steps)
    if outcome is not Admission.ADMITTED:
        return outcome
    if swapped:
        _admit_swapped(plan, request)
    else:
        _admit_waiting(plan, request, num_tokens, hit)
    plan.admitted.add(request.request_id)
    plan.kv_reserve = None  # one more running request to leave room for
    return Admission.ADMITTED


def _admission_victims(plan: StepPlan, request: Request, hit: "PrefixHit") -> list[Request]:
    """Whom to preempt so that `request` fits: batch requests alone first (an interactive
    request never waits for batch work, not even for a slot that frees soon), then, where
    the policy preempts at admission and no slot frees soon, less urgent ones too."""
    if not plan.config.admission_preemption:
        return []
    victims = []
    if request.band != BATCH and any(r.band == BATCH for r in plan.running):
        victims = plan_admission_victims(plan, request, hit, same_band=False)
    if not victims and plan.policy.preempts_at_admission and not _slot_frees_soon(plan):
        victims = plan_admission_victims(plan, request, hit)
    return victims


def _admit_waiting(plan: StepPlan, request: Request, num_tokens: int, hit: PrefixHit) -> None:
    allocated = plan.kv.allocate_slots(request, num_tokens, hit.blocks)
    assert allocated, "fit checked that the blocks are there"
    plan.waiting.remove(request)
    plan.fair_share.queued_out(request)
    request.num_computed_tokens += hit.num_tokens
    if request.status == RequestStatus.PREEMPTED:
        _resume(plan, request)
    else:
        request.num_cached_tokens = hit.num_tokens
        request.start_running(plan.now)
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = plan.now
        plan.policy.observe_wait(plan.now - request.arrival_time)
        plan.running.append(request)
    plan.schedule_tokens(request, num_tokens)


def _admit_swapped(plan: StepPlan, request: Request) -> None:
    kv = plan.kv
    swap_plan = kv.swap_in(request)
    assert swap_plan is not None, "fit checked that the blocks are there"
    plan.swapped.remove(request)
    plan.fair_share.queued_out(request)
    plan.swap_in.extend(swap_plan)
    plan.stats.num_swap_in += 1
    _resume(plan, request)
    num_tokens = plan.prompt_chunk(request, request.num_uncomputed_tokens,
                                   plan.budget_for(request))
    if kv.eviction is not None:
        # No compaction in the step it comes back (the worker compacts before the
        # swap-ins land): it may pass its budget by this one step's tokens.
        num_tokens = min(num_tokens, kv.eviction.max_step_tokens)
    if plan.holds_back(request, num_tokens < request.num_uncomputed_tokens):
        return
    while num_tokens > 0 and not kv.allocate_slots(request, num_tokens):
        num_tokens //= 2  # a smaller chunk where the whole one finds no blocks (fit
        # made sure of one token's)
    if num_tokens > 0 and not plan.holds_back(
            request, num_tokens < request.num_uncomputed_tokens):
        plan.schedule_tokens(request, num_tokens)


def _resume(plan: StepPlan, request: Request) -> None:
    """A preempted request runs again, protected from admission preemption for
    `preemption_cooldown_steps` steps."""
    request.start_running(plan.now)
    request.status = RequestStatus.RUNNING
    request.resumed_step = plan.step
    plan.protected_until[request.request_id] = plan.step + plan.config.preemption_cooldown_steps
    plan.running.append(request)


def _slot_frees_soon(plan: StepPlan) -> bool:
    """Whether a running request ends within admission_preemption_wait_steps steps
    (its remaining max_tokens bound them): a more urgent request then waits for it
    instead of preempting. In the overload soak, urgent arrivals preempted a running
    request 0.5 times per request while a request finished every ~0.2 s."""
    steps = plan.config.admission_preemption_wait_steps
    return steps > 0 and any(
        r.is_decoding and r.sampling_params.max_tokens - r.num_output_tokens <= steps
        for r in plan.running)


def _adapter_fits(plan: StepPlan, request: Request) -> bool:
    """Whether the request's adapter (if any) is in use by a running request, or a
    slot is free for it."""
    lora_id = request.lora_int_id
    if lora_id is None:
        return True
    in_use = {r.lora_int_id for r in plan.running}
    in_use.discard(None)
    return lora_id in in_use or len(in_use) < plan.max_loras


def pinned_reserve(plan: StepPlan) -> int:
    """Free blocks the running pinned requests may still need, to their last token: what
    every admission leaves free, so that a pinned request never lacks a block."""
    kv = plan.kv
    return sum(kv_growth(kv, r, kv.num_allocated_slots(r.request_id), plan.max_model_len)
               for r in plan.running if plan.is_pinned(r))


def step_room(plan: StepPlan, request: Request | None = None) -> StepRoom:
    """What is left of the step for admitting `request`: slots, budget, and the KV
    headroom (watermark + growth of the running requests, the pinned ones' to their end)
    and tenant share it must respect."""
    cfg = plan.config
    kv = plan.kv
    if plan.kv_reserve is None:
        reserve = 0
        if plan.running and (cfg.kv_watermark or cfg.admission_lookahead_tokens):
            reserve = int(cfg.kv_watermark * kv.num_blocks + 0.999999)
            for r in plan.running:
                if not plan.is_pinned(r):
                    reserve += kv_growth(kv, r, kv.num_allocated_slots(r.request_id),
                                         cfg.admission_lookahead_tokens)
        plan.kv_reserve = reserve + pinned_reserve(plan)
    tenant_room = None
    if cfg.tenant_kv_share and request is not None:
        tenant_room = plan.tenant_room(request)
    budget = plan.budget if request is None else plan.budget_for(request)
    return StepRoom(max(0, budget), len(plan.running), plan.max_running, plan.kv_reserve,
                    cfg.admission_lookahead_tokens if plan.running else 0, tenant_room)


def fit(plan: StepPlan, request: Request, hit: PrefixHit) -> tuple[Admission, int]:
    """Whether the request fits in this step now, and with how many tokens (after its
    prefix hit)."""
    kv = plan.kv
    room = step_room(plan, request)
    if room.full:
        return Admission.FULL, 0
    pinned = plan.is_pinned(request)
    lookahead = plan.max_model_len if pinned else room.lookahead_tokens
    if request.status == RequestStatus.SWAPPED:
        blocks = kv.num_swapped_blocks(request.request_id)
        # Room for its blocks and at least its next token: swapped in without room to
        # run, it held its blocks idle until the next request short of a block preempted
        # it again (a swap each way and a preemption spent for nothing, until its bound).
        step_blocks = max(0, kv.num_blocks_for(request.num_kv_tokens + 1) - blocks)
        growth = max(step_blocks, kv_growth(kv, request, blocks * kv.block_size, lookahead))
        if (blocks + growth + room.kv_reserve > kv.pool.num_free_blocks
                or (room.tenant_room is not None and blocks > room.tenant_room)):
            return Admission.NO_FIT, 0
        return Admission.ADMITTED, 0
    num_tokens = request.num_uncomputed_tokens - hit.num_tokens
    if num_tokens > room.budget and not plan.may_chunk(request):
        return Admission.NO_FIT, 0
    chunk = plan.prompt_chunk(request, num_tokens, room.budget, hit.blocks)
    if plan.holds_back(request, chunk < num_tokens):
        return Admission.DEFERRED, 0
    num_tokens = chunk
    if kv.eviction is not None:  # its steps are capped (kv_specs/eviction.py)
        num_tokens = min(num_tokens, kv.eviction.max_step_tokens)
    if not kv.can_allocate(request, num_tokens, hit.blocks):
        return Admission.NO_FIT, 0
    if kv.eviction is not None and not _budget_fits(kv, request, hit.blocks, room):
        return Admission.NO_FIT, 0
    if room.kv_reserve or lookahead or room.tenant_room is not None:
        needed = kv.num_new_blocks_needed(request, hit.num_tokens, num_tokens)
        if pinned:  # exact: hit blocks taken from the free queue leave it too
            needed += kv.pool.num_reusable_from_free(hit.blocks)
        slots = (request.num_computed_tokens + hit.num_tokens + num_tokens)
        growth = kv_growth(kv, request, kv.num_blocks_for(slots) * kv.block_size, lookahead)
        if ((room.kv_reserve or pinned)
                and needed + growth + room.kv_reserve > kv.pool.num_free_blocks):
            return Admission.NO_FIT, 0
        if room.tenant_room is not None and needed > room.tenant_room:
            return Admission.NO_FIT, 0
    return Admission.ADMITTED, num_tokens


def _budget_fits(kv: KVCacheManager, request: Request, computed_blocks: list[KVBlock],
                 room: StepRoom) -> bool:
    """With eviction a request's steps are small (kv_specs/eviction.py), yet it soon holds
    its whole budget: admit it only when that fits, or two such requests would take
    turns preempting each other a chunk at a time."""
    remaining = max(0, request.sampling_params.max_tokens - request.num_output_tokens)
    tokens = min(request.num_tokens + remaining, kv.eviction.budget_tokens)
    needed = (kv.num_blocks_for(tokens) - len(computed_blocks)
              + kv.pool.num_reusable_from_free(computed_blocks))
    return needed + room.kv_reserve <= kv.pool.num_free_blocks


def kv_growth(kv: KVCacheManager, request: Request, num_slots: int, lookahead: int) -> int:
    """Blocks beyond `num_slots` held token slots that the request can be expected to
    need soon: its tokens so far plus what it may still generate, at most `lookahead`
    tokens past what it holds (max_tokens is an upper bound, so the horizon is too)."""
    if lookahead <= 0:
        return 0
    remaining = max(0, request.sampling_params.max_tokens - request.num_output_tokens)
    future = min(request.num_tokens + remaining, num_slots + lookahead)
    if kv.eviction is not None:  # it never holds more than its budget
        future = min(future, max(kv.eviction.budget_tokens, num_slots))
    return max(0, kv.num_blocks_for(future) - num_slots // kv.block_size)


def plan_admission_victims(plan: StepPlan, request: Request, hit: PrefixHit,
                           same_band: bool = True) -> list[Request]:
    """Running requests to preempt so that `request` fits, lowest band and least urgent
    first; empty when the eligible ones (policy.choose_admission_victim: of a lower band;
    with `same_band`, of its own band and less urgent by the policy's threshold; not
    protected, not pinned) would not make room. A victim gives back its blocks and the
    tokens already scheduled for it this step. Batch victims ignore the anti-thrash
    protection: batch work yields whenever interactive work needs its room."""
    kv = plan.kv
    if same_band:
        protected = {rid for rid, until in plan.protected_until.items() if until > plan.step}
        protected |= plan.admitted
        protected |= {r.request_id for r in plan.running if plan.is_pinned(r)}
    else:  # batch victims only: none is pinned, and none is protected but this step's
        protected = set(plan.admitted)
    candidate_band = policy.band_rank(request)
    candidate_urgency = plan.urgency(request)
    running = [(r, plan.urgency(r)) for r in plan.idle_running()]
    threshold = plan.policy.admission_threshold
    room = step_room(plan)
    may_chunk = plan.may_chunk(request)
    swapped = request.status == RequestStatus.SWAPPED
    num_seqs = room.num_running
    budget = room.budget
    free_blocks = kv.pool.num_free_blocks - pinned_reserve(plan)
    need_tokens = 0 if swapped else request.num_uncomputed_tokens - hit.num_tokens
    victims: list[Request] = []
    while True:
        victim = policy.choose_admission_victim(candidate_urgency, running, threshold,
                                                protected, candidate_band, same_band)
        if victim is None:
            return []
        running = [(r, u) for r, u in running if r is not victim]
        victims.append(victim)
        num_seqs -= 1
        budget += plan.num_new.get(victim.request_id, 0)
        free_blocks += kv.num_held_blocks(victim.request_id)
        if num_seqs >= room.max_num_seqs or budget == 0:
            continue
        if swapped:
            if kv.num_swapped_blocks(request.request_id) <= free_blocks:
                return victims
            continue
        tokens = need_tokens
        if tokens > budget:
            if not may_chunk:
                continue
            tokens = budget
        if kv.eviction is not None:
            tokens = min(tokens, kv.eviction.max_step_tokens)
        if kv.num_new_blocks_needed(request, hit.num_tokens, tokens) <= free_blocks:
            return victims
