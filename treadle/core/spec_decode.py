"""Speculative decoding's numbers: step costs, acceptance, and how many proposed tokens
maximize tokens per second.

Owns the pure decisions and the numbers behind them, never tensors, the model or a
request's state (the scheduler's controller, core/spec_controller.py, asks them):

- `SpecCosts`: the measured step-cost model the worker reports at start-up
  (worker/spec/cost_probe.py): the seconds of a target step as a function of its rows and
  tokens, measured on a grid and interpolated piecewise-linearly, the seconds of one
  draft forward pass as a function of its rows (zero for a proposer without a model),
  and the seconds per token of a draft with its own KV catching up on a request's
  tokens before its first proposal (its whole prompt, fed once).
- `AcceptanceEstimate`: a request's acceptance rate, estimated from its verified
  proposals with exponential forgetting and a prior it drifts back to while unobserved
  (so a request switched off is tried again now and then). The prior is the engine's
  own recent acceptance over all requests (an estimate of the same kind, slower to
  forget, drifting back to the configured `acceptance_prior` while nobody speculates):
  a proposer that fails on this traffic stops being tried on every new request.
- `plan_proposals`: the number of proposed tokens per request that maximizes expected
  tokens per second of the whole step, given each request's acceptance rate and the cost
  model (docs/speculative.md derives it).
- `SpecDecodeStats`: the counters that metrics, traces and benchmarks read.

Acceptance model: a proposal's tokens are accepted one after another, each with the
request's rate a, until the first rejection, so k proposals give 1 + a + ... + a^k
expected tokens (the last one is always the model's own).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

FORGET = 0.9
"""Weight kept by earlier observations at each new one (about the last 10 verifications
count): acceptance changes within a request (a copied passage ends)."""
IDLE_FORGET = 0.97
"""Weight kept per step without an observation: a request whose speculation was switched
off drifts back to the prior (half-way in about 23 steps) and is tried again."""
PRIOR_WEIGHT = 1.0
"""Pseudo-observations of the prior."""
POOL_FORGET = 0.99
"""The engine-wide estimate's weight kept per observation (about the last 100
verifications of any request count)."""
POOL_IDLE_FORGET = 0.998
"""The engine-wide estimate's weight kept per step in which no request was observed: it
drifts back to `acceptance_prior` (its counts halve in about 350 steps), so a proposer
switched off everywhere is tried again."""


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing), extended beyond the ends along the
    nearest segment, never below 0."""
    if len(xs) == 1:
        return max(ys[0], 0.0)
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True)
class SpecCosts:
    """Measured step costs (seconds). `step_rows[i]` rows were timed at the token counts
    `step_tokens[i]` (each row one decode token plus proposed ones, every position
    sampled), taking `step_seconds[i]`; a draft forward pass over `draft_rows[j]`
    single-token rows took `draft_seconds[j]` (empty: the proposer runs no model);
    catching a draft up on tokens it has not seen took `catchup_seconds_per_token` each
    (0: the proposer reads the target's KV, or runs no model)."""

    step_rows: tuple[int, ...]
    step_tokens: tuple[tuple[int, ...], ...]
    step_seconds: tuple[tuple[float, ...], ...]
    draft_rows: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()
    catchup_seconds_per_token: float = 0.0

    def __post_init__(self) -> None:
        if not self.step_rows or len(self.step_rows) != len(self.step_tokens) or len(
                self.step_tokens) != len(self.step_seconds):
            raise ValueError("SpecCosts: one token grid and one time grid per row count")
        if list(self.step_rows) != sorted(set(self.step_rows)):
            raise ValueError("SpecCosts: step_rows must increase")
        for tokens, seconds in zip(self.step_tokens, self.step_seconds):
            if not tokens or len(tokens) != len(seconds) or list(tokens) != sorted(set(tokens)):
                raise ValueError("SpecCosts: each token grid must increase and match its times")
        if len(self.draft_rows) != len(self.draft_seconds):
            raise ValueError("SpecCosts: one draft time per draft row count")
        if not self.catchup_seconds_per_token >= 0.0:
            raise ValueError("SpecCosts: catchup_seconds_per_token must be >= 0")

    def step_time(self, rows: int, tokens: int) -> float:
        """Seconds of a step of `rows` rows and `tokens` tokens: each measured row count's
        times interpolated at the same number of tokens beyond one per row
        (tokens - rows), then between the row counts around `rows`."""
        extra = tokens - rows
        at = [_interp([t - r for t in ts], s, extra)
              for r, ts, s in zip(self.step_rows, self.step_tokens, self.step_seconds)]
        return _interp(self.step_rows, at, rows)

    def draft_time(self, rows: int) -> float:
        """Seconds of one draft forward over `rows` single-token rows (0 without a model
        or for no rows)."""
        if not self.draft_rows or rows <= 0:
            return 0.0
        return _interp(self.draft_rows, self.draft_seconds, rows)

    @property
    def has_draft_model(self) -> bool:
        return bool(self.draft_rows)


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted proposed tokens and of rejections (a verification that
    did not accept all it ran ends in one rejection)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def observe(self, num_proposed: int, num_accepted: int, forget: float = FORGET) -> None:
        if num_proposed <= 0:
            return
        self.accepted = self.accepted * forget + num_accepted
        self.rejected = self.rejected * forget + (num_accepted < num_proposed)

    def idle(self, forget: float = IDLE_FORGET) -> None:
        self.accepted *= forget
        self.rejected *= forget

    def rate(self, prior: float) -> float:
        """The geometric model's acceptance rate: accepted / (accepted + rejections),
        with PRIOR_WEIGHT pseudo-observations at `prior`."""
        return ((self.accepted + prior * PRIOR_WEIGHT)
                / (self.accepted + self.rejected + PRIOR_WEIGHT))


