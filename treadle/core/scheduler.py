"""The iteration-level scheduler: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a request budget
(`max_num_seqs`, or less where the policy caps running requests: `makespan`'s
`max_running`). Running decodes are served first. Then, under `fcfs`, unfinished
prefill chunks of running requests, swapped-out requests (oldest first) and waiting
requests in queue order; under `priority`, `srpt`, `fair` and `makespan`, running prefill
chunks, swapped-out and waiting requests share one order, most urgent first (the
policy's `urgency`, core/policies/): except under `makespan`, a waiting request more
urgent than a running one by the policy's threshold preempts the least urgent running
request (`policy.choose_admission_victim`, with anti-thrash protection) instead of
waiting for memory to run out. Under `priority`, a step that prefills a request of a
more urgent class gives no tokens to less urgent classes (`isolate_urgent_prefill`), so
the urgent first token is not held up by background decodes and chunks. An admitted
request takes its prefix-cache hit first, then the uncached part, chunked to the
remaining budget; under `finish_prompts_first`, a step that already finishes a prompt
takes no partial chunk of another (it would delay that first token and cannot finish its
own prompt anyway), and the last chunk of a prompt split across steps takes no other
prefill at all. A request that does not fit in KV memory does not block smaller ones
behind it, up to `max_head_bypasses` times; then it gets the next opening; a preempted
request is never passed (it keeps its place). A running prompt too long for one step
leaves room for short prompts waiting behind it. Batch requests (`Request.band`) come
after every interactive one under every policy, are preempted first, and take no
tokens in a step that prefills an interactive request.

When a running request needs a block and none is free, the victim of smallest loss
(`policy.choose_victim`) is preempted, by recompute (blocks freed, recomputed on resume)
or by swap (blocks copied to the swap pool), whichever `policy.choose_preemption_mode`
picks. A request preempted `max_preemptions` times is resumed only with room to its end
and never preempted again. After the step, `update_from_output` appends sampled tokens,
finishes requests and frees their blocks, so waiting requests join the very next step;
`observe_step_time` feeds the measured step cost model (core/step_cost.py) that the `slo`
policy predicts deadlines with, and a policy's refusals (`slo_reject`) come back through
`take_ended_outputs`.

A decoding request may carry proposed tokens (`Request.spec_token_ids`, speculative
decoding): they are scheduled with its last token within the budget, as many as the
speculation controller (core/spec_controller.py) plans from the request's measured
acceptance and the measured step costs, and `update_from_output` keeps the accepted ones
and rolls back the rest (their KV slots are freed; no rejected token reaches the prefix
cache). Each step also tells the worker how many tokens to propose for each sampled
request's next step; with a proposer that writes KV ahead (a draft model), the
request's blocks hold slots for them.

With LoRA, the running requests never use more distinct adapters than the worker has
slots (`max_loras`), so neither does any step: a waiting or swapped-out request whose
adapter is not among the running ones' is admitted only while a slot is free; otherwise
it does not fit, exactly like a request too large for free memory (smaller ones pass it
at most `max_head_bypasses` times, then nothing behind it starts until its adapter fits).

The scheduler owns the requests between steps (arrival, end, each step's results), the
running/waiting/swapped sets and the clock it passes to the policy. Each step is a
`StepPlan` (core/step_plan.py) that `schedule()` makes and drops: the order it is filled
in (core/step_fill.py), admission (core/admission.py) and preemption
(core/preemption.py) work on it, and the step message is built from it beside the
message types (core/step_message.py: only what changed since the workers last saw each
request). The policy's answers come from its class (core/policies/), the fair policy's
counters from core/fair_share.py. It never touches tensors or the model (no torch
import).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from treadle.config import CacheConfig, SchedulerConfig, SpeculativeConfig, parse_tenant_weights
from treadle.core import policy
from treadle.core.yield_share import YieldShare
from treadle.core.fair_share import FairShareLedger
from treadle.core.kv.manager import KVCacheManager
from treadle.kv_specs.eviction import EvictionBudget
from treadle.core.kv.config import LayerGroups
from treadle.core.kv.sliding import SlidingWindowGroup
from treadle.core.outputs import (EngineCoreOutput, ModelRunnerOutput, PromptLogprobs,
                                  ScheduledRequest, SchedulerOutput)
from treadle.core.policies import make_policy
from treadle.core.spec_controller import SpecDecodeController
from treadle.core.spec_decode import SpecCosts
from treadle.core.step_cost import StepCostModel
from treadle.core.step_fill import fill_step
from treadle.core.step_message import StepMessages
from treadle.core.step_plan import StepPlan
from treadle.request import FinishReason, Request, RequestStatus

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
    """Heavy-hitter evictions (kv_specs/eviction.py)."""
    num_evicted_tokens: int = 0
    """Tokens of KV they dropped."""
    allocated_slots: int = 0
    """Sum over steps of KV token slots held by running requests."""
    used_slots: int = 0
    """Sum over steps of those slots holding a token (computed or scheduled)."""


class Scheduler:
    """Chooses each step's batch under the token, sequence and KV-memory budgets.

    Its state between steps (queues, KV manager, policy, ledger, speculation controller,
    statistics, `in_flight`, `protected_until`, `chunked_prompts`) is what each step's
    `StepPlan` works on; nothing of a step stays here once its message is built."""

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
        self.fair_share = FairShareLedger(parse_tenant_weights(scheduler_config.tenant_weights))
        self.step_costs = StepCostModel(prior_tokens=scheduler_config.max_num_batched_tokens)
        """Measured step costs (core/step_cost.py), fed by `observe_step_time`."""
        self.policy = make_policy(scheduler_config, self.fair_share)
        self.policy.step_costs = self.step_costs
        self.yield_share = YieldShare(scheduler_config, self.step_costs,
                                      lambda r, now: policy.yield_class(r, self.policy, now))
        """Who yields per step to more urgent traffic about, and the bound on it."""
        self._ended: list[EngineCoreOutput] = []
        """Outputs of requests the scheduler ended itself (a policy's refusals), for the
        caller (`take_ended_outputs`)."""
        self._clock = clock
        self.waiting = self.policy.make_queue()
        self.waiting_for_kv: dict[str, Request] = {}
        """P/D: requests whose prompt KV is on its way from a prefill engine."""
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.messages = StepMessages(self.kv)
        """What the workers hold of each request; builds each step's message."""
        self.in_flight: set[str] = set()
        """Requests in a step submitted to the workers and not yet answered (pipeline
        parallelism keeps several steps in flight): not scheduled, preempted or freed
        until it returns."""
        self.protected_until: dict[str, int] = {}
        """Anti-thrash: step until which a request is not preempted for an admission."""
        self.chunked_prompts: set[str] = set()
        """Requests whose prompt has been split across steps and is not finished yet."""
        self.num_bypasses: dict[str, int] = {}
        """Times each waiting request that did not fit was passed (head-of-line bypass)."""
        self._free_after_step: dict[str, Request] = {}
        """Requests that ended while in flight: their blocks are freed when the step
        returns (the workers may still be writing them)."""
        self.stats = SchedulerStats()
        self.spec: SpecDecodeController | None = None
        """Speculative decoding's plan, state and counters, when a proposer is configured."""
        if speculative is not None and speculative.enabled:
            self.spec = SpecDecodeController(
                speculative.num_speculative_tokens, speculative.adaptive,
                speculative.acceptance_prior, spec_costs, speculative.writes_kv_ahead,
                deterministic=speculative.method == "ngram", max_model_len=max_model_len,
                max_step_tokens=scheduler_config.max_num_batched_tokens)

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
        rid = request.request_id
        if rid in self.in_flight:
            self._free_after_step[rid] = request
        else:
            self.kv.free(request)
            self.kv.forget(request)
        del self.requests[rid]
        self.num_bypasses.pop(rid, None)
        self.protected_until.pop(rid, None)
        self.chunked_prompts.discard(rid)
        if self.spec is not None:
            self.spec.forget(rid)
        self.messages.ended(rid)

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        """End a running request with finish reason 'error' (a per-request component of
        the worker failed for it); what its last step sampled is dropped."""
        self.running.remove(request)
        request.error = error
        self._end(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error,
                                num_cached_tokens=request.num_cached_tokens)

    def _enqueue(self, request: Request) -> None:
        """Put a new (or newly arrived) request in the waiting queue."""
        self.fair_share.queued_in(request)
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
        return len(self.in_flight)

    def urgency(self, request: Request, now: float | None = None) -> float:
        """The request's urgency under the configured policy (lower is more urgent)."""
        return self.policy.urgency(request, self._clock() if now is None else now)

    # ----- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step and return its message."""
        now = self._clock()
        self.policy.prepare_step(self.requests.values(), now)
        for request, error in self.policy.take_refusals():
            if self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR,
                                   error) is not None:
                self._ended.append(EngineCoreOutput(request.request_id, [],
                                                    FinishReason.ERROR, error))
        self.yield_share.observe(self.requests.values(), now)
        plan = StepPlan(self, now)
        fill_step(plan)
        plan.plan_proposals()
        output = self.messages.build(plan, self.running)
        self.in_flight.update(s.request_id for s in output.scheduled)
        if output.scheduled:
            self._count_step(plan, len(output.scheduled))
        return output

    def take_ended_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of the requests the scheduler ended on its own since the last call (a
        policy's refusals: `slo_reject`); the caller delivers them. Taken once."""
        ended, self._ended = self._ended, []
        return ended

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """The step of `output` took `seconds` (wall time, or the simulator's): the step
        cost model learns from it (what the `slo` policy predicts with)."""
        self.step_costs.observe(output.num_scheduled_tokens, seconds)

    def _count_step(self, plan: StepPlan, num_scheduled: int) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_scheduled_requests += num_scheduled
        stats.num_scheduled_tokens += sum(plan.num_new.values())
        allocated = used = 0
        num_slots = self.kv.num_allocated_slots
        get = plan.num_new.get
        for request in self.running:
            rid = request.request_id
            allocated += num_slots(rid)
            used += request.num_kv_tokens + get(rid, 0)
        stats.allocated_slots += allocated
        stats.used_slots += used

    # ----- a step's results ------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request; return one output per request with news.

        A request that ran proposed tokens keeps those the runner accepted (it returns
        them followed by one token of its own); the slots of the rest are rolled back."""
        outputs = []
        if self.spec is not None:
            self.spec.begin_step()
        # Bound once: this loop runs for every request of every step (docs/simulator.md).
        requests_get = self.requests.get
        kv = self.kv
        failed = runner_output.failed
        for sched in scheduler_output.scheduled:
            rid = sched.request_id
            self.in_flight.discard(rid)
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
            output = self._advance(request, sched, runner_output)
            if output is not None:
                outputs.append(output)
        return outputs

    def _advance(self, request: Request, sched: ScheduledRequest,
                 runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        """One request's share of a step's results: its accepted tokens appended, its
        rejected proposals' slots rolled back, its stop conditions checked; its output,
        or None when it has no news."""
        rid = request.request_id
        tokens = runner_output.sampled_token_ids[rid] if sched.sample else []
        num_rejected = len(sched.spec_token_ids) - max(len(tokens) - 1, 0)
        if self.spec is not None and tokens:
            self.spec.observe_step(request, sched.spec_token_ids, tokens)
        request.num_computed_tokens += sched.num_scheduled_tokens - num_rejected
        status = None
        num_kept = 0
        for token_id in tokens:  # accepted proposals, then the model's own token
            request.append_output_token(token_id)
            num_kept += 1
            status = request.check_stop(self.max_model_len)
            if status is not None:
                break
        # Stopped early: proposals after the stop were computed but are not its tokens.
        num_tokens = len(request.all_token_ids)
        if request.num_computed_tokens > num_tokens:
            request.num_computed_tokens = num_tokens
        if request.num_computed_tokens > request.max_num_computed_tokens:
            request.max_num_computed_tokens = request.num_computed_tokens
        if num_rejected and self.kv.trim(request):
            self.messages.table_changed(rid)
        self.kv.cache_full_blocks(request)  # only blocks full of its own tokens
        prompt_logprobs_of = runner_output.prompt_logprobs
        prompt_logprobs = prompt_logprobs_of.get(rid) if prompt_logprobs_of else None
        if not sched.sample:
            return self._prompt_output(request, prompt_logprobs)
        if request.first_token_time is None:
            request.first_token_time = self._clock()
        if status is not None:
            self.running.remove(request)
            self._end(request, status)
        else:
            proposals_of = runner_output.spec_token_ids
            request.spec_token_ids = proposals_of.get(rid, []) if proposals_of else []
        logprobs_of = runner_output.logprobs
        logprobs = logprobs_of.get(rid) if logprobs_of else None
        return EngineCoreOutput(
            request_id=rid, new_token_ids=tokens[:num_kept],
            finish_reason=request.finish_reason,
            new_logprobs=None if logprobs is None else logprobs[:num_kept],
            new_prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens)

    def _prompt_output(self, request: Request,
                       prompt_logprobs: PromptLogprobs | None) -> EngineCoreOutput | None:
        """A step that computed prompt tokens only: its prompt logprobs, if asked for; a
        request of max_tokens 0 whose prompt is all scored ends here."""
        scored = (request.sampling_params.max_tokens == 0
                  and request.num_computed_tokens >= request.num_tokens)
        if scored:  # max_tokens 0: its prompt scored, nothing to generate
            self.running.remove(request)
            self._end(request, RequestStatus.FINISHED_LENGTH)
        if prompt_logprobs is None and not scored:
            return None
        return EngineCoreOutput(request.request_id, [], finish_reason=request.finish_reason,
                                new_prompt_logprobs=prompt_logprobs,
                                num_cached_tokens=request.num_cached_tokens)
