"""Threads that do background work at the lowest priority the machine offers.

Grammar compiles (structured/compiler.py, worker/grammar.py) and the KV cache's page
population (worker/cpu/kv_prefault.py) run beside the engine's step thread on the same
few cores. At normal priority each of them takes a core's time slice from the step
thread or one of its OpenMP teammates, and every thread of a parallel region then waits
for the one that was descheduled (issue 49 measured a compile stretching other streams'
token gaps 5.3x). In the idle scheduling class a thread runs only on a core nothing else
wants, and the scheduler takes the core back at once when something else wakes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

logger = logging.getLogger(__name__)


def lower_thread_priority() -> str:
    """Put the calling thread in the idle scheduling class (Linux SCHED_IDLE: it runs
    only on a core nothing else wants), or at nice 19 where that is not available; the
    class it got ('idle', 'nice 19' or 'normal'). Linux schedules threads, so this
    leaves the rest of the process as it was."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"
    except (AttributeError, OSError) as exc:
        logger.debug("background thread runs at normal priority: %s", exc)
        return "normal"


def idle_thread_pool(max_workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads run at the idle scheduling class (lower_thread_priority):
    where grammars are compiled, by the server and by a worker."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix=name, initializer=lower_thread_priority)
