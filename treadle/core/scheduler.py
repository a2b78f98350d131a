"""The iteration-level scheduler: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a request budget
(`max_num_seqs`). Running decodes are served first. Then, under `fcfs`, unfinished
prefill chunks of running requests, swapped-out requests (oldest first) and waiting
requests in queue order; under `priority`, `srpt` and `fair`, running prefill chunks,
swapped-out and waiting requests share one order, most urgent first (`policy.urgency`):
a waiting request more urgent than a running one by the policy's threshold preempts the
least urgent running request (`policy.choose_admission_victim`, with anti-thrash
protection) instead of waiting for memory to run out. Under `priority`, a step that
prefills a request of a more urgent class gives no tokens to less urgent classes
(`isolate_urgent_prefill`), so the urgent first token is not held up by background
decodes and chunks. An admitted request takes its
prefix-cache hit first, then the uncached part, chunked to the remaining budget; under
`finish_prompts_first`, a step that already finishes a prompt takes no partial chunk of
another (it would delay that first token and cannot finish its own prompt anyway), and
the last chunk of a prompt split across steps takes no other prefill at all. A
request that does not fit in KV memory does not block smaller ones behind it, up to
`max_head_bypasses` times; then it gets the next opening.

When a running request needs a block and none is free, the victim of smallest loss
(`policy.choose_victim`) is preempted, by recompute (blocks freed, recomputed on resume)
or by swap (blocks copied to the swap pool), whichever `policy.choose_preemption_mode`
picks. After the step, `update_from_output` appends sampled tokens, finishes requests and
frees their blocks, so waiting requests join the very next step.

The scheduler owns request state transitions, the running/waiting/swapped sets, the
clock it passes to the policy functions and the fair policy's per-tenant counters. It
never touches tensors or the model (no torch import).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from treadle.config import CacheConfig, SchedulerConfig, parse_tenant_weights
from treadle.core import policy
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.outputs import (EngineCoreOutput, ModelRunnerOutput, ScheduledRequest,
                                  SchedulerOutput)
from treadle.core.request_queue import make_queue
from treadle.request import Request, RequestStatus

logger = logging.getLogger(__name__)

MAX_NO_FIT_PER_STEP = 32
"""Waiting requests that do not fit a step looks at before it stops trying (bounds the
work of a step when memory is full and the queue is long)."""


@dataclass
class SchedulerStats:
    """Running totals of what the scheduler did (read by metrics and benchmarks)."""

    num_steps: int = 0
    num_scheduled_requests: int = 0
    """Sum over steps of requests scheduled; / num_steps gives the mean batch size."""
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_admission_preemptions: int = 0
    """Preemptions made for a more urgent waiting request (also counted above)."""
    num_head_bypasses: int = 0
    """Admissions past a waiting request that did not fit."""
    num_swap_in: int = 0
    allocated_slots: int = 0
    """Sum over steps of KV token slots held by running requests."""
    used_slots: int = 0
    """Sum over steps of those slots holding a token (computed or scheduled)."""


def _is_decode(request: Request) -> bool:
    """One token to compute, after at least one generated: a decode, not a prompt's end."""
    return request.num_uncomputed_tokens == 1 and request.num_output_tokens > 0


class _Admission(enum.Enum):
    ADMITTED = "admitted"
    FULL = "full"
    """No request slot or no token left in this step: nothing behind can be admitted."""
    NO_FIT = "no_fit"
    """Too large for the free KV memory (or the budget, unchunked): smaller ones may fit."""
    DEFERRED = "deferred"
    """Held back by `finish_prompts_first` (see `Scheduler._holds_back`): it starts next
    step, and nothing behind it starts now."""


