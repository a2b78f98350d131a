"""Makespan: the longest remaining output first, admissions paced to the longest request.

For a batch whose lengths are known (max_tokens or length hints, as in an offline run that
ignores EOS). The longest request decodes one token a step however the others are
scheduled, so the run lasts at least that many steps; `paced_rows` running requests a
step finish the others within them. Decode steps keep enough rows that their linears are
not only reading weights, and the run does not end in a long tail of steps for the few
longest requests. Holding requests back costs their time to first token: it is meant for
throughput, not for interactive serving.
"""

from __future__ import annotations

from typing import ClassVar, Iterable

from treadle.config import SchedulerConfig
from treadle.core.fair_share import FairShareLedger
from treadle.core.policies.base import SchedulingPolicy
from treadle.core.policy import remaining_outputs
from treadle.request import Request


def paced_rows(remaining: Iterable[int], min_rows: int) -> int:
    """The makespan policy's cap on running requests: enough that the remaining outputs
    of every request (`remaining`, one figure each) are spread over as many steps as the
    longest of them needs, and never fewer than `min_rows`.

    The longest request decodes one token a step however the others are scheduled, so
    the run lasts at least that many steps; `ceil(sum / max)` rows a step finish the
    others within them. Running more at once ends the short requests early and leaves the
    long ones to decode alone, in steps whose time goes to reading the weights for a few
    rows; running fewer stretches the run past the longest request."""
    total, longest = 0, 0
    for n in remaining:
        total += n
        longest = max(longest, n)
    if longest == 0:
        return max(min_rows, 1)
    return max(min_rows, -(-total // longest))


class MakespanPolicy(SchedulingPolicy):
    """Urgency: minus the outputs still to generate (tokens; longest first); no more
    requests running than `paced_rows` needs (at least `makespan_min_rows`). Never
    preempts at admission: a running request loses nothing of its remaining length by
    waiting, so preempting it would only add work."""

    may_preempt_at_admission: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, ledger: FairShareLedger) -> None:
        super().__init__(config, ledger)
        self.min_rows = config.makespan_min_rows

    def urgency(self, request: Request, now: float) -> float:
        return -float(remaining_outputs(request))

    def max_running(self, requests: Iterable[Request]) -> int | None:
        return paced_rows((remaining_outputs(r) for r in requests), self.min_rows)


POLICY = MakespanPolicy
"""The policy of this module (what `policy_class` loads for its name)."""
