"""The device a worker runs on: the only module that knows whether it is a CPU or a GPU.

Owns, per platform: the torch device, what `--dtype auto` means there, which attention
backends exist there (in order of preference), whether the C kernels apply, pinned host
memory for swap, the torch.distributed backend (gloo on CPU, NCCL on GPU), generators on
the device, and how many bytes the KV cache may take. Code elsewhere asks the platform
instead of testing for a device (`if cuda` appears nowhere else). Chosen once per worker
from `--device` (`auto`: CUDA when torch sees a GPU, else the CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from treadle.models.loader import resolve_dtype

logger = logging.getLogger(__name__)

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
                    uses_native_kernels=False,
                    pin_swap_memory=True)


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
