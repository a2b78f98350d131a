"""How much of a step batch work may take while interactive work is about.

Owns `BatchShare`: whether interactive traffic is present (an interactive request
running, swapped out or waiting, or one seen within `batch_yield_window_s`), and, while
it is, the most tokens batch-band requests (`Request.band`, the Batch API's lines) get in
one step. Alone, batch work fills every seat; beside interactive traffic each step's
batch part is bounded so that steps stay short: an interactive request that arrives waits
for the step in flight before its prefill starts, and a step of `max_num_seqs` batch rows
or a long batch prefill chunk is what made its TTFT several times its idle figure
(docs/batch.md). The bound, `batch_step_tokens`, is by default what a quarter of a step's
fixed cost buys by the step cost model (core/step_cost.py, `BATCH_SHARE_OF_FIXED`). It
decides only the number; core/step_plan.py applies it.
"""

from __future__ import annotations

import math
from typing import Iterable

from treadle.config import SchedulerConfig
from treadle.core.step_cost import StepCostModel
from treadle.request import BATCH, Request

BATCH_SHARE_OF_FIXED = 0.25
"""The auto bound: batch tokens that cost this fraction of a step's fixed cost by the cost
model's line. The line is fitted mostly on prefill tokens, and a batch decode row costs
more than one (its attention, its share of the sampler): on the 2-core Xeon of
docs/batch.md a row cost ~2 of the line's tokens, so a quarter of the fixed cost in
tokens lengthened steps by about half. At the whole fixed cost (batch work doubling a
step in the line's tokens) the interactive stream's p99 TTFT beside a batch was 1.19-1.69x
its figure alone; at a bound of 12 tokens (about this rule there) 0.92x and 1.13x, with
as many batch lines done meanwhile (105-145 against 107)."""


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
        return max(1, min(ceiling, math.floor(BATCH_SHARE_OF_FIXED * costs.fixed_s
                                               / costs.per_token_s)))
