"""The executor interface: how the engine core reaches its workers.

An executor owns the workers' lifetimes and carries the three calls of a worker's life
(treadle/worker/worker.py) across whatever boundary separates them from the core: none
(`uni`), a process (`mp`), later a cluster (`ray`) or several ranks. What crosses is
plain data: the EngineConfig, WorkerInfo, block counts, SchedulerOutput and
ModelRunnerOutput (treadle/core/outputs.py). The core sees no device, tensor or model.
Beside those calls, `collective_rpc` reaches any public Worker method on every rank,
between steps: the one way to the workers (P/D's KV reads and writes, benchmarks'
probes). No module reaches past an executor to a worker object.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import deque

from treadle.core.kv.config import KVCacheConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo


class WorkerDiedError(RuntimeError):
    """A worker process ended or stopped answering: the engine cannot go on."""


def check_rpc_method(method: str) -> None:
    """collective_rpc reaches a Worker's public methods only."""
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise ValueError(f"collective_rpc: {method!r} is not a public Worker method")


def merge_worker_infos(infos: list[WorkerInfo]) -> WorkerInfo:
    """What several ranks report, as one: rank 0's facts, the smallest block counts (every
    rank must hold every block), and the output rank's measured speculation costs."""
    return dataclasses.replace(infos[0], num_kv_blocks=min(i.num_kv_blocks for i in infos),
                               num_swap_blocks=min(i.num_swap_blocks for i in infos),
                               spec_costs=next((i.spec_costs for i in infos
                                                if i.spec_costs is not None), None))


class Executor(ABC):
    """Runs the workers of one engine.

    `max_in_flight` steps may be submitted before the first answer is received (pipeline
    parallelism keeps one per stage busy); `execute_model` is submit + receive."""

    max_in_flight: int = 1

    def __init__(self) -> None:
        self._done: deque[ModelRunnerOutput] = deque()

    @abstractmethod
    def load(self) -> WorkerInfo:
        """Load the model on every worker; what they report (with several workers, the
        smallest KV capacity)."""

    @abstractmethod
    def initialize_cache(self, kv_config: KVCacheConfig) -> None:
        """Allocate the KV cache and swap space the engine core decided on (its layer
        groups and block counts, core/kv/config.py) on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises WorkerDiedError when a worker is gone."""

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for it (`receive` answers in submission order).
        Executors that run steps one at a time run it here."""
        self._done.append(self.execute_model(scheduler_output))

    def receive(self) -> ModelRunnerOutput:
        """The answer of the oldest submitted step."""
        return self._done.popleft()

    @abstractmethod
    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        """Call `method` of every rank's Worker with these arguments and return each
        rank's answer, in rank order: the one way to reach the workers beside the step
        (P/D's KV reads and writes, benchmarks' probes). Only between steps: a call while
        steps are in flight is an error. `method` must be a public Worker method."""

    def check_health(self) -> None:
        """Raise WorkerDiedError when a worker is gone (cheap: called while idle)."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
