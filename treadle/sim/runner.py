"""The simulated model runner: answers a SchedulerOutput with tokens, computing nothing.

Owns what the real runner would return to the scheduler, shaped exactly as a
ModelRunnerOutput: one token for every scheduled request that samples; with speculative
decoding, proposals for each request's next step (`num_spec_tokens`) and, when a step
scored proposals, the accepted ones (each accepted with probability `acceptance_rate`,
independently, up to the first rejection, as a rate: the tokens themselves mean
nothing) followed by the model's own token. Token ids are a constant below 256 (the
requests ignore EOS and run to max_tokens, as the benchmarks' do). Time is the step-time
model's business, not this module's.
"""

from __future__ import annotations

import random

from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput

SIM_TOKEN_ID = 5
"""The token every simulated step produces (a small int: no per-token allocation)."""


class SimRunner:
    """Deterministic (seeded) fake runner of the simulator."""

    def __init__(self, num_spec_tokens: int = 0, acceptance_rate: float = 0.0,
                 seed: int = 0) -> None:
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"spec_acceptance_rate must be in [0, 1], got {acceptance_rate}")
        self.num_spec_tokens = num_spec_tokens
        self.acceptance_rate = acceptance_rate
        self._rng = random.Random(seed)
        self.num_proposed = 0
        self.num_accepted = 0

    def __call__(self, output: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {}
        if not self.num_spec_tokens:
            for s in output.scheduled:
                if s.sample:
                    sampled[s.request_id] = [SIM_TOKEN_ID]
            return ModelRunnerOutput(sampled_token_ids=sampled)
        proposals: dict[str, list[int]] = {}
        rate, rand = self.acceptance_rate, self._rng.random
        for s in output.scheduled:
            if not s.sample:
                continue
            num_accepted = 0
            for _ in s.spec_token_ids:
                if rand() >= rate:
                    break
                num_accepted += 1
            self.num_proposed += len(s.spec_token_ids)
            self.num_accepted += num_accepted
            sampled[s.request_id] = [SIM_TOKEN_ID] * (num_accepted + 1)
            proposals[s.request_id] = [SIM_TOKEN_ID] * self.num_spec_tokens
        return ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=proposals)
