"""Shortest remaining work first, aged.

A request's urgency is the tokens it still has to go through (`remaining_work`), less
`srpt_aging_rate` tokens per second it has spent in the engine, so that long requests are
not passed forever. A waiting request shorter by the threshold (256 tokens by default)
may preempt a running one.
"""

from __future__ import annotations

from typing import ClassVar

from treadle.config import SchedulerConfig
from treadle.core.fair_share import FairShareLedger
from treadle.core.policies.base import SchedulingPolicy
from treadle.core.policy import remaining_outputs
from treadle.request import Request


def remaining_work(request: Request) -> int:
    """Tokens the request still has to go through: the ones not in the KV cache (the rest
    of its prompt, or everything after a recompute preemption) plus the outputs it has not
    generated yet, by its length hint when it has one, else by max_tokens."""
    return request.num_uncomputed_tokens + remaining_outputs(request)


def srpt_urgency(request: Request, now: float, aging_rate: float) -> float:
    """Shortest remaining work first, aged: `remaining_work - aging_rate * seconds_in_engine`.

    A request with W tokens of work outranks every request of w tokens arriving more than
    (W - w) / aging_rate seconds after it.
    """
    return remaining_work(request) - aging_rate * max(0.0, now - request.arrival_time)


class SRPTPolicy(SchedulingPolicy):
    """Urgency: remaining work in tokens, aged."""

    default_admission_threshold: ClassVar[float] = 256.0

    def __init__(self, config: SchedulerConfig, ledger: FairShareLedger) -> None:
        super().__init__(config, ledger)
        self.aging_rate = config.srpt_aging_rate

    def urgency(self, request: Request, now: float) -> float:
        return srpt_urgency(request, now, self.aging_rate)


POLICY = SRPTPolicy
"""The policy of this module (what `policy_class` loads for its name)."""
