"""`BatchRunner`: drives every unfinished batch of a store to its end, on the event loop.

Owns the life of a batch after its creation: validation (in a thread), handing its lines
to the engine through the line executor it is given (server/batch_lines.py: the serving
object, as a live request), at most `window` lines in flight across all batches, taken
from the open batches in turn (a small batch is not stuck behind a large one), each
line's outcome committed before the line counts as done, then finalization (output and
error files). A cancelled batch (`cancelling`) or one past its completion window has its
in-flight lines aborted at once (the executor sees the line's client go away: the engine
drops it before its next step) and ends with the answers it has. At start it resumes
whatever a dead server left: lines with no committed outcome run (again), so every line
is answered exactly once. While the server shuts down or its engine is dead nothing new
starts, and lines cut off that way are not recorded (they run again after a restart).
Once a minute it sweeps away files past their expiry. It decides nothing about
scheduling inside the engine (batch lines ask for the lowest band there) and holds no
SQL (treadle/batch/store.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from treadle.batch.lines import InputLine, output_line
from treadle.batch.store import BatchStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineResult:
    """A line's answer: the HTTP status and body a live call would have had."""

    status_code: int
    body: dict


@dataclass(frozen=True)
class Owner:
    """Who a batch's lines run as: the tenant and the models its key may use."""

    tenant: str
    models: tuple[str, ...] | None = None


LineExecutor = Callable[[InputLine, Owner, asyncio.Event], Awaitable[LineResult | None]]
"""(line, owner, cancelled) -> the line's answer, or None when it was cut off (`cancelled`
set, the server shutting down): then nothing is recorded."""

TRANSIENT_STATUSES = (503,)
"""Answers that say the server could not serve the line now, not what the line is worth:
never recorded (the line runs again)."""


@dataclass
class _Active:
    """A batch being run: its lines not yet started and those in flight."""

    batch_id: str
    owner: Owner
    expires_at: int
    pending: deque[int] = field(default_factory=deque)
    in_flight: dict[int, asyncio.Event] = field(default_factory=dict)
    ending: str | None = None
    """Why it stops early: 'cancelled' or 'expired' (None: runs to completion)."""


class BatchRunner:
    """Runs the store's open batches through `execute`, `window` lines at a time."""

    POLL_S = 0.5
    """Longest sleep between two looks at the store (new batches and cancels wake it)."""
    SWEEP_S = 60.0
    """Seconds between two sweeps of expired files."""

    def __init__(self, store: BatchStore, execute: LineExecutor, window: int,
                 max_lines: int, paused: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.execute, self.window = store, execute, window
        self.max_lines = max_lines
        self.paused, self.clock = paused, clock
        self._active: dict[str, _Active] = {}
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self._turn = 0
        self._swept_at = -self.SWEEP_S

    @property
    def num_in_flight(self) -> int:
        return sum(len(a.in_flight) for a in self._active.values())

    def start(self) -> None:
        """Start driving batches (call on the event loop that will serve them)."""
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        """A batch was created or cancelled: look at the store now."""
        self._wake.set()

    async def stop(self) -> None:
        """Cut off every line in flight (none recorded) and stop."""
        self._stopping = True
        for active in self._active.values():
            for cancelled in active.in_flight.values():
                cancelled.set()
        self._wake.set()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.step()
            except Exception:  # a store failure must not end the batches for good
                logger.exception("batch runner step failed; retrying")
                await asyncio.sleep(1.0)
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), self.POLL_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def step(self) -> None:
        """One look at the store: validate, stop, finalize and start what is due."""
        if self.paused():
            for active in self._active.values():
                for cancelled in active.in_flight.values():
                    cancelled.set()
            return
        now = self.clock()
        if now - self._swept_at >= self.SWEEP_S:
            self._swept_at = now
            await asyncio.to_thread(self.store.sweep_expired)
        for batch in await asyncio.to_thread(self.store.open_batches):
            await self._advance(batch, now)
        self._fill()

    async def _advance(self, batch: dict, now: float) -> None:
        batch_id, status = batch["id"], batch["status"]
        if status == "validating" and now < batch["expires_at"]:
            status = await asyncio.to_thread(self.store.validate, batch_id, self.max_lines)
            if status != "in_progress":
                return
        active = self._active.get(batch_id)
        if active is None and status in ("in_progress", "finalizing"):
            active = _Active(batch_id, Owner(
                batch["tenant"], None if batch["models"] is None else tuple(batch["models"])),
                batch["expires_at"])
            if status == "in_progress":
                active.pending.extend(await asyncio.to_thread(self.store.pending_lines,
                                                              batch_id))
            self._active[batch_id] = active
        if status == "cancelling":
            await self._end(batch_id, active, "cancelled")
        elif now >= batch["expires_at"] and status in ("validating", "in_progress"):
            await self._end(batch_id, active, "expired")
        elif status == "finalizing" or (active is not None and active.ending is None
                                        and not active.pending and not active.in_flight):
            await asyncio.to_thread(self.store.mark_finalizing, batch_id)
            await asyncio.to_thread(self.store.finalize, batch_id, "completed")
            self._active.pop(batch_id, None)
            logger.info("batch %s completed", batch_id)

    async def _end(self, batch_id: str, active: _Active | None, why: str) -> None:
        """Stop a batch early: abort its lines in flight; once none is left, finalize it
        with the answers it has."""
        if active is not None:
            active.ending = why
            active.pending.clear()
            for cancelled in active.in_flight.values():
                cancelled.set()
            if active.in_flight:
                return  # each line's end wakes the loop
        await asyncio.to_thread(self.store.finalize, batch_id, why)
        self._active.pop(batch_id, None)
        logger.info("batch %s %s", batch_id, why)

    def _fill(self) -> None:
        """Start lines from the running batches in turn until the window is full."""
        running = [a for a in self._active.values() if a.ending is None and a.pending]
        in_flight = self.num_in_flight
        while running and in_flight < self.window and not self._stopping:
            self._turn = (self._turn + 1) % len(running)
            active = running[self._turn]
            line_no = active.pending.popleft()
            cancelled = asyncio.Event()
            active.in_flight[line_no] = cancelled
            task = asyncio.get_running_loop().create_task(
                self._run_line(active, line_no, cancelled))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            in_flight += 1
            if not active.pending:
                running.remove(active)

    async def _run_line(self, active: _Active, line_no: int, cancelled: asyncio.Event) -> None:
        recorded = False
        try:
            line = await asyncio.to_thread(self.store.line, active.batch_id, line_no)
            result = await self.execute(line, active.owner, cancelled)
            if result is not None and result.status_code not in TRANSIENT_STATUSES:
                answer = output_line(line.custom_id, result.status_code, result.body)
                await asyncio.to_thread(self.store.record_outcome, active.batch_id, line_no,
                                        result.status_code, answer)
                recorded = True
        except Exception:
            logger.exception("batch %s line %d failed to run; it will run again",
                             active.batch_id, line_no)
        finally:
            active.in_flight.pop(line_no, None)
            if not recorded and active.ending is None and not self._stopping:
                active.pending.appendleft(line_no)  # cut off (pause, failure): run again
            self._wake.set()
