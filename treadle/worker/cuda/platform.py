"""The CUDA platform: a worker on one GPU.

Owns the GPU's answers to worker/platform.py's questions: `--dtype auto` is bfloat16,
NCCL between ranks, the attention backends in the GPU's order (triton first), pinned host
memory for swap with its copies on a side stream that overlaps the host's preparation of
the step, the memory check before loading and the KV budget profiled against
--gpu-memory-utilization (cuda_support.py does the arithmetic), and decode CUDA graphs by
default where they apply (decode_graphs.py). The figures it reads come from torch.cuda;
the sizing rules are cuda_support's. It decides no policy.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from treadle.worker.cuda import cuda_support
from treadle.worker.cuda.triton_attention import TritonBackend
from treadle.worker.platform import Platform

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    """One GPU (`index` on a multi-GPU node)."""

    name = "cuda"
    dist_backend = "nccl"
    attention_backends = ("triton", "torch", "reference")
    pin_swap_memory = True
    kv_medium = "GPU"
    supports_cuda_graphs = True

    def __init__(self, index: int = 0) -> None:
        super().__init__(torch.device("cuda", index))
        self._side_stream = None
        """The stream swap copies run on, made at the first copy."""

    def auto_dtype(self, kernel_isa: str = "auto") -> tuple[torch.dtype, str]:
        return torch.bfloat16, "the GPU's dtype"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def num_multiprocessors(self) -> int:
        """Streaming multiprocessors of the GPU (what a kernel's grid must fill)."""
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def check_memory_at_start(self, gpu_memory_utilization: float) -> None:
        """Refuse when other processes already hold the memory this one is allowed."""
        free, total = torch.cuda.mem_get_info(self.device)
        cuda_support.check_free_at_start(total, free, gpu_memory_utilization)
        torch.cuda.reset_peak_memory_stats(self.device)

    def kv_cache_bytes(self, configured: int, profile_step: Callable[[], None],
                       gpu_memory_utilization: float) -> int:
        """What total x utilization leaves after the peak of `profile_step` (a forward
        pass at the largest step, run here) and the memory torch does not hold (as vLLM)."""
        profile_step()
        torch.cuda.synchronize(self.device)
        snapshot = cuda_support.memory_snapshot(self.device)
        kv_bytes = cuda_support.kv_cache_bytes(snapshot, gpu_memory_utilization)
        logger.info("GPU memory: %.2f GiB total, peak %.2f GiB by torch, %.2f GiB besides; "
                    "%.2f GiB for the KV cache", snapshot.total_bytes / 2**30,
                    snapshot.torch_peak_bytes / 2**30, snapshot.non_torch_bytes / 2**30,
                    kv_bytes / 2**30)
        torch.cuda.empty_cache()
        return kv_bytes

    def start_copies(self, copy: Callable[[], None]) -> Callable[[], None]:
        """The copies go on a side stream, after all work queued so far (the blocks
        swapped out were written by earlier steps), so that they overlap the host's
        preparation of the step; the wait makes the compute stream wait for them."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            copy()
            done = torch.cuda.Event()
            done.record(stream)
        return lambda: torch.cuda.current_stream(self.device).wait_event(done)

    def default_decode_graph_sizes(self, model_config: Any, max_num_seqs: int,
                                   attention: Any, world_size: int) -> list[int] | None:
        """Decode CUDA graphs where they apply: the triton backend, one rank, not
        enforce_eager (model_config.cuda_graph_sizes, else cuda_support's default)."""
        if (model_config.enforce_eager or not isinstance(attention, TritonBackend)
                or world_size != 1):
            return None
        return (model_config.cuda_graph_sizes
                or cuda_support.default_cuda_graph_sizes(max_num_seqs))
