"""Scheduling policy as pure functions of request state.

Each function looks at requests and returns a choice; none of them changes state. The
scheduler calls them; tests call them directly.
"""

from __future__ import annotations

from typing import Sequence

from treadle.request import Request


def victim_key(request: Request) -> tuple[int, float]:
    """Sort key of preemption candidates: the largest key is preempted first.

    Least urgent first (the largest `priority` value, vLLM's convention that lower runs
    first), then the latest arrival, which has the least invested work under FCFS.
    """
    return (request.priority, request.arrival_time)


def choose_victim(candidates: Sequence[Request]) -> Request:
    """The running request to preempt when memory runs out."""
    if not candidates:
        raise ValueError("choose_victim needs at least one candidate")
    return max(candidates, key=victim_key)


def running_order(running: Sequence[Request]) -> list[Request]:
    """Order in which running requests take the step's token budget: decodes first.

    A request with one uncomputed token is decoding; one with more is mid-prefill (or
    recomputing). Decodes are cheap and latency-sensitive, so they never wait behind a
    prefill chunk. Within each group the order is kept (admission order).
    """
    return sorted(running, key=lambda r: r.num_uncomputed_tokens > 1)
