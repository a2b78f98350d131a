"""Executors: how the engine core reaches its workers (`uni` in-process, `mp` in child
processes on one node, `torchrun` across nodes). `make_executor` builds the one
`--distributed-executor-backend` names (auto: uni for one worker, mp for several)."""

from __future__ import annotations

from treadle.config import EngineConfig
from treadle.executor.base import Executor, WorkerDiedError

__all__ = ["Executor", "WorkerDiedError", "make_executor", "EXECUTORS"]

EXECUTORS = ("uni", "mp", "torchrun")


def make_executor(config: EngineConfig) -> Executor:
    name = config.parallel.executor
    if name == "mp":
        from treadle.executor.mp import MPExecutor
        return MPExecutor(config)
    if name == "torchrun":
        from treadle.executor.torchrun import TorchrunExecutor
        return TorchrunExecutor(config)
    from treadle.executor.uni import UniExecutor
    return UniExecutor(config)
