"""The device a worker runs on, as one interface: what the worker asks instead of testing
for a device.

`Platform` is the question list; worker/cpu/platform.py (`CpuPlatform`) and
worker/cuda/platform.py (`CudaPlatform`) are the only places that know which device they
are, and worker/device.py picks one from `--device`. A platform answers: its torch device
and torch.distributed backend, what `--dtype auto` means there, which attention backends
exist there (most preferred first), pinned host memory for swap and the stream its copies
run on, how many bytes the KV cache may take (configured, or profiled against
--gpu-memory-utilization), and which device-specific pieces a worker gets: the C kernels
and what they drive (linear kernels, fused layer ops, quantized linears, the LoRA kernel,
the decode stack, the sampler's kernel, the start-up line naming them), decode CUDA
graphs. The defaults below are "none here"; a platform overrides what it has. A platform
holds no request or model state and decides no policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from treadle.models.loader import resolve_dtype


def no_wait() -> None:
    """The wait of copies that are done already."""


def run_copies_now(copy: Callable[[], None]) -> Callable[[], None]:
    """Run the copies synchronously (a platform without a copy stream)."""
    copy()
    return no_wait


class Platform(ABC):
    """What a worker needs to know about its device."""

    name: str
    dist_backend: str
    """torch.distributed backend between workers of this platform."""
    attention_backends: tuple[str, ...]
    """Attention backends that run here, most preferred first (`auto` takes the first
    that can be built)."""
    pin_swap_memory: bool
    """Swap space in pinned host memory, for asynchronous device <-> host copies."""
    kv_medium: str
    """Where the KV cache lives, as vLLM's KV events name it (CPU or GPU)."""
    supports_cuda_graphs: bool = False
    """Decode steps can be captured as CUDA graphs (worker/cuda/decode_graphs.py)."""
    triton_needs_interpreter: bool = False
    """The Triton kernels run here only under TRITON_INTERPRET=1 (tests)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # ----- the device --------------------------------------------------------------------

    @abstractmethod
    def auto_dtype(self, kernel_isa: str = "auto") -> tuple[torch.dtype, str]:
        """What `--dtype auto` means here, and why (models.loader.AutoDtype; `kernel_isa`,
        ModelConfig.kernel_isa, matters where C kernels decide it)."""

    def resolve_dtype(self, name: str, kernel_isa: str = "auto") -> torch.dtype:
        """The model dtype for `--dtype` (`auto`: `auto_dtype`, logged)."""
        return resolve_dtype(name, lambda: self.auto_dtype(kernel_isa))

    def generator(self, seed: int) -> torch.Generator:
        """A random generator on the device (samplers draw there, without a host sync)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for by default)."""

    def num_multiprocessors(self) -> int:
        """Parallel units a kernel's grid must fill (a GPU's multiprocessors); 1 here."""
        return 1

    def prepare_process(self, keep_freed_memory: bool) -> None:
        """Once per worker process, before loading (ModelConfig.keep_freed_memory)."""

    def check_memory_at_start(self, gpu_memory_utilization: float) -> None:
        """Before loading: refuse when other processes already hold the memory this one
        is allowed; nothing to check by default."""

    def kv_cache_bytes(self, configured: int, profile_step: Callable[[], None],
                       gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take: `configured` (--kv-cache-memory) by default; a
        platform that profiles runs `profile_step` (a forward pass at the largest step)."""
        return configured

    def start_copies(self, copy: Callable[[], None]) -> Callable[[], None]:
        """Run `copy` (swap copies between the device and host memory) and return the wait
        that the step's compute must call before it reads or writes the KV cache. By
        default the copies run now and the wait does nothing."""
        return run_copies_now(copy)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move a host tensor built for a step onto the device (once per step)."""
        if tensor.device == self.device:
            return tensor
        return tensor.to(self.device, non_blocking=True)

    # ----- what the worker runs here -----------------------------------------------------

    def load_native_kernels(self, kernel_isa: str, attention_backend: str,
                            dtype: torch.dtype) -> Any:
        """The compiled C kernels the worker uses (attention, sampling, the layer kernels'
        library), or None: none on this platform."""
        return None

    def layer_ops(self, native: Any, dtype: torch.dtype, batch_invariant: bool = False) -> Any:
        """Fused elementwise ops for the model's layers (layers.norm.LayerOps), or None;
        batch_invariant: ops whose linears take one kernel at every row count (a platform
        without such kernels returns None, and treadle/compat.py refuses the mode)."""
        return None

    def attach_linear_kernels(self, model: Any, dtype: torch.dtype, layer_ops: Any) -> int:
        """Give the model (or a draft model) its linear kernels and `layer_ops`
        (model.set_kernels); returns how many kernels were attached. By default plain
        F.linear everywhere."""
        return model.set_kernels(None, layer_ops)

    def quantize(self, model: Any, config: Any, dtype: torch.dtype, native: Any,
                 world_size: int) -> Any:
        """--quantization (config: EngineConfig): the model's linears on quantized weights,
        returning what was done, or None when they stay dense. Only `none` and `auto`
        (which is none here) by default."""
        mode = config.model.quantization
        if mode in ("none", "auto"):
            return None
        raise ValueError(f"quantization={mode} runs on the CPU in bfloat16 or float32 "
                         f"(device {self.device.type}, dtype {dtype})")

    def lora_ops(self, native: Any, dtype: torch.dtype, num_targets: int) -> Any:
        """The LoRA layers' ops (worker/lora/layers.py), or None for the torch ones."""
        return None

    def lora_weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype adapters are kept in under a model of `dtype`."""
        return dtype

    def decode_stack(self, model: Any, layer_ops: Any, attention: Any) -> Any:
        """The one-call decode stack of the model's layers (model.decode_stack), or None."""
        return None

    def sampler_kernels(self, native: Any, attention: Any) -> Any:
        """The sampler's kernel path (worker/sampler.py `kernels`), or None for torch's."""
        return None

    def describe_kernels(self, native: Any, dtype: torch.dtype, head_dim: int,
                         layer_ops: Any, attention: Any) -> str | None:
        """What the start-up line says about this platform's kernels, or None."""
        return None

    def use_native_kernels(self, model: Any, attention: Any, sampler: Any, kernels: Any,
                           layer_ops: Any) -> None:
        """Switch a loaded model, its attention backend and sampler to another build of
        the C kernels (benchmarks, tests)."""
        raise ValueError(f"the C kernels do not run on {self.name}")

    def default_decode_graph_sizes(self, model_config: Any, max_num_seqs: int,
                                   attention: Any, world_size: int) -> list[int] | None:
        """The batch sizes whose decode steps are captured as graphs at start-up, or None:
        no graphs here."""
        return None
