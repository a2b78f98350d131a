"""The step message: a step's plan, as the incremental `SchedulerOutput` the workers run.

Owns what the workers already hold of each request (what earlier step messages told
them: its tokens, its block-table entries, whether the table must be sent whole) and
the requests that ended since the last message, and turns a `StepPlan` into the next
message: a request's prompt, sampling parameters and adapter the first time it is
scheduled, after that only the tokens and blocks added since (docs/seams.md, "What a
step message carries"; the message types are core/outputs.py's). It decides nothing
about the step and changes no request; the plan lists the block tables the step changed
other than by appending, and the scheduler tells it of those a rollback changed
(`table_changed`) and when a request ends (`ended`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from treadle.core.kv.manager import KVCacheManager
from treadle.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from treadle.request import Request

if TYPE_CHECKING:
    from treadle.core.step_plan import StepPlan


@dataclass
class _WorkerView:
    """What the workers hold of one request (what earlier step messages told them)."""

    num_tokens: int = 0
    """Tokens of the request the workers know (prompt + generated)."""
    num_blocks: int = 0
    """Entries of the block table the workers know."""
    table_stale: bool = False
    """The request's table changed other than by appending (preemption, rollback,
    compaction): the next message sends it whole."""


class StepMessages:
    """Builds each step's message from the plan and what the workers already hold."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._views: dict[str, _WorkerView] = {}
        self._finished: list[str] = []
        """Requests that ended since the last message (the workers drop their state)."""

    def table_changed(self, request_id: str) -> None:
        """The request's block table changed other than by appending."""
        view = self._views.get(request_id)
        if view is not None:
            view.table_stale = True

    def ended(self, request_id: str) -> None:
        """The request ended: the next message tells the workers to drop it."""
        self._views.pop(request_id, None)
        self._finished.append(request_id)

    def build(self, plan: StepPlan, running: Sequence[Request]) -> SchedulerOutput:
        """The message of `plan`: the `running` requests it scheduled (decodes first, a
        stable partition of their running order), what it preempted, swapped and
        compacted, and the requests that ended since the last message."""
        for rid in plan.tables_changed:
            self.table_changed(rid)
        scheduled = []
        get = plan.num_new.get
        for request in running:
            n = get(request.request_id)
            if n is not None:
                scheduled.append(self._scheduled_request(request, n, plan))
        decodes = [s for s in scheduled if s.is_decoding]
        if len(decodes) != len(scheduled):
            scheduled = decodes + [s for s in scheduled if not s.is_decoding]
        finished, self._finished = self._finished, []
        return SchedulerOutput(scheduled=scheduled, finished_request_ids=finished,
                               preempted_request_ids=[r.request_id for r in plan.preempted],
                               swapped_request_ids=plan.swapped_out,
                               swap_out=plan.swap_out, swap_in=plan.swap_in,
                               num_recomputed_tokens=plan.num_recomputed,
                               kv_compactions=list(plan.compactions.values()))

    def _scheduled_request(self, request: Request, num_tokens: int,
                           plan: StepPlan) -> ScheduledRequest:
        """The request's entry of the step message: what the workers do not know yet
        (its data the first time, then the tokens and blocks added since), and what to
        compute. Every list is a new one: in-process, the worker keeps what it gets."""
        rid = request.request_id
        view = self._views.get(rid)
        new_request = None
        if view is None:
            view = self._views[rid] = _WorkerView(num_tokens=request.num_prompt_tokens)
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
            spec_token_ids=plan.spec_tokens.get(rid, []),
            num_proposals=plan.num_proposals.get(rid, 0),
            sample=start + num_tokens >= total and request.sampling_params.max_tokens > 0,
            is_decoding=request.is_decoding, new_request=new_request)
