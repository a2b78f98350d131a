"""Where a worker sits among the ranks of tensor and pipeline parallelism, and the
collectives between them.

Owns the rank layout (global rank = pp_rank * tp_size + tp_rank: the ranks of one
pipeline stage are consecutive), the torch.distributed process groups (one
tensor-parallel group per stage; point-to-point between a rank and the same tp_rank of
the next stage), the collectives the model calls (all-reduce inside a stage, gather of
logits to the stage's first rank, sending activations down the pipeline), the split of
layers into stages, and the time spent in collectives (reported per step). A single
worker has the trivial context `ParallelContext()`: every collective is a no-op.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any

import torch


def layer_partition(num_layers: int, pp_size: int, partition: list[int] | None = None
                    ) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: `partition` (layers per stage) when given,
    else as even as possible with the remainder on the first stages."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"pp_layer_partition {partition} must give {pp_size} stages of "
                             f">= 1 layer adding up to the model's {num_layers} layers")
        sizes = partition
    else:
        if num_layers < pp_size:
            raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's "
                             f"{num_layers} layers")
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (i < extra) for i in range(pp_size)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


@dataclass
class ParallelContext:
    """A worker's place among the ranks, and its collectives."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None
    """torch.distributed group of this stage's ranks (None with one rank)."""
    layer_range: tuple[int, int] | None = None
    """[start, end) of this stage's layers (None: all)."""
    comm_seconds: float = 0.0
    """Time spent in collectives since the last `take_comm_seconds`."""
    _handles: list = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The one rank that samples and returns the step's tokens: the first of the last
        stage."""
        return self.is_last_stage and self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the stage's ranks, in place (the row-parallel layers' partial sums)."""
        if self.tp_size > 1:
            t0 = time.perf_counter()
            torch.distributed.all_reduce(x, group=self.tp_group)
            self.comm_seconds += time.perf_counter() - t0
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shards of x concatenated along the last dim on the stage's first rank (None
        on the others): vocab-parallel logits."""
        if self.tp_size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        first = self.pp_rank * self.tp_size
        if self.tp_rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            torch.distributed.gather(x, parts, dst=first, group=self.tp_group)
            out = torch.cat(parts, dim=-1)
        else:
            torch.distributed.gather(x, None, dst=first, group=self.tp_group)
            out = None
        self.comm_seconds += time.perf_counter() - t0
        return out

    def send_next_stage(self, x: torch.Tensor) -> None:
        """Send activations to the same tp_rank of the next stage, without waiting for the
        transfer (the next send waits for this one: the tensor is kept until then)."""
        t0 = time.perf_counter()
        self.wait_sends()
        self._handles.append((torch.distributed.isend(x.contiguous(), self.rank + self.tp_size),
                              x))
        self.comm_seconds += time.perf_counter() - t0

    def wait_sends(self) -> None:
        for handle, _ in self._handles:
            handle.wait()
        self._handles.clear()

    def recv_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t0 = time.perf_counter()
        x = torch.empty(shape, dtype=dtype)
        torch.distributed.recv(x, self.rank - self.tp_size)
        self.comm_seconds += time.perf_counter() - t0
        return x

    def take_comm_seconds(self) -> float:
        seconds, self.comm_seconds = self.comm_seconds, 0.0
        return seconds


def leave_parallel() -> None:
    """Leave the process group, if this process joined one. A rank that exits with its
    gloo group still alive can abort in the group's destructor ("terminate called
    without an active exception") while its peer closes the connections."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def init_parallel(tp_size: int, pp_size: int, rank: int, init_method: str, backend: str,
                  num_layers: int | None = None, partition: list[int] | None = None,
                  timeout_s: float = 1800.0) -> ParallelContext:
    """Join the process group of tp_size * pp_size ranks and make this rank's context.

    Every rank makes every stage's tensor-parallel group (torch.distributed requires each
    group to be created by all ranks, in the same order)."""
    world = tp_size * pp_size
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, init_method=init_method, rank=rank,
                                             world_size=world,
                                             timeout=datetime.timedelta(seconds=timeout_s))
    ctx = ParallelContext(tp_size=tp_size, tp_rank=rank % tp_size, pp_size=pp_size,
                          pp_rank=rank // tp_size)
    if tp_size > 1:
        for stage in range(pp_size):
            group = torch.distributed.new_group(list(range(stage * tp_size,
                                                           (stage + 1) * tp_size)))
            if stage == ctx.pp_rank:
                ctx.tp_group = group
    if num_layers is not None:
        ctx.layer_range = layer_partition(num_layers, pp_size, partition)[ctx.pp_rank]
    return ctx
