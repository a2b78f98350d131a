"""How much of a step less urgent work may take while more urgent work is about.

Owns `YieldShare`: each request's yield class (its band, then the policy's
`yield_class`: the priority class under `priority`, nothing under the other policies),
when each class was last present, and, while a more urgent class is present (a request of
it running, swapped out or waiting, or one seen within `batch_yield_window_s`), the most
tokens the less urgent classes together get in one step. Alone, a class fills every seat;
beside more urgent traffic each step's less urgent part is bounded so that steps stay
short: an urgent request that arrives waits for the step in flight before its prefill
starts, and a step of `max_num_seqs` background rows or a long background prefill chunk
is what made its TTFT several times its idle figure (docs/batch.md for the batch band,
docs/scheduling.md for priority classes). The window matters as much as the bound: the
step in flight when an urgent request arrives was planned before it came, so it must
already have been short.

Two bounds, each applied to its pool of yielding requests: the batch band's
(`batch_step_tokens`, by default what a quarter of a step's fixed cost buys by the step
cost model, core/step_cost.py: `BATCH_SHARE_OF_FIXED`) and the less urgent priority
classes' (`priority_step_tokens`, by default a step's whole fixed cost:
`CLASS_SHARE_OF_FIXED`). This module decides only who yields and the numbers;
core/step_plan.py applies them.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from treadle.config import SchedulerConfig
from treadle.core.step_cost import StepCostModel
from treadle.request import Request

BATCH_SHARE_OF_FIXED = 0.25
"""The batch band's auto bound: batch tokens that cost this fraction of a step's fixed
cost by the cost model's line. The line is fitted mostly on prefill tokens, and a decode
row costs more than one (its attention, its share of the sampler): on the 2-core Xeon of
docs/batch.md a row cost ~2 of the line's tokens, so a quarter of the fixed cost in
tokens lengthened steps by about half. At the whole fixed cost (batch work doubling a
step in the line's tokens) the interactive stream's p99 TTFT beside a batch was 1.19-1.69x
its figure alone; at a bound of 12 tokens (about this rule there) 0.92x and 1.13x, with
as many batch lines done meanwhile (105-145 against 107)."""

CLASS_SHARE_OF_FIXED = 1.0
"""The less urgent priority classes' auto bound, as a fraction of a step's fixed cost.
Larger than the batch band's: priority classes are interactive work whose throughput
counts (issue 5: priority may cost at most 5% of fcfs's throughput), and the target for
the urgent class is 2x its idle TTFT, not the batch band's 1.15x. In the simulator
(`benchmarks/priority_ttft.py`, a saturating priority-1 background at 1x, 1.5x and 3x):
a quarter of the fixed cost held the urgent p99 TTFT at 1.18-1.34x idle but cost 23-25%
of the throughput at 1.5x and 3x; a half 1.24-1.26x and 8-14%; the whole fixed cost
1.27-1.36x and 0.3-4.7%; twice it 1.38-3.38x."""

YieldClass = tuple[int, int]
"""(band rank, the policy's class): lower is more urgent."""


class YieldShare:
    """Who yields in a step, and the bound on what they take together."""

    def __init__(self, config: SchedulerConfig, step_costs: StepCostModel,
                 yield_class: Callable[[Request, float], YieldClass]) -> None:
        """`yield_class`: a request's class (core/policy.py `yield_class` with the
        scheduler's policy)."""
        self.config = config
        self.step_costs = step_costs
        self.yield_class = yield_class
        self.last_seen: dict[YieldClass, float] = {}
        """When a request of each class was last present (the scheduler's clock)."""

    def observe(self, requests: Iterable[Request], now: float) -> None:
        """The requests the scheduler holds at the start of a step."""
        for request in requests:
            self.last_seen[self.yield_class(request, now)] = now

    def most_urgent_class(self, now: float) -> YieldClass | None:
        """The most urgent class present now or within the window (None: none seen)."""
        window = self.config.batch_yield_window_s
        for cls in [c for c, t in self.last_seen.items() if now - t > window]:
            del self.last_seen[cls]
        return min(self.last_seen, default=None)

    def pool(self, request: Request, most_urgent: YieldClass | None,
             now: float) -> str | None:
        """Which bound `request`'s tokens count against at `now`: "band" (a band below
        the most urgent class's: the batch band beside interactive work), "class" (a less
        urgent class of the same band: a priority class), None (it does not yield)."""
        if most_urgent is None:
            return None
        cls = self.yield_class(request, now)
        if cls[0] > most_urgent[0]:
            return "band"
        return "class" if cls > most_urgent else None

    def step_tokens(self) -> dict[str, int]:
        """Most tokens the yielding requests of each pool may take together in a step."""
        return {"band": self._bound(self.config.batch_step_tokens, BATCH_SHARE_OF_FIXED),
                "class": self._bound(self.config.priority_step_tokens,
                                     CLASS_SHARE_OF_FIXED)}

    def _bound(self, configured: int, share_of_fixed: float) -> int:
        if configured > 0:
            return configured
        costs = self.step_costs
        ceiling = self.config.max_num_batched_tokens
        if costs.per_token_s <= 0.0:  # a token costs nothing measurable: no bound needed
            return ceiling
        return max(1, min(ceiling, math.floor(share_of_fixed * costs.fixed_s
                                               / costs.per_token_s)))
