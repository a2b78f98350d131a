"""The worker's persistent batch: what it keeps of every live request across steps.

Owns, per request, the data the step messages sent once (prompt, sampling parameters,
LoRA adapter)
and the deltas applied since (generated tokens, blocks), and a row of a block-table array
for each request that holds KV, so that a step's block tables are one fancy-index of
that array rather than a rebuild from lists. Rows are taken when a request is first
scheduled (or scheduled again after a preemption) and given back when it is preempted or
finished. It applies what the scheduler says and decides nothing.
"""

from __future__ import annotations

import numpy as np

from treadle.core.outputs import ScheduledRequest, SchedulerOutput
from treadle.lora import LoRARequest
from treadle.sampling_params import SamplingParams


class CachedRequestState:
    """One request as the worker knows it."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params",
                 "row", "num_blocks", "lora_request")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        """The adapter it runs with (None: the base model)."""
        self.prompt_token_ids = prompt_token_ids
        """Read-only: in-process it is the scheduler's own list."""
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.row: int | None = None
        """Its row of InputBatch.block_table while it holds KV."""
        self.num_blocks = 0
        """Entries of its row that are its block table."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Its tokens [start, end) of prompt + generated."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]


class InputBatch:
    """Live requests' state and their block-table rows."""

    def __init__(self, max_blocks_per_request: int, num_rows: int = 64) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = np.zeros((num_rows, max(max_blocks_per_request, 1)), dtype=np.int64)
        self.sliding_block_table: np.ndarray | None = None
        """The sliding-window layers' tables, same rows and columns (None until a step
        message carries one: core/kv/sliding.py)."""
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.highest_block_id = -1
        """The highest block id any step message has given (worker/cpu/kv_prefault.py
        keeps the pages past it resident)."""

    def update(self, scheduler_output: SchedulerOutput) -> list[CachedRequestState]:
        """Apply a step message: drop finished requests, free the rows of preempted ones,
        then apply each scheduled request's deltas. Returns the scheduled requests'
        states in the message's order."""
        for request_id in scheduler_output.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._release_row(state)
        for request_id in scheduler_output.preempted_request_ids:
            state = self.requests.get(request_id)
            if state is not None:
                self._release_row(state)
        return [self._apply(s) for s in scheduler_output.scheduled]

    def _apply(self, scheduled: ScheduledRequest) -> CachedRequestState:
        state = self.requests.get(scheduled.request_id)
        if state is None:
            new = scheduled.new_request
            if new is None:
                raise RuntimeError(f"request {scheduled.request_id!r} was scheduled before "
                                   "its data reached the worker")
            state = CachedRequestState(scheduled.request_id, new.prompt_token_ids,
                                       new.sampling_params, new.lora_request)
            self.requests[scheduled.request_id] = state
        state.output_token_ids.extend(scheduled.new_token_ids)
        if state.row is None:
            state.row = self._take_row()
            state.num_blocks = 0
        if scheduled.replaces_block_table:
            state.num_blocks = 0
        new_blocks = scheduled.new_block_ids
        if new_blocks:
            end = state.num_blocks + len(new_blocks)
            if end > self.block_table.shape[1]:
                self._grow(width=end)
            self.block_table[state.row, state.num_blocks:end] = new_blocks
            self.highest_block_id = max(self.highest_block_id, max(new_blocks))
            sliding = scheduled.new_sliding_block_ids
            if sliding:
                if self.sliding_block_table is None:
                    self.sliding_block_table = np.zeros_like(self.block_table)
                self.sliding_block_table[state.row, state.num_blocks:end] = sliding
            state.num_blocks = end
        return state

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.block_table.shape[0])
        return self._free_rows.pop()

    def _release_row(self, state: CachedRequestState) -> None:
        if state.row is not None:
            self._free_rows.append(state.row)
            state.row = None
            state.num_blocks = 0

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.block_table.shape
        rows, width = rows or old_rows, max(width or old_width, old_width)
        table = np.zeros((rows, width), dtype=np.int64)
        table[:old_rows, :old_width] = self.block_table
        self.block_table = table
        if self.sliding_block_table is not None:
            sliding = np.zeros((rows, width), dtype=np.int64)
            sliding[:old_rows, :old_width] = self.sliding_block_table
            self.sliding_block_table = sliding
        self._free_rows.extend(range(rows - 1, old_rows - 1, -1))
