"""Async plumbing of the routes: several requests' outputs merged into one stream.

A batched completions request runs one engine request per prompt; `merge` yields
(prompt index, output) in the order outputs arrive, so their chunks interleave, and
closing it closes every source (which aborts their engine requests). It knows nothing
of HTTP or of the engine beyond async iterators.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

_DONE = object()


async def merge(sources: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index of the source, item) from every source as items come; an exception in
    one source is raised here (after the others are closed)."""
    if len(sources) == 1:  # the common case: no tasks
        source = sources[0]
        try:
            async for item in source:
                yield 0, item
        finally:
            await source.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator) -> None:
        try:
            async for item in source:
                await queue.put((i, item))
            await queue.put((i, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            await source.aclose()


async def latest_per_source(merged):
    """From (source index, output) pairs: the latest output of every source, in order."""
    latest: dict[int, object] = {}
    try:
        async for i, output in merged:
            latest[i] = output
            yield [latest[k] for k in sorted(latest)]
    finally:
        await merged.aclose()
