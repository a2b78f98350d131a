"""The device a worker runs on: the only module that knows whether it is a CPU or a GPU.

Owns, per platform: the torch device, what `--dtype auto` means there, which attention
backends exist there (in order of preference), whether the C kernels and CUDA graphs
apply, pinned host memory for swap and the stream its copies run on, the torch.distributed
backend (gloo on CPU, NCCL on GPU), generators on the device, and how many bytes the KV
cache may take (configured on the CPU; profiled against --gpu-memory-utilization on a
GPU). Code elsewhere asks the platform
instead of testing for a device (`if cuda` appears nowhere else). Chosen once per worker
from `--device` (`auto`: CUDA when torch sees a GPU, else the CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from treadle.models.loader import resolve_dtype
from treadle.worker import cuda_support

logger = logging.getLogger(__name__)


def no_wait() -> None:
    """The wait of copies that are done already."""


def run_copies_now(copy: Callable[[], None]) -> Callable[[], None]:
    """Run the copies synchronously (the CPU's Platform.start_copies)."""
    copy()
    return no_wait

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Platform:
    """What a worker needs to know about its device."""

    name: str
    device: torch.device
    dist_backend: str
    """torch.distributed backend between workers of this platform."""
    attention_backends: tuple[str, ...]
    """Attention backends that run here, most preferred first (`auto` takes the first
    that can be built)."""
    uses_native_kernels: bool
    """The C kernels of worker/kernels (CPU only)."""
    pin_swap_memory: bool
    """Swap space in pinned host memory, for asynchronous device <-> host copies."""
    supports_cuda_graphs: bool = False
    """Decode steps can be captured as CUDA graphs (worker/decode_graphs.py)."""

    _side_stream: object = field(default=None, repr=False, compare=False)

    def resolve_dtype(self, name: str, kernel_isa: str = "auto") -> torch.dtype:
        """The model dtype for `--dtype` (`auto` is the platform's choice: on the CPU, by
        what the C kernels of `kernel_isa` run fast)."""
        if name == "auto" and self.name == "cuda":
            return torch.bfloat16
        return resolve_dtype(name, kernel_isa)

    def generator(self, seed: int) -> torch.Generator:
        """A random generator on the device (samplers draw there, without a host sync)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize(self.device)

    def num_multiprocessors(self) -> int:
        """Streaming multiprocessors of the GPU (what a kernel's grid must fill); 1 on the
        CPU."""
        if self.name == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return 1

    def check_memory_at_start(self, gpu_memory_utilization: float) -> None:
        """Before loading: refuse when other processes already hold the memory this one
        is allowed (GPU); nothing to check on the CPU."""
        if self.name == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            cuda_support.check_free_at_start(total, free, gpu_memory_utilization)
            torch.cuda.reset_peak_memory_stats(self.device)

    def kv_cache_bytes(self, configured: int, profile_step: Callable[[], None],
                       gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take. CPU: `configured` (--kv-cache-memory). GPU: what
        total x utilization leaves after the peak of `profile_step` (a forward pass at
        the largest step, run here) and the memory torch does not hold (as vLLM)."""
        if self.name != "cuda":
            return configured
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
        """Run `copy` (swap copies between the device and pinned host memory) and return
        the wait that the step's compute must call before it reads or writes the KV
        cache. GPU: the copies go on a side stream, after all work queued so far (the
        blocks swapped out were written by earlier steps), so that they overlap the
        host's preparation of the step; CPU: they run now and the wait does nothing."""
        if self.name != "cuda":
            return run_copies_now(copy)
        if self._side_stream is None:
            object.__setattr__(self, "_side_stream", torch.cuda.Stream(self.device))
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            copy()
            done = torch.cuda.Event()
            done.record(stream)
        return lambda: torch.cuda.current_stream(self.device).wait_event(done)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move a host tensor built for a step onto the device (once per step)."""
        if tensor.device == self.device:
            return tensor
        return tensor.to(self.device, non_blocking=True)


CPU = Platform(name="cpu", device=torch.device("cpu"), dist_backend="gloo",
               attention_backends=("cpu-native", "torch", "reference", "triton"),
               uses_native_kernels=True, pin_swap_memory=False)


def cuda_platform(index: int = 0) -> Platform:
    return Platform(name="cuda", device=torch.device("cuda", index), dist_backend="nccl",
                    attention_backends=("triton", "torch", "reference"),
                    uses_native_kernels=False, pin_swap_memory=True,
                    supports_cuda_graphs=True)


def get_platform(device: str = "auto", index: int = 0) -> Platform:
    """The platform `--device` names (rank `index`: its GPU on a multi-GPU node);
    ValueError for one that is not here."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no GPU (torch.cuda.is_available() "
                             "is False)")
        return cuda_platform(index % torch.cuda.device_count())
    return CPU
