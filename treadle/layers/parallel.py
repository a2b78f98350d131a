"""A rank's place among the ranks of tensor and pipeline parallelism, and the collectives
its model calls.

Owns the rank layout (global rank = pp_rank * tp_size + tp_rank: the ranks of one
pipeline stage are consecutive), the collectives (all-reduce inside a stage, gather of
logits to the stage's first rank, sending activations down the pipeline) and the time
spent in them (reported per step). A single rank has the trivial context
`ParallelContext()`: every collective is a no-op. Joining the process group and making
the groups is the worker's (worker/parallel_state.py); nothing here decides the layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


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
