"""A bounded CPU hog beside the engine: `--background-load N` of the benchmarks.

Owns starting N busy child processes (one busy thread each: a pure-Python spin, so the
load is the same whatever the engine's kernels do), each with its own deadline so that
none outlives a benchmark that died, and ending them by PID. It measures nothing and
decides nothing: a benchmark runs its systems inside `background_load(N)` and reports
the load it ran under. Run as `python -m treadle.measure.background_load SECONDS` it is
one busy child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

MAX_SECONDS = 6 * 3600.0
"""A child spins at most this long, even if nothing ends it (its own deadline)."""


def spin(seconds: float) -> int:
    """Keep one core busy for `seconds` (the child's body); the number of loop rounds."""
    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline:
        for _ in range(10_000):
            pass
        rounds += 1
    return rounds


class BackgroundLoad:
    """N busy child processes started now; `stop()` ends each by its PID."""

    def __init__(self, num_threads: int, max_seconds: float = MAX_SECONDS) -> None:
        if num_threads < 0:
            raise ValueError(f"background load must be >= 0 busy threads, got {num_threads}")
        if max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
        self.num_threads = num_threads
        self.procs: list[subprocess.Popen] = [
            subprocess.Popen([sys.executable, "-m", __name__, str(max_seconds)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for _ in range(num_threads)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> int:
        """How many of the children still spin."""
        return sum(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """End every child by its PID and reap it."""
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


@contextmanager
def background_load(num_threads: int, max_seconds: float = MAX_SECONDS
                    ) -> Iterator[BackgroundLoad]:
    """N busy threads (child processes) for the duration of the block; none when N is 0."""
    load = BackgroundLoad(num_threads, max_seconds)
    try:
        yield load
    finally:
        load.stop()


if __name__ == "__main__":
    spin(float(sys.argv[1]) if len(sys.argv) > 1 else MAX_SECONDS)
