"""How many prompt tokens a step that carries decodes may run.

A decoding request's time between tokens is the length of the steps it rides in, and a
step's length is its fixed cost plus its tokens' (core/step_cost.py). A full prefill
chunk beside the decodes (`max_num_batched_tokens`, 512) is what sets the p99 gap of a
served stream: on the 2-core Xeon of docs/scheduling.md the p99 time between tokens
missed a 200 ms target at 2.1 req/s with 512-token chunks and held to 3.6 req/s with
128-token chunks (Sarathi-Serve's point: the chunk is chosen for the gap). A step with no
decode in it keeps the whole budget, so prompts alone (an offline batch's start, an idle
server's first request) still run in big chunks.

`decode_step_prefill_tokens` is the bound: -1 (the default) none; 0 (auto) what
`GAP_SHARE_OF_FIXED` step fixed costs buy by the measured line, so a step that carries
decodes lasts at most about that many times plus one its fixed cost in the line's terms;
a number, that many tokens. Off by default because the gap it buys costs first tokens: on
the azure-conv replay at low load (docs/scheduling.md) auto took the p99 time between
tokens from 148 to 124 ms but the p99 TTFT from 653 to 997 ms (a long prompt in small
chunks, each step also carrying every decode); under a p99 TBT target near capacity it
is the other way round (`treadle bench capacity`: [2.83, 3.53) req/s without, 3.55-4.16
with). This module decides only the number; core/step_plan.py applies it (`budget_for`).
"""

from __future__ import annotations

import math

from treadle.config import SchedulerConfig
from treadle.core.step_cost import StepCostModel

GAP_SHARE_OF_FIXED = 6.0
"""Prompt tokens beside decodes: what this many fixed costs buy by the step cost line, so
a mixed step lasts about seven fixed costs and prefill keeps 6/7 of its efficiency.
Measured with `treadle bench capacity` (fcfs, p99 TTFT 2 s and TBT 200 ms, SmolLM2-135M
bf16, 15 s probes, the quiet 2-core Xeon; each range is [last rate met, first missed)):
no bound [2.83, 3.53) req/s, missed on the gap (p99 TBT 249 ms); 3 fixed costs
[3.80, 4.43); 4 [3.10, 3.72); 6 [4.16, 4.76), p99 TBT 163 ms at 4.16. Below 6 the misses
were TTFT's (a long prompt in small chunks), with the gap far under its target, and the
spread between 3 and 4 is the probes' noise. Offline throughput (64 requests at once,
three alternating runs): 338 output tok/s with it, 333 without."""


def decode_step_prefill_tokens(config: SchedulerConfig, costs: StepCostModel) -> int | None:
    """Most prompt tokens a step that carries decodes may run (None: no bound)."""
    configured = config.decode_step_prefill_tokens
    ceiling = config.max_num_batched_tokens
    if configured < 0 or not config.enable_chunked_prefill:
        return None  # off, or prompts are never split (a bound would never admit one)
    if configured > 0:
        return min(configured, ceiling)
    if costs.per_token_s <= 0.0:  # a token costs nothing measurable: no bound needed
        return None
    return max(1, min(ceiling, math.floor(GAP_SHARE_OF_FIXED * costs.fixed_s
                                          / costs.per_token_s)))
