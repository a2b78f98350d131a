"""The one path from EngineCore's steps to whatever watches them.

Owns `StepObservers`: the sinks of the per-step calls EngineCore makes (an arrival, a
step scheduled, a step done, an end outside a step, close). The `--trace FILE` writer
(treadle.engine.trace) and the in-memory recorder behind the dashboard and request
timelines (treadle.engine.timeline) are both sinks, so one set of calls in the core
feeds both. A sink may lack `record_scheduled`; extra arguments of `record_step` (a
newer core passing more facts) reach every sink, which takes what it knows.

A failing sink is logged and dropped: watching the engine must never stop it. This
module decides nothing and must not do work of its own per step beyond the calls.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class StepObservers:
    """A fan-out of step calls; falsy when nothing watches (the core then skips them)."""

    def __init__(self, sinks=()) -> None:
        self._sinks: tuple = tuple(sinks)

    def add(self, sink) -> None:
        """Watch from now on (call on the thread that steps the engine, between steps)."""
        self._sinks = (*self._sinks, sink)

    def __bool__(self) -> bool:
        return bool(self._sinks)

    def __len__(self) -> int:
        return len(self._sinks)

    def _call(self, name: str, *args, **kwargs) -> None:
        for sink in self._sinks:
            method = getattr(sink, name, None)
            if method is None:
                continue
            try:
                method(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a broken observer must not stop the engine
                logger.exception("step observer %s failed in %s: dropped",
                                 type(sink).__name__, name)
                self._sinks = tuple(s for s in self._sinks if s is not sink)

    def record_arrival(self, request) -> None:
        self._call("record_arrival", request)

    def record_scheduled(self, step: int, scheduler_output) -> None:
        """Right after `schedule()`: what only the schedule time knows (preemption kinds)."""
        self._call("record_scheduled", step, scheduler_output)

    def record_step(self, *args, **kwargs) -> None:
        self._call("record_step", *args, **kwargs)

    def record_end(self, request_id: str, reason: str) -> None:
        self._call("record_end", request_id, reason)

    def close(self) -> None:
        self._call("close")
