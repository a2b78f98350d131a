"""Executors: how the engine core reaches its workers (`uni` in-process, `mp` in a child
process). `make_executor` builds the one `--distributed-executor-backend` names."""

from __future__ import annotations

from treadle.config import EngineConfig
from treadle.executor.base import Executor, WorkerDiedError

__all__ = ["Executor", "WorkerDiedError", "make_executor", "EXECUTORS"]

EXECUTORS = ("uni", "mp")


def make_executor(config: EngineConfig) -> Executor:
    name = config.parallel.distributed_executor_backend
    if name == "mp":
        from treadle.executor.mp import MPExecutor
        return MPExecutor(config)
    from treadle.executor.uni import UniExecutor
    return UniExecutor(config)
