"""How much of a step batch work may take while interactive work is about.

Owns `BatchShare`: whether interactive traffic is present (an interactive request
running, swapped out or waiting, or one seen within `batch_yield_window_s`), and, while
it is, the most tokens batch-band requests (`Request.band`, the Batch API's lines) get in
one step. Alone, batch work fills every seat; beside interactive traffic each step's
batch part is bounded so that steps stay short: an interactive request that arrives waits
for the step in flight before its prefill starts, and a step of `max_num_seqs` batch rows
or a long batch prefill chunk is what made its TTFT several times its idle figure
(docs/batch.md). The bound, `batch_step_tokens`, is by default what the step cost model
(core/step_cost.py) says a step's fixed cost buys: batch work then at most doubles a
step's length. It decides only the number; core/step_plan.py applies it.
"""

from __future__ import annotations

import math
from typing import Iterable

from treadle.config import SchedulerConfig
from treadle.core.step_cost import StepCostModel
from treadle.request import BATCH, Request


class BatchShare:
    """The batch band's token bound for each step."""

    def __init__(self, config: SchedulerConfig, step_costs: StepCostModel) -> None:
        self.config = config
        self.step_costs = step_costs
        self.last_interactive: float | None = None
        """When an interactive request was last present (the scheduler's clock)."""

    def observe(self, requests: Iterable[Request], now: float) -> None:
        """The requests the scheduler holds at the start of a step."""
        if any(r.band != BATCH for r in requests):
            self.last_interactive = now

    def sharing(self, now: float) -> bool:
        """Whether interactive traffic is present (or was, within the window)."""
        return (self.last_interactive is not None
                and now - self.last_interactive <= self.config.batch_yield_window_s)

    def step_tokens(self, now: float) -> int | None:
        """Most tokens batch requests may take in a step starting at `now` (None: no
        bound, nothing interactive about)."""
        if not self.sharing(now):
            return None
        if self.config.batch_step_tokens > 0:
            return self.config.batch_step_tokens
        costs = self.step_costs
        ceiling = self.config.max_num_batched_tokens
        if costs.per_token_s <= 0.0:  # a token costs nothing measurable: no bound needed
            return ceiling
        return max(1, min(ceiling, math.floor(costs.fixed_s / costs.per_token_s)))
