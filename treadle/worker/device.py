"""Which platform a worker runs on: `--device` to a CpuPlatform or a CudaPlatform.

Owns the one test of what torch sees (`auto`: CUDA when torch sees a GPU, else the CPU)
and the GPU a rank takes on a multi-GPU node, and says what `--dtype auto` means to those
who resolve a model before any worker exists (engine/core.py, the CLI). Everything else
about the device is the platform's (worker/platform.py).
"""

from __future__ import annotations

import torch

from treadle.worker.platform import Platform

DEVICES = ("auto", "cpu", "cuda")


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
        from treadle.worker.cuda.platform import CudaPlatform
        return CudaPlatform(index % torch.cuda.device_count())
    from treadle.worker.cpu.platform import CPU
    return CPU


def auto_dtype(device: str = "auto", kernel_isa: str = "auto") -> tuple[torch.dtype, str]:
    """What `--dtype auto` means on the platform `device` names, and why
    (models.loader.AutoDtype: what a GGUF file is converted to before any worker runs)."""
    return get_platform(device).auto_dtype(kernel_isa)
