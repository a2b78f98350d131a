"""The simulated clock: the one time source of a simulation.

Owns the current simulated time in seconds. The fleet sets it before each event (an
arrival, a step's start or end, a KV transfer), and every Scheduler of the simulation
reads it through its `clock` callable, so the production scheduler's aging, victim
losses and first-token times run on simulated time. It never goes backwards and never
reads the wall clock: the same inputs give the same simulation.
"""

from __future__ import annotations


class SimClock:
    """A callable returning the simulated time; `advance_to` moves it forward."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"the simulated clock cannot go back from {self.now} to {t}")
        self.now = t
