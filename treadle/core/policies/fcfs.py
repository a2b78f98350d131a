"""First come, first served: the default policy.

Requests run in arrival order; a request preempted by recompute goes back to the front
of the queue. Running requests come first, then swapped-out ones, then waiting ones
(`orders_by_urgency` False); a waiting request never preempts a running one, since none
is ahead of it in line.
"""

from __future__ import annotations

from typing import ClassVar

from treadle.core.policies.base import SchedulingPolicy
from treadle.core.request_queue import FCFSQueue, PolicyQueue
from treadle.request import Request


class FCFSPolicy(SchedulingPolicy):
    """Arrival order (urgency: the arrival time, in seconds)."""

    orders_by_urgency: ClassVar[bool] = False
    may_preempt_at_admission: ClassVar[bool] = False

    def urgency(self, request: Request, now: float) -> float:
        return request.arrival_time

    def make_queue(self) -> FCFSQueue | PolicyQueue:
        return FCFSQueue()


POLICY = FCFSPolicy
"""The policy of this module (what `policy_class` loads for its name)."""
