"""The waiting queues: where requests wait to be admitted, and in which order they are offered.

`FCFSQueue` keeps arrival order per band (every interactive request before any batch
one), and preempted requests go back to the front of their band so they resume before
new admissions. `PolicyQueue` holds its requests unordered and hands them
out sorted by a key the scheduler passes in (the policy's order key, from
`treadle.core.policies`), because that order depends on the clock and, for the fair policy,
on counters that change every step. Both offer the same small protocol: push_back,
push_front, remove, `in_order(key)`, len and iteration; each policy says which it uses
(`SchedulingPolicy.make_queue`). Queues hold requests; they never decide policy
themselves or touch KV memory.
"""

from __future__ import annotations

from collections import deque
from itertools import chain
from typing import Any, Callable, Iterator

from treadle.request import BATCH, Request


class FCFSQueue:
    """First come, first served, interactive requests before batch ones."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._batch: deque[Request] = deque()

    def _band(self, request: Request) -> deque[Request]:
        return self._batch if request.band == BATCH else self._queue

    def push_back(self, request: Request) -> None:
        self._band(request).append(request)

    def push_front(self, request: Request) -> None:
        self._band(request).appendleft(request)

    def peek(self) -> Request:
        return self._queue[0] if self._queue else self._batch[0]

    def pop(self) -> Request:
        return self._queue.popleft() if self._queue else self._batch.popleft()

    def remove(self, request: Request) -> None:
        self._band(request).remove(request)

    def in_order(self, key: Callable[[Request], Any] | None = None) -> list[Request]:
        """The requests front first (the key is ignored: the queue's order is the order)."""
        return [*self._queue, *self._batch]

    def in_band(self, band: int) -> list[Request]:
        """The requests of one band (0 interactive, 1 batch), front first."""
        return list(self._batch if band else self._queue)

    def __len__(self) -> int:
        return len(self._queue) + len(self._batch)

    def __bool__(self) -> bool:
        return bool(self._queue) or bool(self._batch)

    def __iter__(self) -> Iterator[Request]:
        return chain(self._queue, self._batch)


class PolicyQueue:
    """Requests offered in the order of a key given at each look (most urgent first).

    Insertion order breaks no ties: the key must be a total order (a policy's order_key is).
    push_front is push_back: where a preempted request stands is the key's business.
    """

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}

    def push_back(self, request: Request) -> None:
        self._requests[request.request_id] = request

    push_front = push_back

    def remove(self, request: Request) -> None:
        del self._requests[request.request_id]

    def in_order(self, key: Callable[[Request], Any]) -> list[Request]:
        return sorted(self._requests.values(), key=key)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests.values()))

