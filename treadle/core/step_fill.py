"""Filling one step: the order requests are offered to it and the tokens each gets.

Owns the two orders a step is filled in (`fill_step`): under `fcfs` running requests,
then swapped-out ones (oldest first), then waiting ones in queue order
(`schedule_fcfs`); under every other policy decodes first, then running prefill chunks,
swapped-out and waiting requests in the policy's one order (`schedule_by_urgency`). In
both, batch requests come after every interactive one and take no tokens in a step that
prefills an interactive request. And the rules applied on the way: a running request's
tokens (`schedule_running`: its chunk, leaving room for short prompts behind a long one,
its proposed tokens, its blocks, preempting others when they run short), head-of-line
bypass with its bound (a preempted request is never passed), urgent-prefill isolation
(`_defers_to`), and what a step that had to preempt may still admit. Every function
takes the step's plan (core/step_plan.py); whether one request fits is admission's
(core/admission.py), whom to preempt for memory preemption's (core/preemption.py).
"""

from __future__ import annotations

from typing import Iterable

from treadle.core import policy
from treadle.core.admission import Admission, try_admit
from treadle.core.preemption import make_room
from treadle.core.step_plan import StepPlan
from treadle.request import BATCH, Request, RequestStatus

MAX_NO_FIT_PER_STEP = 32
"""Waiting requests that do not fit a step looks at before it stops trying (bounds the
work of a step when memory is full and the queue is long)."""


def fill_step(plan: StepPlan) -> None:
    """Fill the step in the policy's order (see the module)."""
    if plan.policy.orders_by_urgency:
        schedule_by_urgency(plan)
    else:
        schedule_fcfs(plan)


def schedule_fcfs(plan: StepPlan) -> None:
    """Running requests (decodes, then prefill chunks), swapped-out ones (oldest
    first), then waiting ones in queue order; a batch request's chunk, resume or
    admission after every interactive one's, and none in a step that prefills an
    interactive request (with `isolate_urgent_prefill`)."""
    idle = plan.idle_running()
    batch = [r for r in idle if r.band == BATCH]
    interactive = [r for r in idle if r.band != BATCH] if batch else idle
    # 1. Running requests, decodes first. Each may preempt others to get a block.
    for request in policy.running_order(interactive):
        schedule_running(plan, request)
    for request in batch:
        if request.is_decoding:
            schedule_running(plan, request)
    urgent = next((r for r in interactive
                   if not r.is_decoding and r.request_id in plan.num_new), None)
    # 2. Interactive swapped-out requests, then waiting ones.
    urgent = _admit_band_fcfs(plan, 0, urgent)
    if urgent is not None and plan.config.isolate_urgent_prefill:
        _isolate(plan, urgent)  # batch work waits for the next step
        return
    # 3. Batch work on what is left: prefill chunks, resumes, admissions.
    for request in batch:
        if not request.is_decoding:
            schedule_running(plan, request)
    _admit_band_fcfs(plan, 1, urgent)


def _admit_band_fcfs(plan: StepPlan, band: int,
                     urgent: Request | None) -> Request | None:
    """fcfs: the band's swapped-out requests come back in, oldest first, before
    anything new; then its waiting requests in queue order. Nothing of a band at or
    below a memory victim's is admitted in a step that had to preempt. Returns the
    first request given prefill tokens in the step (`urgent`, as given if any)."""
    if plan.memory_victims and min(map(policy.band_rank, plan.memory_victims)) <= band:
        return urgent
    for request in [r for r in plan.swapped if policy.band_rank(r) == band]:
        if _try_admit(plan, request) is not Admission.ADMITTED:
            return urgent
        if urgent is None and request.request_id in plan.num_new:
            urgent = request
    return _admit_in_order(plan, plan.waiting.in_band(band), urgent)


def schedule_by_urgency(plan: StepPlan) -> None:
    now = plan.now
    order_key = plan.policy.order_key
    # 1. Decodes: one token each (plus any proposed tokens), most urgent first.
    for request in policy.running_order(plan.idle_running(), lambda r: order_key(r, now)):
        if request.is_decoding:
            schedule_running(plan, request)
    # 2. Everything else that wants tokens, in one order: running prefill chunks,
    #    swapped-out and waiting requests, most urgent first.
    preempted = {r.request_id for r in plan.preempted}
    items = [r for r in plan.idle_running() if r.request_id not in plan.num_new]
    items += [r for r in plan.swapped if r.request_id not in preempted]
    items += [r for r in plan.waiting if r.request_id not in preempted]
    _admit_in_order(plan, plan.policy.order(items, now))


