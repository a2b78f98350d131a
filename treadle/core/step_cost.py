"""The engine's step costs as it measures them: seconds of a step from the tokens it runs.

Owns `StepCostModel`, a line `seconds = fixed_s + per_token_s x tokens` fitted by least
squares with exponential forgetting over the steps the engine has run (the engine core
feeds it each step's wall time, the simulator each simulated step's), starting from a
prior that the first steps outweigh; and the predictions built on it that the `slo`
policy orders by (`prefill_seconds`: a prompt's remaining chunks beside the running
decodes). It decides nothing and holds no request; no torch.

Why a line and not the worker's start-up probes (spec_decode's `SpecCosts`): those exist
only with speculation, are measured on an idle machine before traffic, and price rows x
proposed tokens; a deadline needs what steps take now, with this traffic, on this
machine (shared machines slow down and speed up), and a line in tokens is what a chunked
prefill's time follows (compute-bound chunks: ms per token; decode steps: the fixed part).
"""

from __future__ import annotations

import math

FORGET = 0.98
"""Weight kept by earlier steps at each new one (about the last 50 steps count)."""
PRIOR_FIXED_S = 0.02
PRIOR_PER_TOKEN_S = 2e-4
"""The prior before any step: 20 ms a step plus 0.2 ms a token (the benchmark model on a
2-core CPU is within a few times of it)."""
PRIOR_WEIGHT = 0.01
"""Weight of each of the prior's two pseudo-steps: the line before the first step, a
hundredth of one measured step after it."""


class StepCostModel:
    """seconds(tokens) = fixed_s + per_token_s x tokens, refitted after every step."""

    def __init__(self, forget: float = FORGET, prior_fixed_s: float = PRIOR_FIXED_S,
                 prior_per_token_s: float = PRIOR_PER_TOKEN_S, prior_tokens: int = 512) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.forget = forget
        self._s0 = self._s1 = self._s2 = self._sy = self._sxy = 0.0
        self.num_observations = 0
        for x in (1, max(2, prior_tokens)):  # two pseudo-steps on the prior's line
            self._add(float(x), prior_fixed_s + prior_per_token_s * x, PRIOR_WEIGHT)
        self.fixed_s = prior_fixed_s
        self.per_token_s = prior_per_token_s

    def _add(self, x: float, y: float, weight: float) -> None:
        self._s0 += weight
        self._s1 += weight * x
        self._s2 += weight * x * x
        self._sy += weight * y
        self._sxy += weight * x * y

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` scheduled tokens took `seconds`."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        f = self.forget
        self._s0 *= f
        self._s1 *= f
        self._s2 *= f
        self._sy *= f
        self._sxy *= f
        self._add(float(num_tokens), seconds, 1.0)
        self.num_observations += 1
        self._fit()

    def _fit(self) -> None:
        s0, s1 = self._s0, self._s1
        det = s0 * self._s2 - s1 * s1
        mean_y = self._sy / s0
        if det <= 1e-12 * s0 * max(self._s2, 1.0):  # every step the same size: no slope
            self.per_token_s = max(0.0, self.per_token_s)
            self.fixed_s = max(0.0, mean_y - self.per_token_s * s1 / s0)
            return
        slope = (s0 * self._sxy - s1 * self._sy) / det
        if slope < 0.0:  # noise on steps of similar sizes: the mean, flat
            self.per_token_s, self.fixed_s = 0.0, mean_y
            return
        self.per_token_s = slope
        self.fixed_s = max(0.0, (self._sy - slope * s1) / s0)

    def step_seconds(self, num_tokens: int) -> float:
        """Predicted seconds of a step of `num_tokens` tokens."""
        return self.fixed_s + self.per_token_s * max(0, num_tokens)

    def prefill_seconds(self, num_tokens: int, budget: int, num_decodes: int = 0) -> float:
        """Predicted seconds until `num_tokens` prompt tokens are computed in steps of
        `budget` tokens that also carry `num_decodes` running decodes (one token each):
        one fixed cost per chunk, every token at its price."""
        if num_tokens <= 0:
            return 0.0
        per_step = max(1, budget - num_decodes)
        num_steps = -(-num_tokens // per_step)
        return (num_steps * (self.fixed_s + self.per_token_s * min(num_decodes, budget - 1))
                + self.per_token_s * num_tokens)

    def describe(self) -> dict:
        return {"fixed_s": self.fixed_s, "per_token_s": self.per_token_s,
                "num_observations": self.num_observations}
