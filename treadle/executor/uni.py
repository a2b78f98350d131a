"""The `uni` executor: one worker in the engine's own process and thread (the default).

Calls go straight to the Worker; messages are passed by reference, never copied, which
is why the scheduler hands the worker only lists it will not change afterwards.

`worker` is the in-process Worker, public for white-box tests only (its model, tensors
and kernels, which no other executor can hand out); engine code, P/D and benchmarks
reach the workers through `collective_rpc`, the same on every executor.
"""

from __future__ import annotations

from treadle.config import EngineConfig
from treadle.core.kv.config import KVCacheConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.executor.base import Executor, check_rpc_method


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        from treadle.worker.worker import Worker  # torch is imported with the worker

        super().__init__()
        self._worker = Worker(config)

    @property
    def worker(self):
        """The in-process Worker, for white-box tests only (see the module docstring)."""
        return self._worker

    def load(self) -> WorkerInfo:
        return self._worker.load()

    def initialize_cache(self, kv_config: KVCacheConfig) -> None:
        self._worker.initialize_cache(kv_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        check_rpc_method(method)
        return [getattr(self._worker, method)(*args, **kwargs)]
