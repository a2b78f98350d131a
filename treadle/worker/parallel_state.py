"""Joining the ranks of tensor and pipeline parallelism: the process group, this rank's
`ParallelContext` (layers/parallel.py: the layout and the collectives the model calls)
and the split of layers into stages.

Owns the torch.distributed process groups (one tensor-parallel group per stage;
point-to-point between a rank and the same tp_rank of the next stage), made by every
rank in the same order, and leaving them at exit.
"""

from __future__ import annotations

import datetime

import torch

from treadle.layers.parallel import ParallelContext


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
