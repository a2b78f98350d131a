"""The `mp` executor: every worker rank in a child process on this node.

Owns the child processes (`python -m treadle.executor.mp_worker`, fresh interpreters: a
user's script is never re-imported, as a multiprocessing spawn would do), the cores each
rank is bound to, the shared-memory broadcast that carries every call to all ranks at
once (executor/shm_broadcast.py), and one socket per rank for the answers (multiprocessing's
Connection over a socketpair). Every call is broadcast; every rank answers a start-up
call, only the output rank (parallel_state) answers a step, and any rank answers with an
error when one happens. Up to `pipeline_parallel_size` steps may be in flight (`submit`,
then `receive` in order).

Waiting for an answer watches every rank: a rank that dies closes its socket and the wait
raises WorkerDiedError at once; a step that takes longer than `worker_timeout` counts as a
hang. Either way every rank is stopped (no orphans: the children also die with this
process, by PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

from treadle.config import EngineConfig
from treadle.core.kv.config import KVCacheConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.executor.base import (Executor, WorkerDiedError, check_rpc_method,
                                   merge_worker_infos)
from treadle.executor.shm_broadcast import ShmBroadcast

logger = logging.getLogger(__name__)

_POLL_S = 0.1
"""How often a wait for an answer checks that every process is alive."""


def rank_cores(world_size: int, num_threads: int | None) -> list[list[int]]:
    """The cores each rank is bound to: disjoint runs of this process's cores, so that
    ranks x threads never oversubscribe them (num_threads per rank, or an even share)."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = num_threads or max(1, len(cores) // world_size)
    if per_rank * world_size > len(cores):
        logger.warning("%d ranks x %d threads exceed the %d cores: ranks share cores",
                       world_size, per_rank, len(cores))
    return [[cores[(r * per_rank + i) % len(cores)] for i in range(per_rank)]
            for r in range(world_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], conns: list[Connection], broadcast: ShmBroadcast,
          state: dict) -> None:
    """Close the sockets, give the ranks `state['grace']` seconds to leave, kill the rest."""
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + state["grace"]
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    broadcast.close()


class MPExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        par = config.parallel
        self.world_size = par.world_size
        self.output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        self.max_in_flight = par.pipeline_parallel_size
        self.timeout = par.worker_timeout
        self._broadcast = ShmBroadcast.create(self.world_size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        cores = (rank_cores(self.world_size, config.model.num_threads)
                 if self.world_size > 1 else [[]])
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent_end, child_end = socket.socketpair()
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "treadle.executor.mp_worker", str(child_end.fileno()),
                 str(logging.getLogger().getEffectiveLevel()), str(rank),
                 self._broadcast.describe(), init_method, ",".join(map(str, cores[rank]))],
                pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL))
            child_end.close()
            self._conns.append(Connection(parent_end.detach()))
        self._stop_state = {"grace": 5.0}
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns,
                                           self._broadcast, self._stop_state)
        self._dead: str | None = None
        self._in_flight = 0
        self._early: deque = deque()
        self._call_all("create", config)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ----- calls ------------------------------------------------------------------------

    def _send(self, method: str, *args, **kwargs) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        self._broadcast.write(pickle.dumps((method, args, kwargs),
                                           protocol=pickle.HIGHEST_PROTOCOL),
                              self.check_health)

    def _answer(self, rank: int, timeout: float | None):
        """The next answer of `rank`; raises at once when any rank fails or dies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        target = self._conns[rank]
        while True:
            for conn in wait(self._conns, _POLL_S):
                index = self._conns.index(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    self._fail(f"worker rank {index} (pid {self._procs[index].pid}) exited "
                               f"with code {self._procs[index].wait()}")
                if kind == "error":
                    self._fail_with(index, payload)
                if conn is target:
                    return payload
                self._early.append((index, payload))  # another rank's start-up answer
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"worker rank {rank} gave no answer in {timeout:.0f} s "
                           "(worker_timeout): the workers are hung")

    def _call_all(self, method: str, *args, **kwargs) -> list:
        self._send(method, *args, **kwargs)
        answers = {}
        while self._early:
            index, payload = self._early.popleft()
            answers[index] = payload
        for rank in range(self.world_size):
            if rank not in answers:
                answers[rank] = self._answer(rank, None)
            while self._early:
                index, payload = self._early.popleft()
                answers[index] = payload
        return [answers[r] for r in range(self.world_size)]

    def _fail(self, reason: str):
        self._dead = reason
        self._stop_state["grace"] = 0.0  # the others may be stuck in a collective
        self.shutdown()
        raise WorkerDiedError(reason)

    def _exited_rank(self, besides: int, grace_s: float) -> tuple[int, int] | None:
        """(rank, exit code) of a worker process other than `besides` that has exited,
        waiting up to grace_s for one to; None if none did."""
        deadline = time.monotonic() + grace_s
        while True:
            for index, proc in enumerate(self._procs):
                if index != besides and proc.poll() is not None:
                    return index, proc.returncode
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _fail_with(self, rank: int, payload) -> None:
        exc, text = payload
        # A rank whose collective broke may answer before the dead peer's pipe closes:
        # name the rank that died, not the survivor's connection error.
        exited = self._exited_rank(rank, grace_s=1.0) if self.world_size > 1 else None
        if exited is not None:
            index, code = exited
            self._fail(f"worker rank {index} (pid {self._procs[index].pid}) exited with code "
                       f"{code}; rank {rank} then failed: {exc if exc is not None else text}")
        self._dead = f"worker rank {rank} failed"
        self._stop_state["grace"] = 0.0
        self.shutdown()
        if exc is None:
            raise RuntimeError(f"worker rank {rank} failed:\n{text}")
        exc.add_note(f"(raised in worker rank {rank}:)\n{text}")
        raise exc

    # ----- the executor interface ---------------------------------------------------------

    def load(self) -> WorkerInfo:
        return merge_worker_infos(self._call_all("load"))

    def initialize_cache(self, kv_config: KVCacheConfig) -> None:
        self._call_all("initialize_cache", kv_config)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._send("execute_model", scheduler_output)
        self._in_flight += 1

    def receive(self) -> ModelRunnerOutput:
        output = self._answer(self.output_rank, self.timeout)
        self._in_flight -= 1
        return output

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.receive()

    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        check_rpc_method(method)
        if self._in_flight:
            raise RuntimeError(f"collective_rpc({method!r}) while {self._in_flight} steps "
                               "are in flight: call it between steps")
        return self._call_all(method, *args, **kwargs)

    def check_health(self) -> None:
        if self._dead is None:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self._dead = (f"worker rank {rank} (pid {proc.pid}) exited with code "
                                  f"{proc.returncode}")
                    self._stop_state["grace"] = 0.0
                    self.shutdown()
                    break
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def shutdown(self) -> None:
        if self._finalizer.alive and self._dead is None:
            try:  # a clean stop: every rank leaves its loop
                self._broadcast.write(pickle.dumps(("shutdown", (), {})), self._no_wait)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self._finalizer()

    @staticmethod
    def _no_wait() -> None:
        raise TimeoutError
