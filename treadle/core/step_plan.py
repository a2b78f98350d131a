"""One step being planned: its budgets, what it has scheduled, admitted and preempted so far.

Owns everything of a step that lives only while the step is planned: the token budget
left, the request slots admissions may fill (a policy may pace them), the tokens
scheduled per request (proposed ones included), the requests admitted and preempted,
the swap copies, the H2O compactions, the block tables that changed, the KV headroom
admissions must leave, and the `finish_prompts_first` marks. `Scheduler.schedule()`
makes a new plan each step and drops it once the step message is built
(core/step_message.py), so nothing of one step outlives it.

The plan also holds the scheduler's state the step works on (its queues, KV manager,
policy, fair-share ledger, speculation controller, statistics), so that admission
(core/admission.py) and preemption (core/preemption.py) take the plan and a request
instead of long parameter lists. Its own methods keep the step's accounts: tokens in
and out of the budget, whether a prefill waits for the next step, the proposed tokens a
decode runs, a compaction, the proposals after the step (with the slots a draft writes
ahead). It never chooses which request runs or which is preempted.
"""

from __future__ import annotations

from collections import deque

from treadle.config import SchedulerConfig
from treadle.core import policy
from treadle.core.decode_gap import decode_step_prefill_tokens
from treadle.core.fair_share import FairShareLedger, tenant_share_blocks
from treadle.core.kv.block_pool import KVBlock
from treadle.core.kv.manager import KVCacheManager
from treadle.core.outputs import KVCompaction
from treadle.core.policies import SchedulingPolicy
from treadle.core.request_queue import FCFSQueue, PolicyQueue
from treadle.core.spec_controller import SpecDecodeController
from treadle.request import BATCH, Request


MAX_SHORT_SCAN = 64
"""Waiting requests a long prompt's chunk looks at for short prompts to leave room for."""


