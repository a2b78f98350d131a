"""The progress watchdog: an engine that holds work and makes no step is reported as stalled.

Owns the verdict "stalled" (work is queued and no step has been scheduled for
`stall_timeout` seconds), the thread that reaches it, and the log line that says what
the scheduler held when it did. The thread samples two numbers the engine keeps anyway,
every `interval` seconds: the scheduler's count of scheduled steps and whether it holds a
request a step could serve. The engine thread pays nothing, and both ways of being stuck
look the same from here: a step that never returns (a worker stopped by SIGSTOP, a hung
collective: the engine thread waits in the executor) and a loop that spins without
scheduling anything (vllm #45414: running 0, waiting 6, 0 tok/s for nine minutes while
/health said 200).

It decides nothing and stops nothing: the server's /ready reads `stalled` (a
readiness probe takes the replica out of rotation; /health, the liveness probe, stays
200 while the process serves: TGI #3241), the metrics count each stall, and the engine
goes on. A worker that stays hung past `worker_timeout` is still the executor's to stop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

logger = logging.getLogger(__name__)

_MAX_LISTED = 16
"""Requests named per queue in the stall's log line (the rest are counted)."""


class ProgressWatchdog:
    """Samples an engine's progress and says when it has stalled.

    `sample()` returns (scheduled steps so far, whether work is queued); `describe()` what
    the scheduler holds, for the log; `on_stall()` is called once when a stall starts."""

    def __init__(self, timeout_s: float, sample: Callable[[], tuple[int, bool]],
                 describe: Callable[[], str], on_stall: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "engine") -> None:
        if not timeout_s > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, max(0.05, timeout_s / 5))
        """How often the thread samples: a stall is seen within timeout + interval."""
        self._sample, self._describe, self._on_stall = sample, describe, on_stall
        self._clock, self._name = clock, name
        self._last_steps: int | None = None
        self._last_progress = clock()
        self._stalled_at: float | None = None
        self.stalled: str | None = None
        """Why the engine is stalled, or None while it makes progress (or has no work)."""
        self.num_stalls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, now: float | None = None) -> str | None:
        """Sample once; the stall's reason, or None."""
        now = self._clock() if now is None else now
        steps, has_work = self._sample()
        if steps != self._last_steps or not has_work:
            self._last_steps, self._last_progress = steps, now
            if self._stalled_at is not None:
                logger.warning("%s: steps resumed after a stall of %.1f s", self._name,
                               now - self._stalled_at + self.timeout_s)
                self._stalled_at = None
            self.stalled = None
            return None
        quiet = now - self._last_progress
        if quiet <= self.timeout_s:
            return None
        self.stalled = (f"{self._name} stalled: no step for {quiet:.0f} s with work queued "
                        f"(stall_timeout={self.timeout_s:g} s)")
        if self._stalled_at is None:
            self._stalled_at = now
            self.num_stalls += 1
            if self._on_stall is not None:
                self._on_stall()
            logger.error("%s; the scheduler holds: %s", self.stalled, self._describe())
        return self.stalled

    # ----- the thread ------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"treadle-{self._name}-"
                                            "watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a watchdog that dies watches nothing
                logger.exception("%s watchdog: a sample failed", self._name)


def _listed(requests: Iterable, now: float) -> str:
    items = []
    for request in requests:
        items.append(f"{request.request_id} ({request.status.name.lower()}, "
                     f"{request.num_computed_tokens}/{len(request.all_token_ids)} tokens, "
                     f"priority {request.priority}, {now - request.arrival_time:.0f} s old)")
    shown = ", ".join(items[:_MAX_LISTED])
    more = f", +{len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"[{shown}{more}]"


def _copy(container) -> list:
    """A copy of a queue the engine thread may be changing (a step stuck in the executor
    changes nothing; a spinning scheduler might): retried, else empty."""
    for _ in range(3):
        try:
            return list(container)
        except RuntimeError:  # changed size during iteration
            continue
    return []


def describe_scheduler(scheduler, now: float | None = None) -> str:
    """What a scheduler holds, for the stall's log line: its running, waiting, swapped and
    remote-KV requests (id, state, computed / total tokens, priority, age) and KV usage.
    Read from the watchdog's thread: only copies of the queues are iterated."""
    now = time.monotonic() if now is None else now
    kv = scheduler.kv
    parts = [f"running {_listed(_copy(scheduler.running), now)}",
             f"waiting {_listed(_copy(scheduler.waiting), now)}",
             f"swapped {_listed(_copy(scheduler.swapped), now)}"]
    remote = _copy(getattr(scheduler, "waiting_for_kv", {}).values())
    if remote:
        parts.append(f"waiting for remote KV {_listed(remote, now)}")
    parts.append(f"KV usage {kv.usage:.0%} of {kv.num_blocks} blocks; "
                 f"{scheduler.stats.num_steps} steps so far")
    return "; ".join(parts)


def core_watchdog(core, timeout_s: float, on_stall: Callable[[], None] | None = None,
                  has_pending: Callable[[], bool] | None = None) -> ProgressWatchdog:
    """The watchdog of an EngineCore: its scheduler's step count, its unfinished requests
    (or `has_pending()`: requests handed to the engine thread and not yet in the core),
    and its scheduler's state in the log."""
    scheduler = core.scheduler

    def sample() -> tuple[int, bool]:
        has_work = scheduler.has_unfinished_requests() or bool(core.num_steps_in_flight)
        return scheduler.stats.num_steps, has_work or (has_pending is not None
                                                         and has_pending())

    return ProgressWatchdog(timeout_s, sample, lambda: describe_scheduler(scheduler),
                            on_stall)
