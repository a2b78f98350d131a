"""The iteration-level scheduler: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a request budget
(`max_num_seqs`, or less where the policy caps running requests: `makespan`'s
`max_running`). Running decodes are served first. Then, under `fcfs`, unfinished
prefill chunks of running requests, swapped-out requests (oldest first) and waiting
requests in queue order; under `priority`, `srpt`, `fair` and `makespan`, running prefill
chunks, swapped-out and waiting requests share one order, most urgent first
(`policy.urgency`): except under `makespan`, a waiting request more urgent than a running
one by the policy's threshold preempts the least urgent running request
(`policy.choose_admission_victim`, with anti-thrash protection) instead of waiting for
memory to run out. Under `priority`, a step that
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

A decoding request may carry proposed tokens (`Request.spec_token_ids`, speculative
decoding): they are scheduled with its last token within the budget, as many as
`core.spec_decode` plans from the request's measured acceptance and the measured step
costs, and `update_from_output` keeps the accepted ones and rolls back the rest (their
KV slots are freed; no rejected token reaches the prefix cache). Each step also tells the
worker how many tokens to propose for each sampled request's next step; with a proposer
that writes KV ahead (a draft model), the request's blocks hold slots for them.

With LoRA, the running requests never use more distinct adapters than the worker has
slots (`max_loras`), so neither does any step: a waiting or swapped-out request whose
adapter is not among the running ones' is admitted only while a slot is free; otherwise
it does not fit, exactly like a request too large for free memory (smaller ones pass it
at most `max_head_bypasses` times, then nothing behind it starts until its adapter fits).

The scheduler owns request state transitions, the running/waiting/swapped sets, the
clock it passes to the policy, and what the worker already holds of each request (so that
each step message carries only what changed: core/outputs.py). The policy's answers come
from `core.scheduling_policy`, the fair policy's counters from `core.fair_share`,
admission planning from `core.admission` and the choice of victim and preemption mode
from `core.preemption`. It never touches tensors or the model (no torch import).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from treadle.config import CacheConfig, SchedulerConfig, SpeculativeConfig, parse_tenant_weights
from treadle.core import policy
from treadle.core.admission import (Admission, StepRoom, fit, kv_growth,
                                    plan_admission_victims, tenant_share_blocks)
from treadle.core.fair_share import FairShareLedger
from treadle.core.kv.manager import KVCacheManager
from treadle.core.kv.eviction import EvictionBudget
from treadle.core.kv.config import LayerGroups
from treadle.core.kv.sliding import SlidingWindowGroup
from treadle.core.outputs import (EngineCoreOutput, KVCompaction, ModelRunnerOutput,
                                  NewRequestData, ScheduledRequest, SchedulerOutput)
from treadle.core.preemption import Preemptor
from treadle.core.scheduling_policy import make_policy
from treadle.core.spec_decode import (ProposalCandidate, SpecCandidate, SpecCosts,
                                      SpecDecodeController)
from treadle.request import FinishReason, Request, RequestStatus

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
    num_kv_compactions: int = 0
    """Heavy-hitter evictions (core/kv_eviction.py)."""
    num_evicted_tokens: int = 0
    """Tokens of KV they dropped."""
    allocated_slots: int = 0
    """Sum over steps of KV token slots held by running requests."""
    used_slots: int = 0
    """Sum over steps of those slots holding a token (computed or scheduled)."""


@dataclass
class _WorkerView:
    """What the worker holds of one request (what earlier step messages told it)."""

    num_tokens: int = 0
    """Tokens of the request the worker knows (prompt + generated)."""
    num_blocks: int = 0
    """Entries of the block table the worker knows."""
    table_stale: bool = False
    """The request's table changed other than by appending (preemption, rollback): the
    next message sends it whole."""


class Scheduler:
    """Chooses each step's batch under the token, sequence and KV-memory budgets."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_kv_blocks: int, max_model_len: int, num_swap_blocks: int = 0,
                 preemption_costs: policy.PreemptionCosts | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 speculative: SpeculativeConfig | None = None,
                 spec_costs: SpecCosts | None = None, max_loras: int = 0,
                 layer_groups: LayerGroups | None = None) -> None:
        """`speculative` with a method: proposed tokens are planned per request (from
        `spec_costs`, the worker's measurements, when the policy is adaptive).
        `max_loras`: adapter slots of the worker (0: no request has an adapter).
        `layer_groups`: the sliding-window layers' own block pool (num_kv_blocks is then
        the full layers' count), or None."""
        self.config = scheduler_config
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        sliding = (None if layer_groups is None else SlidingWindowGroup(
            layer_groups.num_sliding_blocks, cache_config.block_size, layer_groups.window))
        self.kv = KVCacheManager(num_kv_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, num_swap_blocks, sliding,
                                 EvictionBudget.from_cache_config(cache_config),
                                 cache_config.contiguous_blocks)
        self.preemption_costs = preemption_costs
        self.preemptor = Preemptor(self.kv, scheduler_config, preemption_costs)
        self.fair_share = FairShareLedger(parse_tenant_weights(scheduler_config.tenant_weights))
        self.policy = make_policy(scheduler_config, self.fair_share)
        self._clock = clock
        self.waiting = self.policy.make_queue()
        self.waiting_for_kv: dict[str, Request] = {}
        """P/D: requests whose prompt KV is on its way from a prefill engine."""
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self._num_bypasses: dict[str, int] = {}
        self._protected_until: dict[str, int] = {}
        """Anti-thrash: step until which a request is not preempted for an admission."""
        self._chunked_prompts: set[str] = set()
        """Requests whose prompt has been split across steps and is not finished yet."""
        self._worker_views: dict[str, _WorkerView] = {}
        self._in_flight: set[str] = set()
        """Requests in a step submitted to the workers and not yet answered (pipeline
        parallelism keeps several steps in flight): not scheduled, preempted or freed
        until it returns."""
        self._swapped_out: list[str] = []
        self._num_proposals: dict[str, int] = {}
        self._spec_plan: dict[str, int] = {}
        self._unrun: dict[str, tuple[int, int]] = {}
        """Deterministic proposals the plan did not run: (their first token, the request's
        num_tokens then), scored against the model's token when that step returns."""
        self._free_after_step: dict[str, Request] = {}
        """Requests that ended while in flight: their blocks are freed when the step
        returns (the workers may still be writing them)."""
        self.stats = SchedulerStats()
        self.spec: SpecDecodeController | None = None
        """Speculative decoding's plan and counters, when a proposer is configured."""
        if speculative is not None and speculative.enabled:
            self.spec = SpecDecodeController(
                speculative.num_speculative_tokens, speculative.adaptive,
                speculative.acceptance_prior, spec_costs, speculative.writes_kv_ahead,
                deterministic=speculative.method == "ngram")

    @property
    def tenant_weights(self) -> dict[str, float]:
        return self.fair_share.weights

    @property
    def tenant_counters(self) -> dict[str, float]:
        """fair policy: virtual tokens served per tenant (tokens / weight)."""
        return self.fair_share.counters

    # ----- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def add_remote_kv_request(self, request: Request) -> None:
        """P/D: a request prefilled on another engine, held in WAITING_FOR_REMOTE_KV
        (no queue place, no running slot, no blocks) until `remote_kv_arrived`."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.waiting_for_kv[request.request_id] = request

    def remote_kv_arrived(self, request_id: str) -> bool:
        """P/D: its KV landed (as prefix-cache blocks): the request joins the waiting
        queue, where admission finds them as a prefix hit. False if it is gone."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.WAITING
        self._enqueue(request)
        return True

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Weight of a tenant's share under the fair policy (unlisted tenants weigh 1)."""
        self.fair_share.set_weight(tenant, weight)

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
            self.fair_share.queued_out(request)
            self.kv.free_swapped(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request_id]
        else:
            self.waiting.remove(request)
            self.fair_share.queued_out(request)
        request.error = error
        self._end(request, status)
        return request

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.request_id in self._in_flight:
            self._free_after_step[request.request_id] = request
        else:
            self.kv.free(request)
            self.kv.forget(request)
        del self.requests[request.request_id]
        self._num_bypasses.pop(request.request_id, None)
        self._protected_until.pop(request.request_id, None)
        self._chunked_prompts.discard(request.request_id)
        self._worker_views.pop(request.request_id, None)
        if self.spec is not None:
            self.spec.forget(request.request_id)
            self._unrun.pop(request.request_id, None)
        self._finished_since_last_step.append(request.request_id)

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        """End a running request with finish reason 'error' (a per-request component of
        the worker failed for it); what its last step sampled is dropped."""
        self.running.remove(request)
        request.error = error
        self._end(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error,
                                num_cached_tokens=request.num_cached_tokens)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Put a request in the waiting queue (new, or preempted by recompute)."""
        self.fair_share.queued_in(request)
        if front:
            self.waiting.push_front(request)
        else:
            self.waiting.push_back(request)

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
        """Requests a step could serve (those waiting for remote KV need none yet)."""
        return len(self.requests) > len(self.waiting_for_kv)

    @property
    def num_in_flight(self) -> int:
        """Requests in submitted steps not answered yet."""
        return len(self._in_flight)

    def _idle_running(self) -> list[Request]:
        """Running requests not in a step in flight: the ones this step may touch."""
        if not self._in_flight:
            return self.running
        return [r for r in self.running if r.request_id not in self._in_flight]

    def urgency(self, request: Request, now: float | None = None) -> float:
        """The request's urgency under the configured policy (lower is more urgent)."""
        return self.policy.urgency(request, self._clock() if now is None else now)

    # ----- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._now = self._clock()
        self._step = self.stats.num_steps
        self._budget = self.config.max_num_batched_tokens
        self._num_new: dict[str, int] = {}
        self._spec: dict[str, list[int]] = {}
        """Proposed tokens scheduled per request (counted in _num_new)."""
        self._num_recomputed = 0
        self._kv_reserve: int | None = None
        """This step's KV headroom for admissions (StepRoom.kv_reserve), made on first use."""
        self._preempted: list[Request] = []
        self._memory_victims: list[Request] = []
        self._admitted: set[str] = set()
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._compactions: dict[str, KVCompaction] = {}
        self._finishes_prompt = False
        self._finishes_chunked_prompt = False
        self.policy.prepare_step(self.requests.values())
        cap = self.policy.max_running(self.requests.values())
        self._max_running = (self.config.max_num_seqs if cap is None
                             else min(cap, self.config.max_num_seqs))
        """Running requests admissions may bring the step to (a policy may pace them)."""
        self._swapped_out: list[str] = []
        self._spec_plan: dict[str, int] = self._plan_spec_tokens()
        if self.policy.orders_by_urgency:
            self._schedule_by_urgency()
        else:
            self._schedule_fcfs()
        self._num_proposals = self._plan_proposals()
        return self._build_output(self._num_new, self._preempted)

    # ----- speculative decoding ----------------------------------------------------------

    def _speculates(self, request: Request) -> bool:
        return self.spec is not None and request.sampling_params.speculative

    def _spec_room(self, request: Request, num_after: int) -> int:
        """Proposed tokens that may still become output once `num_after` more tokens
        are in: at most max_tokens - 1 more (one token is always the model's) and within
        the context."""
        return min(self.max_model_len - request.num_tokens - num_after + 1,
                   request.sampling_params.max_tokens - request.num_output_tokens - num_after)

    def _plan_spec_tokens(self) -> dict[str, int]:
        """The proposed tokens each decoding request runs this step (core.spec_decode),
        for a step like this one: its decodes, plus the prefill tokens waiting for it."""
        if self.spec is None:
            return {}
        idle = self._idle_running()
        decodes = [r for r in idle if r.is_decoding]
        candidates = []
        for r in decodes:
            if r.spec_token_ids and self._speculates(r):
                room = min(len(r.spec_token_ids), self._spec_room(r, 0) - 1)
                if room > 0:
                    candidates.append(SpecCandidate(r.request_id, room))
        if not candidates:
            return {}
        budget = self.config.max_num_batched_tokens
        base = len(decodes) + self._pending_prefill_tokens(budget - len(decodes), idle)
        return self.spec.tokens_to_run(candidates, len(decodes), min(base, budget), budget)

    def _pending_prefill_tokens(self, room: int, running: list[Request]) -> int:
        """Prompt tokens (and tokens to recompute) left to prefill once this step's
        scheduled ones are in (none yet while planning its start), up to `room`: of the
        `running` requests mid-prompt, of swapped and of waiting ones."""
        total = 0
        for group in (running, self.swapped, self.waiting):
            for r in group:
                if group is running and r.is_decoding:
                    continue
                total += max(r.num_uncomputed_tokens - self._num_new.get(r.request_id, 0), 0)
                if total >= room:
                    return max(room, 0)
        return total

    def _plan_proposals(self) -> dict[str, int]:
        """Tokens to propose after this step per sampled request, planned for the step
        that verifies them: this step's sampled requests as its decode rows and the
        prompt tokens still to prefill then (a step the prefill will fill runs no
        proposals, so none is made for it). With a proposer that writes KV ahead, each
        request gets slots for them or proposes nothing."""
        if self.spec is None:
            return {}
        sampled = []
        for request in self.running:
            n = self._num_new.get(request.request_id)
            if (n is not None and request.num_computed_tokens + n >= request.num_tokens
                    and self._speculates(request)):
                sampled.append(request)
        if not sampled:
            return {}
        budget = self.config.max_num_batched_tokens
        # Decode rows of the next step: the sampled requests and those this one left out.
        rows = len(sampled) + sum(1 for r in self.running if r.is_decoding
                                  and r.request_id not in self._num_new)
        base = rows + self._pending_prefill_tokens(budget - rows, self.running)
        candidates = [ProposalCandidate(r.request_id, r.num_tokens + 1,
                                        r.sampling_params.max_tokens - r.num_output_tokens - 1)
                      for r in sampled]
        wanted = self.spec.tokens_to_propose(candidates, rows, min(base, budget), budget)
        plan = {}
        for request in sampled:
            rid = request.request_id
            k = min(wanted.get(rid, 0), max(self._spec_room(request, 1), 0))
            if k > 0 and self.spec.writes_kv_ahead:
                # Slots past this step's tokens for the draft to write its proposals'
                # KV into: only from free blocks, never by preempting anyone.
                if not self.kv.allocate_slots(request, self._num_new[rid] + k):
                    k = 0
            if k > 0:
                plan[rid] = k
                self.spec.proposing(rid, request.num_tokens + 1)
        return plan

    def _schedule_fcfs(self) -> None:
        # 1. Running requests, decodes first. Each may preempt others to get a block.
        for request in policy.running_order(self._idle_running()):
            self._schedule_running(request)
        # 2. Swapped-out requests come back in, oldest first, before anything new.
        if self._preempted:
            return  # a step that had to preempt admits nothing
        while self.swapped:
            if self._try_admit(self.swapped[0]) is not Admission.ADMITTED:
                return
        # 3. Waiting requests in queue order.
        self._admit_in_order(self.waiting.in_order())

    def _schedule_by_urgency(self) -> None:
        key = self._order_key
        # 1. Decodes: one token each (plus any proposed tokens), most urgent first.
        for request in policy.running_order(self._idle_running(), key):
            if request.is_decoding:
                self._schedule_running(request)
        # 2. Everything else that wants tokens, in one order: running prefill chunks,
        #    swapped-out and waiting requests, most urgent first.
        preempted = {r.request_id for r in self._preempted}
        items = [r for r in self._idle_running() if r.request_id not in self._num_new]
        items += [r for r in self.swapped if r.request_id not in preempted]
        items += [r for r in self.waiting if r.request_id not in preempted]
        self._admit_in_order(self.policy.order(items, self._now))

    def _order_key(self, request: Request) -> tuple:
        return self.policy.order_key(request, self._now)

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
            if outcome is Admission.ADMITTED:
                urgent = urgent or self._isolate(request)
                if head is not None:
                    num_bypasses = self._num_bypasses.get(head.request_id, 0) + 1
                    self._num_bypasses[head.request_id] = num_bypasses
                    self.stats.num_head_bypasses += 1
                    admitting = policy.may_bypass(num_bypasses, self.config.max_head_bypasses)
                continue
            if outcome is Admission.DEFERRED:
                admitting = False
                continue
            num_no_fit += 1
            if outcome is Admission.FULL or num_no_fit >= MAX_NO_FIT_PER_STEP:
                admitting = False
            elif head is None:
                head = request
                admitting = policy.may_bypass(self._num_bypasses.get(request.request_id, 0),
                                              self.config.max_head_bypasses)

    def _isolate(self, urgent: Request) -> Request:
        """`urgent` is the first request given prefill tokens in this step (in urgency
        order): the decodes already scheduled that defer to it wait for the next step."""
        for request in self.running:
            if (request is not urgent and request.request_id in self._num_new
                    and request.is_decoding and self._defers_to(request, urgent)):
                self._unschedule(request)
        return urgent

    def _defers_to(self, request: Request, urgent: Request) -> bool:
        """Whether `request` gets no tokens in a step that prefills `urgent`: under the
        priority policy with `isolate_urgent_prefill`, when it is of a less urgent
        priority class and less urgent by the admission threshold. The urgent request's
        first token then waits for its own chunk only, not for the background's decodes
        and chunks as well; they run in the next step (its blocks stay allocated)."""
        if not self.policy.isolates_urgent_prefill:
            return False
        return (request.priority > urgent.priority
                and self._urgency(request) - self._urgency(urgent)
                >= self.policy.admission_threshold)

    def _outranks_memory_victims(self, request: Request) -> bool:
        """In a step that had to preempt for memory, only a request more urgent than every
        victim by the threshold is admitted (never the victims themselves)."""
        if not self.policy.orders_by_urgency:
            return False
        u = self._urgency(request)
        return all(self._urgency(v) - u >= self.policy.admission_threshold
                   for v in self._memory_victims)

    def _urgency(self, request: Request) -> float:
        return self.policy.urgency(request, self._now)

    def _schedule_running(self, request: Request) -> None:
        """Give a running request its tokens, preempting others if its blocks run short."""
        budget = self._budget
        if request.status is not RequestStatus.RUNNING or budget == 0:
            return
        num_uncomputed = request.num_uncomputed_tokens
        num_tokens = min(num_uncomputed, budget)
        eviction = self.kv.eviction
        if eviction is not None:
            num_tokens = min(num_tokens, eviction.max_step_tokens)
        spec = self._spec_tokens(request) if request.spec_token_ids else []
        num_tokens += len(spec)
        if self._holds_back(request, num_tokens < num_uncomputed):
            return
        if eviction is not None:
            self._evict(request, num_tokens)
        while not self.kv.allocate_slots(request, num_tokens):
            victim = self.preemptor.choose_memory_victim(request, self._idle_running(),
                                                         self._admitted, self._now, self._step,
                                                         self._over_share())
            self._preempt_now(victim)
            self._memory_victims.append(victim)
            if victim is request:
                return
        self._schedule_tokens(request, num_tokens, spec)

    def _evict(self, request: Request, num_tokens: int) -> None:
        """H2O: compact the request first if `num_tokens` more would pass its budget."""
        eviction = self.kv.eviction
        num_kept = eviction.num_to_keep(request.num_kv_tokens, num_tokens)
        if num_kept is None:
            return
        num_before = request.num_kv_tokens
        compaction = self.kv.compact(request, num_kept, eviction.recent_tokens)
        if compaction is None:
            return  # a shared block could not be copied: it runs over budget this step
        self._compactions[request.request_id] = compaction
        self._table_changed(request)
        self.stats.num_kv_compactions += 1
        self.stats.num_evicted_tokens += num_before - num_kept

    def _spec_tokens(self, request: Request) -> list[int]:
        """The proposed tokens a decoding request runs this step: as many as the plan
        gives it (all, without a speculation policy), that the budget leaves beside its
        own token, that stay inside the context, and that could still become output (at
        most max_tokens - 1 more: one token is always the model's)."""
        if not request.spec_token_ids or not request.is_decoding:
            return []
        room = min(self._budget - 1, self.max_model_len - request.num_tokens,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1)
        if self.spec is not None:
            room = min(room, self._spec_plan.get(request.request_id, 0))
            if room <= 0 and self.spec.deterministic:
                self._unrun[request.request_id] = (request.spec_token_ids[0],
                                                   request.num_tokens)
        return request.spec_token_ids[:max(room, 0)]

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
        if not self.config.finish_prompts_first or request.is_decoding:
            return False
        return self._finishes_chunked_prompt or (self._finishes_prompt and partial)

    def _schedule_tokens(self, request: Request, num_tokens: int,
                         spec: list[int] | None = None) -> None:
        rid = request.request_id
        if num_tokens < request.num_uncomputed_tokens:
            self._chunked_prompts.add(rid)
        elif not request.is_decoding:
            self._finishes_prompt = True  # its first (or first resumed) token comes out
            if rid in self._chunked_prompts:
                self._finishes_chunked_prompt = True
                self._chunked_prompts.discard(rid)
        self._num_new[rid] = num_tokens
        self._num_recomputed += max(0, min(num_tokens, request.max_num_computed_tokens
                                           - request.num_computed_tokens))
        if spec:
            self._spec[rid] = spec
        self._budget -= num_tokens
        self.fair_share.charge(request, num_tokens)

    def _unschedule(self, request: Request) -> None:
        num_tokens = self._num_new.get(request.request_id, 0)
        self._num_recomputed -= max(0, min(num_tokens, request.max_num_computed_tokens
                                           - request.num_computed_tokens))
        self._num_new.pop(request.request_id, None)
        self._spec.pop(request.request_id, None)
        if num_tokens:
            self._budget += num_tokens
            self.fair_share.charge(request, -num_tokens)

    def _preempt_now(self, victim: Request, reason: str = "for KV memory") -> None:
        self._unschedule(victim)
        self._preempt(victim, reason)
        self._preempted.append(victim)

    # ----- admission ----------------------------------------------------------------------

    def _try_admit(self, request: Request) -> Admission:
        """Admit a waiting or swapped-out request if it fits, preempting less urgent
        running requests for it when the policy allows and that makes it fit."""
        swapped = request.status == RequestStatus.SWAPPED
        if not self._adapter_fits(request):
            return Admission.NO_FIT  # preempting for it would not free a slot for sure
        computed_blocks, num_hit_tokens = [], 0
        if not swapped and not self.kv.holds(request.request_id):
            computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
        outcome, num_tokens = self._fit(request, swapped, num_hit_tokens, computed_blocks)
        if (outcome not in (Admission.ADMITTED, Admission.DEFERRED)
                and self.policy.preempts_at_admission and not self._slot_frees_soon()):
            victims = self._plan_admission_victims(request, swapped, num_hit_tokens)
            if victims:
                for victim in victims:
                    self._preempt_now(victim, f"for more urgent {request.request_id}")
                    self.stats.num_admission_preemptions += 1
                outcome, num_tokens = self._fit(request, swapped, num_hit_tokens,
                                                computed_blocks)
                if outcome is Admission.ADMITTED:
                    self._protected_until[request.request_id] = (
                        self._step + self.config.preemption_cooldown_steps)
        if outcome is not Admission.ADMITTED:
            return outcome
        if swapped:
            self._admit_swapped(request)
        else:
            self._admit_waiting(request, num_tokens, num_hit_tokens, computed_blocks)
        self._admitted.add(request.request_id)
        self._num_bypasses.pop(request.request_id, None)
        self._kv_reserve = None  # one more running request to leave room for
        return Admission.ADMITTED

    def _slot_frees_soon(self) -> bool:
        """Whether a running request ends within admission_preemption_wait_steps steps
        (its remaining max_tokens bound them): a more urgent request then waits for it
        instead of preempting. In the overload soak, urgent arrivals preempted a running
        request 0.5 times per request while a request finished every ~0.2 s."""
        steps = self.config.admission_preemption_wait_steps
        return steps > 0 and any(
            r.is_decoding and r.sampling_params.max_tokens - r.num_output_tokens <= steps
            for r in self.running)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request's adapter (if any) is in use by a running request, or a
        slot is free for it."""
        lora_id = request.lora_int_id
        if lora_id is None:
            return True
        in_use = {r.lora_int_id for r in self.running}
        in_use.discard(None)
        return lora_id in in_use or len(in_use) < self.max_loras

    def _may_chunk(self, request: Request) -> bool:
        """Whether this request's uncomputed tokens may be split across steps.

        `enable_chunked_prefill=False` keeps prompts whole; a request recomputing its
        prompt plus generated tokens after a preemption is always chunked, or one whose
        total outgrew the token budget could never resume.
        """
        return (self.config.enable_chunked_prefill or request.num_output_tokens > 0
                or self.kv.eviction is not None)  # its steps are capped (kv_eviction.py)

    def _room(self, request: Request | None = None) -> StepRoom:
        """What is left of the step for admitting `request`: slots, budget, and the KV
        headroom (watermark + growth of the running requests) and tenant share it must
        respect."""
        cfg = self.config
        if self._kv_reserve is None:
            reserve = 0
            if self.running and (cfg.kv_watermark or cfg.admission_lookahead_tokens):
                reserve = int(cfg.kv_watermark * self.kv.num_blocks + 0.999999)
                for r in self.running:
                    reserve += kv_growth(self.kv, r, self.kv.num_allocated_slots(r.request_id),
                                         cfg.admission_lookahead_tokens)
            self._kv_reserve = reserve
        tenant_room = None
        if cfg.tenant_kv_share and request is not None:
            tenant_room = self._tenant_room(request)
        return StepRoom(self._budget, len(self.running), self._max_running, self._kv_reserve,
                        cfg.admission_lookahead_tokens if self.running else 0, tenant_room)

    def _tenant_blocks(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for r in self.running:
            tenant = policy.tenant_of(r)
            held[tenant] = held.get(tenant, 0) + self.kv.num_held_blocks(r.request_id)
        return held

    def _active_tenants(self) -> set[str]:
        active = {policy.tenant_of(r) for r in self.running}
        return active | set(self.fair_share.num_queued)

    def _tenant_room(self, request: Request) -> int | None:
        """Blocks the request's tenant may still take, or None when no other tenant
        wants memory (its share is lent: it may take everything)."""
        tenant = policy.tenant_of(request)
        active = self._active_tenants() | {tenant}
        if len(active) < 2:
            return None
        share = tenant_share_blocks(self.kv.num_blocks, self.fair_share.weight(tenant),
                                    sum(self.fair_share.weight(t) for t in active))
        return share - self._tenant_blocks().get(tenant, 0)

    def _over_share(self) -> set[str]:
        """Tenants holding more than their share of the blocks while others compete."""
        active = self._active_tenants()
        if not self.config.tenant_kv_share or len(active) < 2:
            return set()
        total = sum(self.fair_share.weight(t) for t in active)
        return {t for t, held in self._tenant_blocks().items()
                if held > tenant_share_blocks(self.kv.num_blocks, self.fair_share.weight(t),
                                              total)}

    def _fit(self, request: Request, swapped: bool, num_hit_tokens: int,
             computed_blocks: list) -> tuple[Admission, int]:
        """Whether the request fits in this step now, and with how many tokens."""
        return fit(self.kv, request, swapped, num_hit_tokens, computed_blocks,
                   self._room(request),
                   self._may_chunk(request), lambda partial: self._holds_back(request, partial))

    def _plan_admission_victims(self, request: Request, swapped: bool,
                                num_hit_tokens: int) -> list[Request]:
        """Running requests to preempt so that `request` fits (core.admission)."""
        protected = {rid for rid, until in self._protected_until.items() if until > self._step}
        protected |= self._admitted
        return plan_admission_victims(
            self.kv, request, swapped, num_hit_tokens, self._urgency(request),
            [(r, self._urgency(r)) for r in self._idle_running()],
            self.policy.admission_threshold,
            protected, self._room(), self._num_new, self._may_chunk(request))

    def _admit_waiting(self, request: Request, num_tokens: int, num_hit_tokens: int,
                       computed_blocks: list) -> None:
        allocated = self.kv.allocate_slots(request, num_tokens, computed_blocks)
        assert allocated, "_fit checked that the blocks are there"
        self.waiting.remove(request)
        self.fair_share.queued_out(request)
        request.num_computed_tokens += num_hit_tokens
        if request.status == RequestStatus.PREEMPTED:
            self._resume(request)
        else:
            request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = self._now
            self.policy.observe_wait(self._now - request.arrival_time)
            self.running.append(request)
        self._schedule_tokens(request, num_tokens)

    def _admit_swapped(self, request: Request) -> None:
        plan = self.kv.swap_in(request)
        assert plan is not None, "_fit checked that the blocks are there"
        self.swapped.remove(request)
        self.fair_share.queued_out(request)
        self._swap_in.extend(plan)
        self.stats.num_swap_in += 1
        self._resume(request)
        num_tokens = min(request.num_uncomputed_tokens, self._budget)
        if self.kv.eviction is not None:
            # No compaction in the step it comes back (the worker compacts before the
            # swap-ins land): it may pass its budget by this one step's tokens.
            num_tokens = min(num_tokens, self.kv.eviction.max_step_tokens)
        if (not self._holds_back(request, num_tokens < request.num_uncomputed_tokens)
                and self.kv.allocate_slots(request, num_tokens)):
            self._schedule_tokens(request, num_tokens)

    def _build_output(self, num_new_tokens: dict[str, int],
                      preempted: list[Request]) -> SchedulerOutput:
        scheduled = []
        get = num_new_tokens.get
        for request in self.running:
            n = get(request.request_id)
            if n is not None:
                scheduled.append(self._scheduled_request(request, n))
        decodes = [s for s in scheduled if s.is_decoding]  # decodes first (a stable partition)
        if len(decodes) != len(scheduled):
            scheduled = decodes + [s for s in scheduled if not s.is_decoding]
        self._in_flight.update(s.request_id for s in scheduled)
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        stats = self.stats
        if scheduled:
            stats.num_steps += 1
            stats.num_scheduled_requests += len(scheduled)
            stats.num_scheduled_tokens += sum(num_new_tokens.values())
            allocated = used = 0
            num_slots = self.kv.num_allocated_slots
            for request in self.running:
                rid = request.request_id
                allocated += num_slots(rid)
                used += request.num_kv_tokens + get(rid, 0)
            stats.allocated_slots += allocated
            stats.used_slots += used
        return SchedulerOutput(scheduled=scheduled, finished_request_ids=finished,
                               preempted_request_ids=[r.request_id for r in preempted],
                               swapped_request_ids=self._swapped_out,
                               swap_out=self._swap_out, swap_in=self._swap_in,
                               num_recomputed_tokens=self._num_recomputed,
                               kv_compactions=list(self._compactions.values()))

    def _scheduled_request(self, request: Request, num_tokens: int) -> ScheduledRequest:
        """The request's entry of the step message: what the worker does not know yet
        (its data the first time, then the tokens and blocks added since), and what to
        compute. Every list is a new one: in-process, the worker keeps what it gets."""
        rid = request.request_id
        view = self._worker_views.get(rid)
        new_request = None
        if view is None:
            view = self._worker_views[rid] = _WorkerView(num_tokens=request.num_prompt_tokens)
            new_request = NewRequestData(request.prompt_token_ids, request.sampling_params,
                                         request.lora_request)
        all_token_ids = request.all_token_ids
        total = len(all_token_ids)
        new_token_ids = all_token_ids[view.num_tokens:]
        view.num_tokens = total
        block_ids = self.kv.block_ids(rid)
        replaces = view.table_stale
        new_block_ids = block_ids[0 if replaces else view.num_blocks:]
        new_sliding_block_ids = ([] if self.kv.sliding is None else
                                 self.kv.sliding.block_ids(rid)[0 if replaces
                                                                else view.num_blocks:])
        view.num_blocks, view.table_stale = len(block_ids), False
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=rid, num_computed_tokens=start, num_scheduled_tokens=num_tokens,
            num_evicted_tokens=request.num_evicted_tokens,
            new_token_ids=new_token_ids, new_block_ids=new_block_ids,
            replaces_block_table=replaces, new_sliding_block_ids=new_sliding_block_ids,
            spec_token_ids=self._spec.get(rid, []),
            num_proposals=self._num_proposals.get(rid, 0),
            sample=start + num_tokens >= total and request.sampling_params.max_tokens > 0,
            is_decoding=request.is_decoding, new_request=new_request)

    def _table_changed(self, request: Request) -> None:
        """The request's block table changed other than by appending."""
        view = self._worker_views.get(request.request_id)
        if view is not None:
            view.table_stale = True

    def _resume(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.resumed_step = self.stats.num_steps
        self._protected_until[request.request_id] = (
            self.stats.num_steps + self.config.preemption_cooldown_steps)
        self.running.append(request)

    def _preempt(self, request: Request, reason: str = "for KV memory") -> None:
        """Take the request's KV away, by swap or recompute, and park the request."""
        self.running.remove(request)
        taken = self.preemptor.take_kv(request)
        self._table_changed(request)
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if taken.mode == policy.PreemptionMode.SWAP:
            self._swap_out.extend(taken.swap_plan)
            self._swapped_out.append(request.request_id)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            self.fair_share.queued_in(request)
            self.stats.num_preemptions_swap += 1
            logger.info("preempted request %s %s (mode=swap, %d tokens of KV swapped out)",
                        request.request_id, reason, taken.num_computed_tokens)
        else:
            request.status = RequestStatus.PREEMPTED
            if self.spec is not None:
                self.spec.draft_lost(request.request_id)
            request.num_computed_tokens = 0
            request.num_evicted_tokens = 0
            self._compactions.pop(request.request_id, None)  # its KV is gone anyway
            self._enqueue(request, front=True)
            self.stats.num_preemptions_recompute += 1
            logger.info("preempted request %s %s (mode=recompute, %d computed tokens to "
                        "recompute)", request.request_id, reason, taken.num_computed_tokens)

    def _observe_spec(self, sched: ScheduledRequest, tokens: list[int]) -> None:
        """Acceptance of what the request's step verified (or of a deterministic proposal
        the plan did not run, scored against the model's token)."""
        rid = sched.request_id
        unrun = self._unrun.pop(rid, None)
        request = self.requests[rid]
        if sched.spec_token_ids:
            self.spec.observe(rid, len(sched.spec_token_ids), len(tokens) - 1)
        elif unrun is not None and unrun[1] == request.num_tokens:
            self.spec.observe_unrun(rid, unrun[0], tokens[0])
        else:
            self.spec.idle(rid)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request; return one output per request with news.

        A request that ran proposed tokens keeps those the runner accepted (it returns
        them followed by one token of its own); the slots of the rest are rolled back."""
        outputs = []
        sampled = runner_output.sampled_token_ids
        if self.spec is not None:
            self.spec.begin_step()
        # Bound once: this loop runs for every request of every step (docs/simulator.md).
        requests_get = self.requests.get
        kv = self.kv
        max_model_len = self.max_model_len
        prompt_logprobs_of = runner_output.prompt_logprobs
        logprobs_of = runner_output.logprobs
        proposals_of = runner_output.spec_token_ids
        failed = runner_output.failed
        for sched in scheduler_output.scheduled:
            rid = sched.request_id
            self._in_flight.discard(rid)
            ended = self._free_after_step.pop(rid, None)
            if ended is not None:  # it ended while the step ran: its blocks are free now
                kv.free(ended)
                kv.forget(ended)
                continue
            request = requests_get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if failed and rid in failed:  # one of its components failed: it ends alone
                outputs.append(self._fail(request, failed[rid]))
                continue
            tokens = sampled[rid] if sched.sample else []
            num_rejected = len(sched.spec_token_ids) - max(len(tokens) - 1, 0)
            if self.spec is not None and tokens:
                self._observe_spec(sched, tokens)
            request.num_computed_tokens += sched.num_scheduled_tokens - num_rejected
            status = None
            num_kept = 0
            for token_id in tokens:  # accepted proposals, then the model's own token
                request.append_output_token(token_id)
                num_kept += 1
                status = request.check_stop(max_model_len)
                if status is not None:
                    break
            # Stopped early: proposals after the stop were computed but are not its tokens.
            num_tokens = len(request.all_token_ids)
            if request.num_computed_tokens > num_tokens:
                request.num_computed_tokens = num_tokens
            if request.num_computed_tokens > request.max_num_computed_tokens:
                request.max_num_computed_tokens = request.num_computed_tokens
            if num_rejected and kv.trim(request):
                self._table_changed(request)
            kv.cache_full_blocks(request)  # only blocks full of its own tokens
            prompt_logprobs = prompt_logprobs_of.get(rid) if prompt_logprobs_of else None
            if not sched.sample:
                scored = (request.sampling_params.max_tokens == 0
                          and request.num_computed_tokens >= request.num_tokens)
                if scored:  # max_tokens 0: its prompt scored, nothing to generate
                    self.running.remove(request)
                    self._end(request, RequestStatus.FINISHED_LENGTH)
                if prompt_logprobs is not None or scored:
                    outputs.append(EngineCoreOutput(
                        request.request_id, [], finish_reason=request.finish_reason,
                        new_prompt_logprobs=prompt_logprobs,
                        num_cached_tokens=request.num_cached_tokens))
                continue
            if request.first_token_time is None:
                request.first_token_time = self._clock()
            if status is not None:
                self.running.remove(request)
                self._end(request, status)
            else:
                request.spec_token_ids = proposals_of.get(rid, []) if proposals_of else []
            logprobs = logprobs_of.get(rid) if logprobs_of else None
            outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=tokens[:num_kept],
                finish_reason=request.finish_reason,
                new_logprobs=None if logprobs is None else logprobs[:num_kept],
                new_prompt_logprobs=prompt_logprobs,
                num_cached_tokens=request.num_cached_tokens))
        return outputs