def _admit_in_order(plan: StepPlan, items: Iterable[Request],
                    urgent: Request | None = None) -> Request | None:
    """Admit waiting and swapped requests in the given order (running ones in it get
    their prefill chunk). One that does not fit in memory is passed over, and counts
    a bypass for each admission behind it, until it has been passed
    `max_head_bypasses` times: then nothing behind it is admitted. `urgent`: the
    first request given prefill tokens in the step so far (what the others may defer
    to, `_defers_to`); returned, as this call leaves it."""
    head: Request | None = None
    admitting = True
    num_no_fit = 0
    max_bypasses = plan.config.max_head_bypasses
    for request in items:
        if urgent is not None and _defers_to(plan, request, urgent):
            continue
        rid = request.request_id
        if request.status == RequestStatus.RUNNING:
            if rid not in plan.num_new:
                schedule_running(plan, request)
                if urgent is None and rid in plan.num_new:
                    urgent = _isolate(plan, request)
            continue
        if not admitting or rid in plan.admitted or request in plan.preempted:
            continue  # never re-admit in the step that preempted it
        if plan.memory_victims and not _outranks_memory_victims(plan, request):
            continue
        outcome = _try_admit(plan, request)
        if outcome is Admission.ADMITTED:
            urgent = urgent or _isolate(plan, request)
            if head is not None:
                num_bypasses = plan.num_bypasses.get(head.request_id, 0) + 1
                plan.num_bypasses[head.request_id] = num_bypasses
                plan.stats.num_head_bypasses += 1
                admitting = policy.may_bypass(num_bypasses, max_bypasses)
            continue
        if outcome is Admission.DEFERRED:
            admitting = False
            continue
        num_no_fit += 1
        if outcome is Admission.FULL or num_no_fit >= MAX_NO_FIT_PER_STEP:
            admitting = False
        elif head is None:
            head = request
            # A preempted request keeps its place: nothing behind it passes it (vllm
            # #41951: preempted requests lost their place to newer arrivals).
            admitting = (request.num_preemptions == 0 and policy.may_bypass(
                plan.num_bypasses.get(rid, 0), max_bypasses))
    return urgent


def _try_admit(plan: StepPlan, request: Request) -> Admission:
    if plan.interactive_held and request.band == BATCH:
        return Admission.FULL  # what the interactive one waits for is not batch work's
    outcome = try_admit(plan, request)
    if outcome is Admission.ADMITTED:
        plan.num_bypasses.pop(request.request_id, None)
    elif request.band != BATCH:
        plan.interactive_held = True
    return outcome


def schedule_running(plan: StepPlan, request: Request) -> None:
    """Give a running request its tokens, preempting others if its blocks run short."""
    budget = plan.budget_for(request)
    if request.status is not RequestStatus.RUNNING or budget <= 0:
        return
    num_uncomputed = request.num_uncomputed_tokens
    num_tokens = min(num_uncomputed, budget)
    if num_uncomputed > budget and plan.waiting and not request.is_decoding:
        num_tokens = plan.short_prompt_room(request, num_tokens)
    if num_tokens == budget:  # (no room kept for short prompts: they would come first)
        num_tokens = plan.prompt_chunk(request, num_uncomputed, budget)
    eviction = plan.kv.eviction
    if eviction is not None:
        num_tokens = min(num_tokens, eviction.max_step_tokens)
    spec = plan.spec_tokens_for(request) if request.spec_token_ids else []
    num_tokens += len(spec)
    if plan.holds_back(request, num_tokens < num_uncomputed):
        return
    if eviction is not None:
        plan.compact(request, num_tokens)
    if make_room(plan, request, num_tokens):
        plan.schedule_tokens(request, num_tokens, spec)


def _isolate(plan: StepPlan, urgent: Request) -> Request:
    """`urgent` is the first request given prefill tokens in this step (in urgency
    order): the decodes already scheduled that defer to it wait for the next step."""
    for request in plan.running:
        if (request is not urgent and request.request_id in plan.num_new
                and request.is_decoding and _defers_to(plan, request, urgent)):
            plan.unschedule(request)
    return urgent


def _defers_to(plan: StepPlan, request: Request, urgent: Request) -> bool:
    """Whether `request` gets no tokens in a step that prefills `urgent`
    (`isolate_urgent_prefill`): a batch request in a step that prefills an
    interactive one, under every policy; and under the priority policy, one of a less
    urgent priority class and less urgent by the admission threshold. The urgent
    request's first token then waits for its own chunk only, not for the background's
    decodes and chunks as well; they run in the next step (its blocks stay
    allocated)."""
    band, urgent_band = policy.band_rank(request), policy.band_rank(urgent)
    if band != urgent_band:
        return band > urgent_band and plan.config.isolate_urgent_prefill
    if not plan.policy.isolates_urgent_prefill:
        return False
    return (request.priority > urgent.priority
            and plan.urgency(request) - plan.urgency(urgent)
            >= plan.policy.admission_threshold)


def _outranks_memory_victims(plan: StepPlan, request: Request) -> bool:
    """In a step that had to preempt for memory, only a request of a higher band
    than every victim's, or (a policy that orders by urgency) more urgent than every
    victim by the threshold, is admitted (never the victims themselves)."""
    band = policy.band_rank(request)
    peers = [v for v in plan.memory_victims if policy.band_rank(v) <= band]
    if not peers:
        return True
    if not plan.policy.orders_by_urgency or any(policy.band_rank(v) < band for v in peers):
        return False
    u = plan.urgency(request)
    return all(plan.urgency(v) - u >= plan.policy.admission_threshold for v in peers)
