"""`ParallelConfig`: the executor, tensor and pipeline parallelism, worker timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.config.values import _help, parse_layer_partition


@dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: the executor, its workers, and how the model is split."""

    distributed_executor_backend: str = field(default="auto", metadata=_help(
        "uni (one worker in the engine's own process), mp (workers in child processes, "
        "one node), torchrun (ranks started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR), or "
        "auto (uni for one worker, mp for several)"))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "Ranks each layer is split over (heads, MLP columns, vocabulary)"))
    pipeline_parallel_size: int = field(default=1, metadata=_help(
        "Stages the layers are split into; up to this many step batches are in flight"))
    pp_layer_partition: str | None = field(default=None, metadata=_help(
        "Layers per pipeline stage, e.g. '8,8,7,7' (an even split when not given)"))
    worker_timeout: float = field(default=300.0, metadata=_help(
        "Seconds a step may take before the workers are declared hung and stopped"))
    stall_timeout: float = field(default=60.0, metadata=_help(
        "Seconds with work queued and no engine step before the engine reports itself "
        "stalled (GET /ready 503, treadle:engine_stalls_total, a log line of what the "
        "scheduler holds); a step is at most max_num_batched_tokens tokens, seconds on the "
        "slowest CPU (docs/scheduling.md)"))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        """The executor `auto` resolves to."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    def __post_init__(self) -> None:
        backends = ("auto", "uni", "mp", "torchrun")
        if self.distributed_executor_backend not in backends:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(backends)}, got {self.distributed_executor_backend!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError("distributed_executor_backend=uni runs one worker; "
                             f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}"
                             " needs mp or torchrun")
        partition = parse_layer_partition(self.pp_layer_partition)
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ValueError(f"pp_layer_partition gives {len(partition)} stages, "
                             f"pipeline_parallel_size is {self.pipeline_parallel_size}")
        if not self.worker_timeout > 0:
            raise ValueError(f"worker_timeout must be > 0 seconds, got {self.worker_timeout}")
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")


