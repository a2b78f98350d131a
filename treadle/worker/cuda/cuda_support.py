"""Sizing decisions of the CUDA platform, as pure functions of given figures.

Owns three calculations, each testable on a machine without a GPU:
- CUDA-graph batch sizes: the default list, its validation, and the padded size a decode
  batch runs at (None above the largest: that batch runs eagerly);
- the KV-cache budget from GPU memory figures: `gpu_memory_utilization` of the card's
  total, minus what this process holds at the peak of the profiling forward pass (the
  weights, the largest step's activations, CUDA context and library workspaces), gives
  the bytes for KV, then whole blocks;
- the swap space in pinned host memory: whole blocks, bounded by the host's memory
  (page-locked memory is taken from every other process on the host).
It reads no device: the figures come from `memory_snapshot()` (the one function here that
touches torch.cuda) or from the caller. It allocates nothing and decides no policy.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GIB = 1024**3
SWAP_WARN_FRACTION = 0.4
"""Swap space above this fraction of host memory is logged as a risk."""
SWAP_MAX_FRACTION = 0.7
"""Swap space above this fraction of host memory is refused (pinned pages cannot be
paged out: the rest of the host would be left to thrash)."""


def default_cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs rounded up to a multiple of 8.

    Padding a batch costs at most 7 dummy rows (2x at the three smallest sizes, where a
    step is pure launch overhead anyway); each size is one captured graph.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = -(-max_num_seqs // 8) * 8
    return [s for s in (1, 2, 4) if s < top] + list(range(8, top + 1, 8))


def check_cuda_graph_sizes(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """The sizes sorted, or a ValueError naming cuda_graph_sizes."""
    if isinstance(sizes, (str, bytes)) or not sizes:
        raise ValueError(f"cuda_graph_sizes must be a non-empty list of batch sizes, "
                         f"got {sizes!r}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"cuda_graph_sizes must hold integers >= 1, got {size!r}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"cuda_graph_sizes has duplicates: {sorted(sizes)}")
    return sorted(sizes)


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_reqs (sizes sorted); None: run eagerly."""
    if num_reqs < 1:
        raise ValueError(f"num_reqs must be >= 1, got {num_reqs}")
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class MemorySnapshot:
    """GPU memory figures of this process after the profiling forward pass."""

    total_bytes: int
    """The card's memory (torch.cuda.mem_get_info()[1])."""
    free_bytes: int
    """Free on the card now, all processes counted (mem_get_info()[0])."""
    torch_reserved_bytes: int
    """Held by torch's caching allocator now (torch.cuda.memory_reserved())."""
    torch_peak_bytes: int
    """Peak allocated by torch since the counters were reset before loading the model
    (torch.cuda.max_memory_allocated()): weights plus the largest step's activations."""

    @property
    def non_torch_bytes(self) -> int:
        """CUDA context, cuBLAS/NCCL workspaces, other processes: used but not torch's."""
        return max(0, self.total_bytes - self.free_bytes - self.torch_reserved_bytes)

    @property
    def used_bytes(self) -> int:
        """What this step's memory needs besides the KV cache: the torch peak plus the rest."""
        return self.torch_peak_bytes + self.non_torch_bytes


def memory_snapshot(device=None) -> MemorySnapshot:
    """The figures of `MemorySnapshot` read from torch.cuda (needs a GPU)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(total_bytes=total, free_bytes=free,
                          torch_reserved_bytes=torch.cuda.memory_reserved(device),
                          torch_peak_bytes=torch.cuda.max_memory_allocated(device))


def check_free_at_start(total_bytes: int, free_bytes: int,
                        gpu_memory_utilization: float) -> None:
    """Refuse to start when other processes already hold what this one was promised."""
    check_utilization(gpu_memory_utilization)
    wanted = total_bytes * gpu_memory_utilization
    if free_bytes < wanted:
        raise ValueError(
            f"gpu_memory_utilization {gpu_memory_utilization} asks for "
            f"{wanted / GIB:.2f} GiB of the GPU's {total_bytes / GIB:.2f} GiB, but only "
            f"{free_bytes / GIB:.2f} GiB are free (another process holds the rest): lower "
            f"gpu_memory_utilization to at most {free_bytes / total_bytes:.2f}")


def check_utilization(gpu_memory_utilization: float) -> None:
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                         f"got {gpu_memory_utilization}")


def kv_cache_bytes(snapshot: MemorySnapshot, gpu_memory_utilization: float) -> int:
    """total x utilization - used at the profiling peak: the bytes left for KV blocks."""
    check_utilization(gpu_memory_utilization)
    budget = int(snapshot.total_bytes * gpu_memory_utilization)
    left = budget - snapshot.used_bytes
    if left <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization "
            f"{gpu_memory_utilization} allows {budget / GIB:.2f} GiB and the model with its "
            f"largest step uses {snapshot.used_bytes / GIB:.2f} GiB "
            f"({snapshot.torch_peak_bytes / GIB:.2f} GiB by torch at its peak); raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens")
    return left


def num_kv_blocks(kv_bytes: int, bytes_per_block: int, min_blocks: int = 1) -> int:
    """Whole blocks in kv_bytes; a ValueError when fewer than min_blocks fit."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    blocks = kv_bytes // bytes_per_block
    if blocks < min_blocks:
        raise ValueError(
            f"{kv_bytes / GIB:.3f} GiB for the KV cache hold {blocks} blocks of "
            f"{bytes_per_block} bytes, fewer than the {min_blocks} needed (one request of "
            f"max_model_len): raise gpu_memory_utilization or lower max_model_len")
    return blocks


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                    block_size: int) -> int:
    """K and V of block_size tokens across all layers (the layout of docs/gpu.md)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size


def swap_space_blocks(swap_space_bytes: int, bytes_per_block: int,
                      host_memory_bytes: int) -> int:
    """Whole blocks of pinned host memory for swapped-out KV.

    Above SWAP_MAX_FRACTION of the host's memory a ValueError names swap_space; above
    SWAP_WARN_FRACTION a warning is logged.
    """
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if swap_space_bytes < 0:
        raise ValueError(f"swap_space must be >= 0 bytes, got {swap_space_bytes}")
    fraction = swap_space_bytes / host_memory_bytes
    if fraction > SWAP_MAX_FRACTION:
        raise ValueError(
            f"swap_space {swap_space_bytes / GIB:.2f} GiB is {fraction:.0%} of the host's "
            f"{host_memory_bytes / GIB:.2f} GiB; pinned memory cannot be paged out, so at "
            f"most {SWAP_MAX_FRACTION:.0%} is allowed: lower swap_space")
    if fraction > SWAP_WARN_FRACTION:
        logger.warning("swap_space %.2f GiB pins %.0f%% of the host's memory",
                       swap_space_bytes / GIB, 100 * fraction)
    return swap_space_bytes // bytes_per_block
