"""The iteration-level scheduler: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a request budget
(`max_num_seqs`). Running requests are served first (decodes before unfinished prefill
chunks), then waiting requests are admitted in queue order: their prefix-cache hit first,
then the uncached part, chunked to the remaining budget. When a running request needs a
block and none is free, the victim of smallest loss (`policy.choose_victim`) is preempted,
by recompute (blocks freed, recomputed on resume) or by swap (blocks copied to the swap
pool), whichever `policy.choose_preemption_mode` picks. Preempted requests resume before
new admissions: swapped ones as soon as their blocks fit again, recomputed ones from the
front of the waiting queue. After the step, `update_from_output` appends sampled tokens,
finishes requests and frees their blocks, so waiting requests join the very next step.

The scheduler owns request state transitions and the running/waiting sets. It never
touches tensors or the model (no torch import).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core import policy
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.outputs import (EngineCoreOutput, ModelRunnerOutput, ScheduledRequest,
                                  SchedulerOutput)
from treadle.core.request_queue import FCFSQueue
from treadle.request import Request, RequestStatus

logger = logging.getLogger(__name__)


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
    num_swap_in: int = 0
    allocated_slots: int = 0
    """Sum over steps of KV token slots held by running requests."""
    used_slots: int = 0
    """Sum over steps of those slots holding a token (computed or scheduled)."""


class Scheduler:
    """Chooses each step's batch under the token, sequence and KV-memory budgets."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_kv_blocks: int, max_model_len: int, num_swap_blocks: int = 0,
                 preemption_costs: policy.PreemptionCosts | None = None) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_kv_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, num_swap_blocks)
        self.preemption_costs = preemption_costs
        self.victim_weights = policy.VictimWeights(scheduler_config.victim_priority_weight,
                                                   scheduler_config.victim_wait_weight)
        self.waiting = FCFSQueue()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self.stats = SchedulerStats()

    # ----- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push_back(request)

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
            self.kv.free_swapped(request)
        else:
            self.waiting.remove(request)
        request.error = error
        self._end(request, status)
        return request

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)

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

    # ----- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        num_new_tokens: dict[str, int] = {}
        preempted: list[Request] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []

        # 1. Running requests, decodes first. Each may preempt others to get a block.
        for request in policy.running_order(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if token_budget == 0:
                break
            num_tokens = min(request.num_uncomputed_tokens, token_budget)
            while not self.kv.allocate_slots(request, num_tokens):
                # Any other running request can be the victim, even one already scheduled
                # in this step (its tokens go back to the budget): otherwise the request
                # that happens to come last would always preempt itself.
                candidates = [r for r in self.running if r is not request]
                victim = request
                if candidates:
                    victim = policy.choose_victim(
                        candidates, time.monotonic(), self.stats.num_steps,
                        self.victim_weights, self.config.preemption_cooldown_steps)
                token_budget += num_new_tokens.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                num_new_tokens[request.request_id] = num_tokens
                token_budget -= num_tokens

        # 2. Swapped-out requests come back in before anything new is admitted.
        while (self.swapped and not preempted and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.swapped[0]
            plan = self.kv.swap_in(request)
            if plan is None:
                break
            self.swapped.popleft()
            self._swap_in.extend(plan)
            self.stats.num_swap_in += 1
            self._resume(request)
            num_tokens = min(request.num_uncomputed_tokens, token_budget)
            if self.kv.allocate_slots(request, num_tokens):
                num_new_tokens[request.request_id] = num_tokens
                token_budget -= num_tokens

        # 3. Waiting requests in queue order, unless this step already had to preempt.
        while (self.waiting and not preempted and not self.swapped and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            computed_blocks, num_hit_tokens = [], 0
            if not self.kv.holds(request.request_id):
                computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_tokens = request.num_uncomputed_tokens - num_hit_tokens
            if num_tokens > token_budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_tokens = token_budget
            if not self.kv.allocate_slots(request, num_tokens, computed_blocks):
                break
            self.waiting.pop()
            request.num_computed_tokens += num_hit_tokens
            if request.status == RequestStatus.PREEMPTED:
                self._resume(request)
            else:
                request.status = RequestStatus.RUNNING
                request.first_scheduled_time = time.monotonic()
                self.running.append(request)
            num_new_tokens[request.request_id] = num_tokens
            token_budget -= num_tokens

        return self._build_output(num_new_tokens, preempted)

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
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
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
            self.stats.num_preemptions_swap += 1
            logger.info("preempted request %s (mode=swap, %d tokens of KV swapped out)",
                        request.request_id, request.num_computed_tokens)
        else:
            num_lost = request.num_computed_tokens
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.push_front(request)
            self.stats.num_preemptions_recompute += 1
            logger.info("preempted request %s (mode=recompute, %d computed tokens to "
                        "recompute)", request.request_id, num_lost)

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
                request.first_token_time = time.monotonic()
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