class StepPlan:
    """The step `Scheduler.schedule()` is planning, and the scheduler state it works on."""

    def __init__(self, scheduler, now: float) -> None:
        """`scheduler`: the Scheduler whose step this is; `now`: the step's clock."""
        # The scheduler's state, shared (the step changes it in place).
        self.config: SchedulerConfig = scheduler.config
        self.kv: KVCacheManager = scheduler.kv
        self.policy: SchedulingPolicy = scheduler.policy
        self.fair_share: FairShareLedger = scheduler.fair_share
        self.spec: SpecDecodeController | None = scheduler.spec
        self.stats = scheduler.stats
        self.running: list[Request] = scheduler.running
        self.swapped: deque[Request] = scheduler.swapped
        self.waiting: FCFSQueue | PolicyQueue = scheduler.waiting
        self.protected_until: dict[str, int] = scheduler.protected_until
        self.chunked_prompts: set[str] = scheduler.chunked_prompts
        self.num_bypasses: dict[str, int] = scheduler.num_bypasses
        self.preemption_costs: policy.PreemptionCosts | None = scheduler.preemption_costs
        self.max_loras: int = scheduler.max_loras
        self.max_model_len: int = scheduler.max_model_len
        self._in_flight: set[str] = scheduler.in_flight
        # The step's own.
        self.now = now
        self.step = scheduler.stats.num_steps
        self.budget = self.config.max_num_batched_tokens
        """Tokens left in the step's budget."""
        share = scheduler.yield_share
        self._yield_share = share
        self._yield_to = share.most_urgent_class(now)
        """The most urgent class present now or lately: the less urgent ones yield."""
        self.yield_budgets: dict[str, int] = (
            share.step_tokens() if self._yield_to is not None else {})
        """Tokens left to the yielding requests of each pool in this step (empty: nobody
        yields; core/yield_share.py)."""
        self.decode_prefill_budget = decode_step_prefill_tokens(self.config,
                                                                scheduler.step_costs)
        """Prompt tokens left to a step that carries decodes (None: no bound;
        core/decode_gap.py)."""
        self.num_decodes = 0
        """Decoding requests scheduled in the step."""
        cap = self.policy.max_running(scheduler.requests.values())
        self.max_running = (self.config.max_num_seqs if cap is None
                            else min(cap, self.config.max_num_seqs))
        """Running requests admissions may bring the step to (a policy may pace them)."""
        self.num_new: dict[str, int] = {}
        """Tokens scheduled per request (proposed ones included)."""
        self.spec_tokens: dict[str, list[int]] = {}
        """Proposed tokens scheduled per request (counted in num_new)."""
        self.num_verify: dict[str, int] = (
            {} if self.spec is None
            else self.spec.plan_verification(self.idle_running(), (self.swapped, self.waiting)))
        """Proposed tokens each decode may run, as the speculation controller planned."""
        self.num_proposals: dict[str, int] = {}
        """Tokens the proposer prepares after the step per request (`plan_proposals`)."""
        self.num_recomputed = 0
        """Scheduled tokens whose KV a recompute preemption threw away."""
        self.kv_reserve: int | None = None
        """KV headroom for admissions (StepRoom.kv_reserve), made on first use and again
        after each admission."""
        self.preempted: list[Request] = []
        self.memory_victims: list[Request] = []
        """Those of `preempted` taken for KV memory (not for a more urgent admission)."""
        self.admitted: set[str] = set()
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.swapped_out: list[str] = []
        self.compactions: dict[str, KVCompaction] = {}
        self.tables_changed: set[str] = set()
        """Requests whose block table changed other than by appending (the step message
        sends them whole)."""
        self.finishes_prompt = False
        """Some request's last prompt tokens are in the step."""
        self.finishes_chunked_prompt = False
        """... and they end a prompt split across earlier steps."""
        self.interactive_held = False
        """An interactive waiting request did not get in this step: no batch request is
        admitted behind it (the room it waits for is not batch work's)."""

    def idle_running(self) -> list[Request]:
        """Running requests not in a step in flight: the ones this step may touch."""
        if not self._in_flight:
            return self.running
        return [r for r in self.running if r.request_id not in self._in_flight]

    def urgency(self, request: Request) -> float:
        return self.policy.urgency(request, self.now)

    def is_pinned(self, request: Request) -> bool:
        """Whether the request is at its preemption bound (`max_preemptions`; batch
        requests have none): it is never preempted again, so it is admitted only with
        room to its end (core/admission.py, `pinned_reserve`)."""
        return request.band != BATCH and request.num_preemptions >= self.config.max_preemptions

    # ----- the budget ---------------------------------------------------------------------

    def budget_for(self, request: Request) -> int:
        """Tokens `request` may still take in this step: the step's budget, and for a
        request of a less urgent class than one about, also the yielding classes' bound
        (core/yield_share.py)."""
        budget = self.budget
        if (self.num_decodes and self.decode_prefill_budget is not None
                and not request.is_decoding):
            budget = min(budget, self.decode_prefill_budget)
        pool = self._yield_pool(request)
        if pool is not None:
            budget = min(budget, self.yield_budgets[pool])
        return budget

    def prompt_chunk(self, request: Request, num_tokens: int, budget: int,
                     computed_blocks: list[KVBlock] = ()) -> int:
        """Tokens of the `num_tokens` a prompt (or a recompute) has left that run in this
        step, where `budget` is what `budget_for` leaves it: all that fit, and all of them
        also when the rest would be at most `finish_slack` tokens, the step's own budget
        is what binds, and the KV cache has their blocks free now (with `computed_blocks`,
        an admission's prefix hit): passing the budget never preempts anyone or takes
        memory the budget's chunk would not. The rest would otherwise take a step of its
        own (every weight read again for a few tokens, the first token a step later),
        which is what the decodes ahead of a prompt in a step leave it short by. One
        prompt a step: the budget is then spent."""
        if num_tokens <= budget:
            return num_tokens
        if (0 < budget and budget >= self.budget and not request.is_decoding
                and num_tokens - budget <= self.config.finish_slack
                and self.kv.can_allocate(request, num_tokens, computed_blocks)):
            return num_tokens
        return max(budget, 0)

    def _yield_pool(self, request: Request) -> str | None:
        """The yielding pool `request`'s tokens also count against (None: none)."""
        if not self.yield_budgets:
            return None
        return self._yield_share.pool(request, self._yield_to, self.now)

    def schedule_tokens(self, request: Request, num_tokens: int,
                        spec: list[int] | None = None) -> None:
        """`num_tokens` of the request run in the step (`spec`: its proposed ones among them)."""
        rid = request.request_id
        if num_tokens < request.num_uncomputed_tokens:
            self.chunked_prompts.add(rid)
        elif not request.is_decoding:
            self.finishes_prompt = True  # its first (or first resumed) token comes out
            if rid in self.chunked_prompts:
                self.finishes_chunked_prompt = True
                self.chunked_prompts.discard(rid)
        self.num_new[rid] = num_tokens
        self.num_recomputed += max(0, min(num_tokens, request.max_num_computed_tokens
                                          - request.num_computed_tokens))
        if spec:
            self.spec_tokens[rid] = spec
        self.budget -= num_tokens
        self._count_prefill(request, num_tokens)
        pool = self._yield_pool(request)
        if pool is not None:
            self.yield_budgets[pool] -= num_tokens
        self.fair_share.charge(request, num_tokens)

    def unschedule(self, request: Request) -> None:
        """The request's tokens leave the step (it waits, or it is preempted)."""
        num_tokens = self.num_new.get(request.request_id, 0)
        self.num_recomputed -= max(0, min(num_tokens, request.max_num_computed_tokens
                                          - request.num_computed_tokens))
        self.num_new.pop(request.request_id, None)
        self.spec_tokens.pop(request.request_id, None)
        if num_tokens:
            self.budget += num_tokens
            self._count_prefill(request, -num_tokens)
            pool = self._yield_pool(request)
            if pool is not None:
                self.yield_budgets[pool] += num_tokens
            self.fair_share.charge(request, -num_tokens)

    def _count_prefill(self, request: Request, num_tokens: int) -> None:
        """Decodes and prompt tokens in the step, for the bound on prompt tokens beside
        decodes (`num_tokens` < 0: they leave the step)."""
        if request.is_decoding:
            self.num_decodes += 1 if num_tokens > 0 else -1
        elif self.decode_prefill_budget is not None:
            self.decode_prefill_budget -= num_tokens

    def holds_back(self, request: Request, partial: bool) -> bool:
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
        return self.finishes_chunked_prompt or (self.finishes_prompt and partial)

    def short_prompt_room(self, request: Request, num_tokens: int) -> int:
        """Tokens a running prompt that cannot finish in this step takes of the
        `num_tokens` it could: it leaves room (at most half) for the short prompts
        waiting behind it that are not less urgent by the policy's threshold, each at
        most half a step's budget (the first MAX_SHORT_SCAN of the queue are looked at).
        A long prompt then costs a small request behind it a step or two, not the whole
        prompt's prefill (SGLang #22831: 9.5x longer p99 waits behind one oversized
        prompt); the long prompt is slowed by the short ones' tokens only."""
        half = self.config.max_num_batched_tokens // 2
        band = policy.band_rank(request)
        ordered = self.policy.orders_by_urgency
        u = self.urgency(request) if ordered else 0.0
        threshold = self.policy.admission_threshold
        reserve = 0
        for i, waiting in enumerate(self.waiting):
            if i >= MAX_SHORT_SCAN or reserve >= half:
                break
            n = waiting.num_uncomputed_tokens
            if (n > half or policy.band_rank(waiting) > band
                    or (ordered and self.urgency(waiting) - u >= threshold)):
                continue
            reserve += n
        return num_tokens - min(reserve, half, num_tokens // 2)

    def may_chunk(self, request: Request) -> bool:
        """Whether this request's uncomputed tokens may be split across steps.

        `enable_chunked_prefill=False` keeps prompts whole; a request recomputing its
        prompt plus generated tokens after a preemption is always chunked, or one whose
        total outgrew the token budget could never resume.
        """
        return (self.config.enable_chunked_prefill or request.num_output_tokens > 0
                or self.kv.eviction is not None)  # its steps are capped (kv_eviction.py)

    # ----- speculation and eviction ----------------------------------------------------------

    def spec_tokens_for(self, request: Request) -> list[int]:
        """The proposed tokens a decoding request runs this step: as many as the
        speculation plan gives it (all, without a controller), that the budget leaves
        beside its own token, that stay inside the context, and that could still become
        output (at most max_tokens - 1 more: one token is always the model's)."""
        if not request.spec_token_ids or not request.is_decoding:
            return []
        room = min(self.budget - 1, self.max_model_len - request.num_tokens,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1)
        if self.spec is not None:
            room = self.spec.num_to_verify(request, room, self.num_verify)
        return request.spec_token_ids[:max(room, 0)]

    def plan_proposals(self) -> None:
        """Tokens to propose after this step per sampled request (the speculation
        controller's `proposals_wanted`). With a proposer that writes KV ahead, each
        request gets slots past this step's tokens for them, only from free blocks and
        never by preempting anyone, or proposes nothing."""
        spec = self.spec
        if spec is None:
            return
        for request, k in spec.proposals_wanted(self.running, self.num_new,
                                                (self.swapped, self.waiting)):
            rid = request.request_id
            if spec.writes_kv_ahead and not self.kv.allocate_slots(request,
                                                                    self.num_new[rid] + k):
                continue
            self.num_proposals[rid] = k
            spec.proposing(rid, request.num_tokens + 1)

    def compact(self, request: Request, num_tokens: int) -> None:
        """H2O: compact the request first if `num_tokens` more would pass its budget."""
        eviction = self.kv.eviction
        num_kept = eviction.num_to_keep(request.num_kv_tokens, num_tokens)
        if num_kept is None:
            return
        num_before = request.num_kv_tokens
        compaction = self.kv.compact(request, num_kept, eviction.recent_tokens)
        if compaction is None:
            return  # a shared block could not be copied: it runs over budget this step
        self.compactions[request.request_id] = compaction
        self.tables_changed.add(request.request_id)
        self.stats.num_kv_compactions += 1
        self.stats.num_evicted_tokens += num_before - num_kept

    # ----- tenant KV shares -------------------------------------------------------------------

    def tenant_room(self, request: Request) -> int | None:
        """Blocks the request's tenant may still take, or None when no other tenant
        wants memory (its share is lent: it may take everything) or when the tenant holds
        no block: a tenant always gets to run one request, or a request larger than its
        share could never run while others compete (its room beyond the share is what
        memory victims take back first, preemption.choose_memory_victim)."""
        tenant = policy.tenant_of(request)
        active = self._active_tenants() | {tenant}
        if len(active) < 2:
            return None
        held = self._tenant_blocks().get(tenant, 0)
        if not held:
            return None
        weight = self.fair_share.weight
        share = tenant_share_blocks(self.kv.num_blocks, weight(tenant),
                                    sum(weight(t) for t in active))
        return share - held

    def over_share(self) -> set[str]:
        """Tenants holding more than their share of the blocks while others compete."""
        active = self._active_tenants()
        if not self.config.tenant_kv_share or len(active) < 2:
            return set()
        weight = self.fair_share.weight
        total = sum(weight(t) for t in active)
        return {t for t, held in self._tenant_blocks().items()
                if held > tenant_share_blocks(self.kv.num_blocks, weight(t), total)}

    def _tenant_blocks(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for r in self.running:
            tenant = policy.tenant_of(r)
            held[tenant] = held.get(tenant, 0) + self.kv.num_held_blocks(r.request_id)
        return held

    def _active_tenants(self) -> set[str]:
        active = {policy.tenant_of(r) for r in self.running}
        return active | set(self.fair_share.num_queued)

