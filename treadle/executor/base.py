"""The executor interface: how the engine core reaches its workers.

An executor owns the workers' lifetimes and carries the three calls of a worker's life
(treadle/worker/worker.py) across whatever boundary separates them from the core: none
(`uni`), a process (`mp`), later a cluster (`ray`) or several ranks. What crosses is
plain data: the EngineConfig, WorkerInfo, block counts, SchedulerOutput and
ModelRunnerOutput (treadle/core/outputs.py). The core sees no device, tensor or model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo


class WorkerDiedError(RuntimeError):
    """A worker process ended or stopped answering: the engine cannot go on."""


class Executor(ABC):
    """Runs the workers of one engine."""

    @abstractmethod
    def load(self) -> WorkerInfo:
        """Load the model on every worker; what they report (with several workers, the
        smallest KV capacity)."""

    @abstractmethod
    def initialize_cache(self, num_kv_blocks: int, num_swap_blocks: int) -> None:
        """Allocate the KV cache and swap space on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises WorkerDiedError when a worker is gone."""

    def check_health(self) -> None:
        """Raise WorkerDiedError when a worker is gone (cheap: called while idle)."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