def expected_tokens(rate: float, num_proposed: int) -> float:
    """Expected tokens of one verification: 1 + a + ... + a^k."""
    return sum(rate ** j for j in range(num_proposed + 1))


def plan_proposals(rates: Sequence[float], max_tokens: Sequence[int], num_rows: int,
                   base_tokens: int, costs: SpecCosts, draft_cost: bool,
                   max_step_tokens: int | None = None,
                   first_costs: Sequence[float] | None = None) -> list[int]:
    """Proposed tokens per request (request i gets at most max_tokens[i]) maximizing
    expected tokens per second of a step of `num_rows` rows and `base_tokens` tokens
    without speculation (each row is expected to give one token).

    Greedy on marginal value: the j-th proposed token of request i adds rate_i^j expected
    tokens and costs the step's time at one more token, plus (`draft_cost`) one more row
    in the draft's j-th forward pass (a new pass when none of the batch drafts that far).
    A token is added while the best one raises tokens per second; within one depth the
    best is the request of highest rate, so one candidate per depth is compared each
    round. The step never grows past `max_step_tokens`.

    `first_costs[i]`: seconds that request i's first proposed token costs on top (a
    draft's catch-up, amortized by the caller). The first tokens are then ordered by
    rate over cost (the step's marginal token plus the request's own), not by rate."""
    n = len(rates)
    k = [0] * n
    if n == 0:
        return k
    depth = max(max_tokens, default=0)
    tokens = base_tokens
    step = costs.step_time(num_rows, tokens)
    own = list(first_costs) if first_costs is not None else [0.0] * n
    unit = max(costs.step_time(num_rows, tokens + 1) - step, 1e-9)
    # heaps[j]: (sort key, request) of the requests whose next token would be their
    # (j+1)-th, the best first.
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(depth)]
    for i in range(n):
        if max_tokens[i] > 0 and rates[i] > 0.0:
            heaps[0].append((-rates[i] * unit / (unit + own[i]), i))
    heapq.heapify(heaps[0])
    rows_at = [0] * (depth + 1)  # rows_at[j]: requests drafting a (j+1)-th token
    value = float(max(num_rows, 1))
    spent = 0.0  # the first tokens' own costs taken so far
    limit = max_step_tokens if max_step_tokens is not None else float("inf")
    while tokens < limit:
        current = step + spent + draft_total(costs, rows_at, draft_cost)
        next_step = costs.step_time(num_rows, tokens + 1)
        best = None
        for j in range(depth):
            if not heaps[j]:
                continue
            i = heaps[j][0][1]
            gain = rates[i] ** (j + 1)
            extra = next_step - step + (own[i] if j == 0 else 0.0)
            if draft_cost:
                extra += costs.draft_time(rows_at[j] + 1) - costs.draft_time(rows_at[j])
            total = current + extra
            score = (value + gain) / total if total > 0 else float("inf")
            if best is None or score > best[0]:
                best = (score, j, gain)
        if best is None or (current > 0 and best[0] <= value / current):
            break
        _, j, gain = best
        _, i = heapq.heappop(heaps[j])
        k[i] += 1
        rows_at[j] += 1
        tokens += 1
        value += gain
        step = next_step
        if j == 0:
            spent += own[i]
        if j + 1 < max_tokens[i]:
            heapq.heappush(heaps[j + 1], (-rates[i], i))
    return k


def draft_total(costs: SpecCosts, rows_at: Sequence[int], draft_cost: bool) -> float:
    """Seconds of the draft's forward passes, rows_at[j] rows in the (j+1)-th."""
    if not draft_cost:
        return 0.0
    return sum(costs.draft_time(r) for r in rows_at if r)


@dataclass
class SpecDecodeStats:
    """Counters with vLLM's meanings: a draft is one request's proposed tokens verified in
    one step; accepted_per_position[j] counts drafts whose (j+1)-th token was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified draft, the model's own included (vLLM's mean acceptance
        length): 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_accepted_length": self.mean_accepted_length}


@dataclass
class SpecCandidate:
    """A decoding request the scheduler may run proposed tokens for."""

    request_id: str
    max_tokens: int
    """Proposed tokens it has (cut to what may still become output)."""


@dataclass
class ProposalCandidate:
    """A request the proposer may draft for after this step."""

    request_id: str
    num_tokens: int
    """Its tokens once this step's are in (what a draft must have caught up on)."""
    remaining: int
    """Output tokens it may still make after this step."""
