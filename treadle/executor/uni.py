"""The `uni` executor: one worker in the engine's own process (the default).

Calls go straight to the Worker; messages are passed by reference, never copied, which
is why the scheduler hands the worker only lists it will not change afterwards.

With `overlap_steps` the worker lives on a thread of its own, and every call to it (load,
the cache, each step, `collective_rpc`) runs there in the order made: `submit` returns at
once, so the engine processes the last step's outputs while the worker runs the next one
(the forward pass's C kernels and torch ops release the GIL). A call made while a step
runs waits for that step; its answer stays for `receive`. One thread for every call keeps
the worker's thread-local state (OpenMP's team, torch's thread count) in one place.

`worker` is the in-process Worker, public for white-box tests only (its model, tensors
and kernels, which no other executor can hand out); engine code, P/D and benchmarks
reach the workers through `collective_rpc`, the same on every executor.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque

from treadle.config import EngineConfig
from treadle.core.kv.config import KVCacheConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.executor.base import Executor, check_rpc_method


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self._thread = (concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="treadle-worker")
            if config.scheduler.overlap_steps else None)
        self._steps: deque[concurrent.futures.Future] = deque()
        """Steps submitted to the worker's thread, oldest first (overlap_steps)."""
        self._worker = self._call(_make_worker, config)

    def _call(self, fn, *args, **kwargs):
        """fn(*args) on the worker's thread when there is one (after the steps submitted
        before it), else here."""
        if self._thread is None:
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    @property
    def worker(self):
        """The in-process Worker, for white-box tests only (see the module docstring)."""
        return self._worker

    def load(self) -> WorkerInfo:
        return self._call(self._worker.load)

    def initialize_cache(self, kv_config: KVCacheConfig) -> None:
        self._call(self._worker.initialize_cache, kv_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call(self._worker.execute_model, scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self._thread is None:
            super().submit(scheduler_output)
            return
        self._steps.append(self._thread.submit(self._worker.execute_model, scheduler_output))

    def receive(self) -> ModelRunnerOutput:
        if self._thread is None:
            return super().receive()
        return self._steps.popleft().result()

    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        check_rpc_method(method)
        return [self._call(getattr(self._worker, method), *args, **kwargs)]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


def _make_worker(config: EngineConfig):
    from treadle.worker.worker import Worker  # torch is imported with the worker

    return Worker(config)
