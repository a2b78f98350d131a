"""The waiting queue: the order in which waiting requests are offered to the scheduler.

FCFS for now; preempted requests go back to the front so they resume before new
admissions. The scheduler only uses peek / pop / push_front / push_back / remove.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

from treadle.request import Request


class FCFSQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push_back(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