class Scheduler:
    """Chooses each step's batch under the token, sequence and KV-memory budgets."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_kv_blocks: int, max_model_len: int, num_swap_blocks: int = 0,
                 preemption_costs: policy.PreemptionCosts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_kv_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, num_swap_blocks)
        self.preemption_costs = preemption_costs
        self.victim_weights = policy.VictimWeights(scheduler_config.victim_priority_weight,
                                                   scheduler_config.victim_wait_weight)
        name = scheduler_config.scheduling_policy
        self.order_params = policy.OrderParams(name, scheduler_config.priority_aging_rate,
                                               scheduler_config.srpt_aging_rate)
        self.admission_threshold = (scheduler_config.admission_preemption_threshold
                                    or policy.default_admission_threshold(name))
        self.preempt_at_admission = (scheduler_config.admission_preemption
                                     and policy.preempts_at_admission(name))
        self.tenant_weights = parse_tenant_weights(scheduler_config.tenant_weights)
        self.tenant_counters: dict[str, float] = {}
        """fair policy: virtual tokens served per tenant (tokens / weight)."""
        self._num_queued: Counter[str] = Counter()
        """Per tenant, its requests waiting or swapped out (the fair policy's queue)."""
        self._last_left_tenant: str | None = None
        self._clock = clock
        self.waiting = make_queue(name)
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self._num_bypasses: dict[str, int] = {}
        self._protected_until: dict[str, int] = {}
        """Anti-thrash: step until which a request is not preempted for an admission."""
        self._chunked_prompts: set[str] = set()
        """Requests whose prompt has been split across steps and is not finished yet."""
        self.stats = SchedulerStats()

    # ----- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Weight of a tenant's share under the fair policy (unlisted tenants weigh 1)."""
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant weight must be a positive number, got {weight!r}")
        self.tenant_weights[tenant] = float(weight)

    def finish_request(self, request_id: str, status: RequestStatus,
                       error: str | None = None) -> Request | None:
        """End a request (abort or error) wherever it is; frees its blocks."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self._queued_out(request)
            self.kv.free_swapped(request)
        else:
            self.waiting.remove(request)
            self._queued_out(request)
        request.error = error
        self._end(request, status)
        return request

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        del self.requests[request.request_id]
        self._num_bypasses.pop(request.request_id, None)
        self._protected_until.pop(request.request_id, None)
        self._chunked_prompts.discard(request.request_id)
        self._finished_since_last_step.add(request.request_id)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Put a request in the waiting queue (new, or preempted by recompute)."""
        self._queued_in(request)
        if front:
            self.waiting.push_front(request)
        else:
            self.waiting.push_back(request)

    def _queued_in(self, request: Request) -> None:
        """Account a request entering the waiting or swapped set; a tenant that starts
        waiting again has its fair counter lifted (policy.vtc_lift)."""
        tenant = policy.tenant_of(request)
        if self._num_queued[tenant] == 0:
            waiting = [self.tenant_counters.get(t, 0.0)
                       for t, n in self._num_queued.items() if n > 0]
            last = (self.tenant_counters.get(self._last_left_tenant, 0.0)
                    if self._last_left_tenant is not None else None)
            self.tenant_counters[tenant] = policy.vtc_lift(
                self.tenant_counters.get(tenant, 0.0), waiting, last)
        self._num_queued[tenant] += 1

    def _queued_out(self, request: Request) -> None:
        tenant = policy.tenant_of(request)
        self._num_queued[tenant] -= 1
        if self._num_queued[tenant] == 0:
            del self._num_queued[tenant]
            self._last_left_tenant = tenant

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def urgency(self, request: Request, now: float | None = None) -> float:
        """The request's urgency under the configured policy (lower is more urgent)."""
        return policy.urgency(request, self._clock() if now is None else now,
                              self.order_params, self.tenant_counters)

    # ----- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._now = self._clock()
        self._step = self.stats.num_steps
        self._budget = self.config.max_num_batched_tokens
        self._num_new: dict[str, int] = {}
        self._preempted: list[Request] = []
        self._memory_victims: list[Request] = []
        self._admitted: set[str] = set()
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._finishes_prompt = False
        self._finishes_chunked_prompt = False
        if self.order_params.policy == "fcfs":
            self._schedule_fcfs()
        else:
            self._schedule_by_urgency()
        return self._build_output(self._num_new, self._preempted)

    def _schedule_fcfs(self) -> None:
        # 1. Running requests, decodes first. Each may preempt others to get a block.
        for request in policy.running_order(self.running):
            self._schedule_running(request)
        # 2. Swapped-out requests come back in, oldest first, before anything new.
        if self._preempted:
            return  # a step that had to preempt admits nothing
        while self.swapped:
            if self._try_admit(self.swapped[0]) is not _Admission.ADMITTED:
                return
        # 3. Waiting requests in queue order.
        self._admit_in_order(self.waiting.in_order())

    def _schedule_by_urgency(self) -> None:
        key = self._order_key
        # 1. Decodes: one token each, most urgent first.
        for request in policy.running_order(self.running, key):
            if request.num_uncomputed_tokens <= 1:
                self._schedule_running(request)
        # 2. Everything else that wants tokens, in one order: running prefill chunks,
        #    swapped-out and waiting requests, most urgent first.
        preempted = {r.request_id for r in self._preempted}
        items = [r for r in self.running if r.request_id not in self._num_new]
        items += [r for r in self.swapped if r.request_id not in preempted]
        items += [r for r in self.waiting if r.request_id not in preempted]
        if self.order_params.policy == "fair":
            self._admit_in_order(self._fair_order(items))
        else:
            self._admit_in_order(sorted(items, key=key))

    def _order_key(self, request: Request) -> tuple:
        return policy.order_key(request, self._now, self.order_params, self.tenant_counters)

    def _fair_order(self, items: list[Request]) -> Iterator[Request]:
        """Each tenant's requests oldest first; the next one from the tenant with the least
        service so far, picked again after every admission (which charges the tenant)."""
        by_tenant: dict[str, deque[Request]] = {}
        for request in sorted(items, key=lambda r: (r.arrival_time, r.request_id)):
            by_tenant.setdefault(policy.tenant_of(request), deque()).append(request)
        while by_tenant:
            request = policy.next_fair((q[0] for q in by_tenant.values()),
                                       self.tenant_counters)
            tenant = policy.tenant_of(request)
            by_tenant[tenant].popleft()
            if not by_tenant[tenant]:
                del by_tenant[tenant]
            yield request

    def _admit_in_order(self, items: Iterable[Request]) -> None:
        """Admit waiting and swapped requests in the given order (running ones in it get
        their prefill chunk). One that does not fit in memory is passed over, and counts
        a bypass for each admission behind it, until it has been passed
        `max_head_bypasses` times: then nothing behind it is admitted."""
        head: Request | None = None
        admitting = True
        num_no_fit = 0
        urgent: Request | None = None
        for request in items:
            if urgent is not None and self._defers_to(request, urgent):
                continue
            if request.status == RequestStatus.RUNNING:
                if request.request_id not in self._num_new:
                    self._schedule_running(request)
                    if urgent is None and request.request_id in self._num_new:
                        urgent = self._isolate(request)
                continue
            if (not admitting or request.request_id in self._admitted
                    or request in self._preempted):
                continue  # never re-admit in the step that preempted it
            if self._memory_victims and not self._outranks_memory_victims(request):
                continue
            outcome = self._try_admit(request)
            if outcome is _Admission.ADMITTED:
                urgent = urgent or self._isolate(request)
                if head is not None:
                    num_bypasses = self._num_bypasses.get(head.request_id, 0) + 1
                    self._num_bypasses[head.request_id] = num_bypasses
                    self.stats.num_head_bypasses += 1
                    admitting = policy.may_bypass(num_bypasses, self.config.max_head_bypasses)
                continue
            if outcome is _Admission.DEFERRED:
                admitting = False
                continue
            num_no_fit += 1
            if outcome is _Admission.FULL or num_no_fit >= MAX_NO_FIT_PER_STEP:
                admitting = False
            elif head is None:
                head = request
                admitting = policy.may_bypass(self._num_bypasses.get(request.request_id, 0),
                                              self.config.max_head_bypasses)

    def _isolate(self, urgent: Request) -> Request:
        """`urgent` is the first request given prefill tokens in this step (in urgency
        order): the decodes already scheduled that defer to it wait for the next step."""
        for request in self.running:
            if (request is not urgent and self._num_new.get(request.request_id) == 1
                    and request.num_uncomputed_tokens <= 1 and self._defers_to(request, urgent)):
                self._unschedule(request)
        return urgent

    def _defers_to(self, request: Request, urgent: Request) -> bool:
        """Whether `request` gets no tokens in a step that prefills `urgent`: under the
        priority policy with `isolate_urgent_prefill`, when it is of a less urgent
        priority class and less urgent by the admission threshold. The urgent request's
        first token then waits for its own chunk only, not for the background's decodes
        and chunks as well; they run in the next step (its blocks stay allocated)."""
        if not self.config.isolate_urgent_prefill or self.order_params.policy != "priority":
            return False
        return (request.priority > urgent.priority
                and self._urgency(request) - self._urgency(urgent) >= self.admission_threshold)

    def _outranks_memory_victims(self, request: Request) -> bool:
        """In a step that had to preempt for memory, only a request more urgent than every
        victim by the threshold is admitted (never the victims themselves)."""
        if self.order_params.policy == "fcfs":
            return False
        u = self._urgency(request)
        return all(self._urgency(v) - u >= self.admission_threshold
                   for v in self._memory_victims)

    def _urgency(self, request: Request) -> float:
        return policy.urgency(request, self._now, self.order_params, self.tenant_counters)

    def _schedule_running(self, request: Request) -> None:
        """Give a running request its tokens, preempting others if its blocks run short."""
        if request.status != RequestStatus.RUNNING or self._budget == 0:
            return
        num_tokens = min(request.num_uncomputed_tokens, self._budget)
        if self._holds_back(request, num_tokens < request.num_uncomputed_tokens):
            return
        while not self.kv.allocate_slots(request, num_tokens):
            # Any other running request can be the victim, even one already scheduled
            # in this step (its tokens go back to the budget): otherwise the request
            # that happens to come last would always preempt itself. Not one admitted in
            # this step, though: it came first in the policy's order.
            candidates = [r for r in self.running
                          if r is not request and r.request_id not in self._admitted]
            victim = request
            if candidates:
                victim = policy.choose_victim(
                    candidates, self._now, self._step, self.victim_weights,
                    self.config.preemption_cooldown_steps)
            self._preempt_now(victim)
            self._memory_victims.append(victim)
            if victim is request:
                return
        self._schedule_tokens(request, num_tokens)

    def _holds_back(self, request: Request, partial: bool) -> bool:
        """`finish_prompts_first`: whether prefill tokens of `request` (`partial`: not
        the rest of its prompt) wait for the next step because of what the step already
        finishes. On a compute-bound CPU a step's length is proportional to its tokens,
        and a prompt's first token comes out at the end of the step with its last chunk.

        - After any finishing prompt, a partial chunk waits: it would delay that first
          token by its share of the step, and its own prompt cannot finish now anyway;
          next step it gets the budget first. Whole prompts still share the step.
        - After the last chunk of a prompt split across earlier steps, every prefill
          waits: that request has already waited several steps (the likeliest tail of
          TTFT), and its last chunk is often a small remainder that another prompt
          would outweigh. The other prompt loses one step's fixed cost.
        Decodes are never held back."""
        if not self.config.finish_prompts_first or _is_decode(request):
            return False
        return self._finishes_chunked_prompt or (self._finishes_prompt and partial)

    def _schedule_tokens(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        if num_tokens < request.num_uncomputed_tokens:
            self._chunked_prompts.add(rid)
        elif not _is_decode(request):
            self._finishes_prompt = True  # its first (or first resumed) token comes out
            if rid in self._chunked_prompts:
                self._finishes_chunked_prompt = True
                self._chunked_prompts.discard(rid)
        self._num_new[rid] = num_tokens
        self._budget -= num_tokens
        tenant = policy.tenant_of(request)
        self.tenant_counters[tenant] = policy.vtc_charge(
            self.tenant_counters.get(tenant, 0.0), num_tokens,
            self.tenant_weights.get(tenant, 1.0))

    def _unschedule(self, request: Request) -> None:
        num_tokens = self._num_new.pop(request.request_id, 0)
        if num_tokens:
            self._budget += num_tokens
            tenant = policy.tenant_of(request)
            self.tenant_counters[tenant] = policy.vtc_charge(
                self.tenant_counters.get(tenant, 0.0), -num_tokens,
                self.tenant_weights.get(tenant, 1.0))

    def _preempt_now(self, victim: Request, reason: str = "for KV memory") -> None:
        self._unschedule(victim)
        self._preempt(victim, reason)
        self._preempted.append(victim)

    # ----- admission ----------------------------------------------------------------------

    def _try_admit(self, request: Request) -> _Admission:
        """Admit a waiting or swapped-out request if it fits, preempting less urgent
        running requests for it when the policy allows and that makes it fit."""
        swapped = request.status == RequestStatus.SWAPPED
        computed_blocks, num_hit_tokens = [], 0
        if not swapped and not self.kv.holds(request.request_id):
            computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
        outcome, num_tokens = self._fit(request, swapped, num_hit_tokens, computed_blocks)
        if (outcome not in (_Admission.ADMITTED, _Admission.DEFERRED)
                and self.preempt_at_admission):
            victims = self._plan_admission_victims(request, swapped, num_hit_tokens)
            if victims:
                for victim in victims:
                    self._preempt_now(victim, f"for more urgent {request.request_id}")
                    self.stats.num_admission_preemptions += 1
                outcome, num_tokens = self._fit(request, swapped, num_hit_tokens,
                                                computed_blocks)
                if outcome is _Admission.ADMITTED:
                    self._protected_until[request.request_id] = (
                        self._step + self.config.preemption_cooldown_steps)
        if outcome is not _Admission.ADMITTED:
            return outcome
        if swapped:
            self._admit_swapped(request)
        else:
            self._admit_waiting(request, num_tokens, num_hit_tokens, computed_blocks)
        self._admitted.add(request.request_id)
        self._num_bypasses.pop(request.request_id, None)
        return _Admission.ADMITTED

    def _may_chunk(self, request: Request) -> bool:
        """Whether this request's uncomputed tokens may be split across steps.

        `enable_chunked_prefill=False` keeps prompts whole; a request recomputing its
        prompt plus generated tokens after a preemption is always chunked, or one whose
        total outgrew the token budget could never resume.
        """
        return self.config.enable_chunked_prefill or request.num_output_tokens > 0

    def _fit(self, request: Request, swapped: bool, num_hit_tokens: int,
             computed_blocks: list) -> tuple[_Admission, int]:
        """Whether the request fits in this step now, and with how many tokens."""
        if len(self.running) >= self.config.max_num_seqs or self._budget == 0:
            return _Admission.FULL, 0
        if swapped:
            num_blocks = self.kv.num_swapped_slots(request.request_id) // self.kv.block_size
            if num_blocks > self.kv.pool.num_free_blocks:
                return _Admission.NO_FIT, 0
            return _Admission.ADMITTED, 0
        num_tokens = request.num_uncomputed_tokens - num_hit_tokens
        if num_tokens > self._budget and not self._may_chunk(request):
            return _Admission.NO_FIT, 0
        if self._holds_back(request, partial=num_tokens > self._budget):
            return _Admission.DEFERRED, 0
        num_tokens = min(num_tokens, self._budget)
        if not self.kv.can_allocate(request, num_tokens, computed_blocks):
            return _Admission.NO_FIT, 0
        return _Admission.ADMITTED, num_tokens

    def _plan_admission_victims(self, request: Request, swapped: bool,
                                num_hit_tokens: int) -> list[Request]:
        """Running requests to preempt so that `request` fits, least urgent first; empty
        when the eligible ones (policy.choose_admission_victim) would not make room."""
        u = self._urgency(request)
        protected = {rid for rid, until in self._protected_until.items() if until > self._step}
        protected |= self._admitted
        running = [(r, self._urgency(r)) for r in self.running]
        block_size = self.kv.block_size
        num_seqs = len(self.running)
        budget = self._budget
        free_blocks = self.kv.pool.num_free_blocks
        if swapped:
            need_tokens = 0
            base_blocks = self.kv.num_swapped_slots(request.request_id) // block_size
        else:
            need_tokens = request.num_uncomputed_tokens - num_hit_tokens
            base_blocks = (request.num_computed_tokens + num_hit_tokens) // block_size
        victims: list[Request] = []
        while True:
            victim = policy.choose_admission_victim(u, running, self.admission_threshold,
                                                    protected)
            if victim is None:
                return []
            running = [(r, ur) for r, ur in running if r is not victim]
            victims.append(victim)
            num_seqs -= 1
            budget += self._num_new.get(victim.request_id, 0)
            free_blocks += self.kv.num_allocated_slots(victim.request_id) // block_size
            if num_seqs >= self.config.max_num_seqs or budget == 0:
                continue
            if swapped:
                if base_blocks <= free_blocks:
                    return victims
                continue
            tokens = need_tokens
            if tokens > budget:
                if not self._may_chunk(request):
                    continue
                tokens = budget
            needed = (self.kv.num_blocks_for(request.num_computed_tokens + num_hit_tokens
                                             + tokens) - base_blocks)
            if needed <= free_blocks:
                return victims

    def _admit_waiting(self, request: Request, num_tokens: int, num_hit_tokens: int,
                       computed_blocks: list) -> None:
        allocated = self.kv.allocate_slots(request, num_tokens, computed_blocks)
        assert allocated, "_fit checked that the blocks are there"
        self.waiting.remove(request)
        self._queued_out(request)
        request.num_computed_tokens += num_hit_tokens
        if request.status == RequestStatus.PREEMPTED:
            self._resume(request)
        else:
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = self._now
            self.running.append(request)
        self._schedule_tokens(request, num_tokens)

    def _admit_swapped(self, request: Request) -> None:
        plan = self.kv.swap_in(request)
        assert plan is not None, "_fit checked that the blocks are there"
        self.swapped.remove(request)
        self._queued_out(request)
        self._swap_in.extend(plan)
        self.stats.num_swap_in += 1
        self._resume(request)
        num_tokens = min(request.num_uncomputed_tokens, self._budget)
        if (not self._holds_back(request, num_tokens < request.num_uncomputed_tokens)
                and self.kv.allocate_slots(request, num_tokens)):
            self._schedule_tokens(request, num_tokens)

    def _build_output(self, num_new_tokens: dict[str, int],
                      preempted: list[Request]) -> SchedulerOutput:
        scheduled = []
        for request in self.running:
            n = num_new_tokens.get(request.request_id)
            if n is None:
                continue
            start = request.num_computed_tokens
            scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.all_token_ids[start:start + n],
                num_computed_tokens=start,
                block_ids=self.kv.block_ids(request.request_id),
                sample=start + n == request.num_tokens,
                sampling_params=request.sampling_params,
                num_output_tokens=request.num_output_tokens,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
            ))
        scheduled.sort(key=lambda s: len(s.token_ids) > 1)  # decodes first
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        stats = self.stats
        if scheduled:
            stats.num_steps += 1
            stats.num_scheduled_requests += len(scheduled)
            stats.num_scheduled_tokens += sum(num_new_tokens.values())
            for request in self.running:
                stats.allocated_slots += self.kv.num_allocated_slots(request.request_id)
                stats.used_slots += request.num_computed_tokens + num_new_tokens.get(
                    request.request_id, 0)
        return SchedulerOutput(scheduled=scheduled, finished_request_ids=finished,
                               preempted_request_ids=[r.request_id for r in preempted],
                               swap_out=self._swap_out, swap_in=self._swap_in)

    def _resume(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.resumed_step = self.stats.num_steps
        self._protected_until[request.request_id] = (
            self.stats.num_steps + self.config.preemption_cooldown_steps)
        self.running.append(request)

    def _preempt(self, request: Request, reason: str = "for KV memory") -> None:
        """Take the request's KV away, by swap or recompute, and park the request."""
        self.running.remove(request)
        held_slots = self.kv.num_allocated_slots(request.request_id)
        mode = policy.choose_preemption_mode(
            self.config.preemption_mode, request.num_computed_tokens, held_slots,
            self.kv.can_swap_out(request), self.preemption_costs)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if mode == policy.PreemptionMode.SWAP:
            self._swap_out.extend(self.kv.swap_out(request))
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            self._queued_in(request)
            self.stats.num_preemptions_swap += 1
            logger.info("preempted request %s %s (mode=swap, %d tokens of KV swapped out)",
                        request.request_id, reason, request.num_computed_tokens)
        else:
            num_lost = request.num_computed_tokens
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self._enqueue(request, front=True)
            self.stats.num_preemptions_recompute += 1
            logger.info("preempted request %s %s (mode=recompute, %d computed tokens to "
                        "recompute)", request.request_id, reason, num_lost)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request; return one output per request with news."""
        outputs = []
        sampled = runner_output.sampled_token_ids
        for sched in scheduler_output.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(sched.token_ids)
            self.kv.cache_full_blocks(request)
            prompt_logprobs = runner_output.prompt_logprobs.get(sched.request_id)
            if not sched.sample:
                if prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(request.request_id, [],
                                                    new_prompt_logprobs=prompt_logprobs))
                continue
            token_id = sampled[sched.request_id]
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = self._clock()
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.running.remove(request)
                self._end(request, status)
            outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[token_id],
                finish_reason=request.finish_reason,
                new_logprobs=runner_output.logprobs.get(sched.request_id),
                new_prompt_logprobs=prompt_logprobs))
        return outputs
