"""The `mp` executor: the worker in a child process, step messages over a socket.

Owns the child process (`python -m treadle.executor.mp_worker`, a fresh interpreter: a
user's script is never re-imported, as a multiprocessing spawn would do) and the
connection to it (multiprocessing's Connection over a socketpair: pickled messages with
length framing). Every call waits for the answer while watching the process: a worker
that dies surfaces at once as WorkerDiedError (its end of the socket closes), never as a
hang. The child exits when the parent's end closes, so it cannot outlive the engine.
One worker for now; tensor parallelism adds ranks.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection

from treadle.config import EngineConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.executor.base import Executor, WorkerDiedError

logger = logging.getLogger(__name__)

_POLL_S = 0.1
"""How often a call waiting for its answer checks that the process is alive."""


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    conn.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MPExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        parent_end, child_end = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.executor.mp_worker", str(child_end.fileno()),
             str(logging.getLogger().getEffectiveLevel())],
            pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL)
        child_end.close()
        self._conn = Connection(parent_end.detach())
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        self._dead: str | None = None
        self._call("create", config)

    def _call(self, method: str, *args):
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        try:
            self._conn.send((method, args))
            while not self._conn.poll(_POLL_S):
                if self._proc.poll() is not None:
                    break
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            self._dead = f"the worker process (pid {self._proc.pid}) exited with code {code}"
            raise WorkerDiedError(self._dead) from None
        if kind == "error":
            exc, text = payload
            if exc is None:
                raise RuntimeError(f"worker failed in {method}:\n{text}")
            exc.add_note(f"(raised in the worker process, in {method}:)\n{text}")
            raise exc
        return payload

    def load(self) -> WorkerInfo:
        return self._call("load")

    def initialize_cache(self, num_kv_blocks: int, num_swap_blocks: int) -> None:
        self._call("initialize_cache", num_kv_blocks, num_swap_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def check_health(self) -> None:
        if self._dead is None and self._proc.poll() is not None:
            self._dead = (f"the worker process (pid {self._proc.pid}) exited with code "
                          f"{self._proc.returncode}")
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def shutdown(self) -> None:
        self._finalizer()
