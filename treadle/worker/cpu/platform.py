"""The CPU platform: a worker on the host's cores, and the C kernels it runs there.

Owns the CPU's answers to worker/platform.py's questions: `--dtype auto` (bfloat16 where
the CPU does bf16 math, or where the C kernels build for an AVX-512 or AVX2 level and
widen bf16 in registers; else float32), gloo between ranks, the attention backends in the
CPU's order (cpu-native first; triton only under the interpreter), the KV budget as
configured, copies that run at once, glibc's malloc kept from returning freed memory
(heap.py), and which of the C kernels (native.py) drive which parts: the linear layers
(linear_kernels.py, NativeLayerOps), quantized linears (quantized_linears.py), the LoRA
kernel, the decode stack, the sampler's kernel path and the start-up line that names
them. It decides no policy; the kernels decide nothing about requests.
"""

from __future__ import annotations

import logging
import platform as host
from typing import Any

import torch

from treadle.worker.cpu import cpu_isa, heap, quantized_linears, weight_cache
from treadle.worker.cpu.decode_stack import DecodeStack
from treadle.worker.cpu.gemma_stack import GemmaDecodeStack
from treadle.worker.cpu.linear_kernels import DenseLinearKernel, dense_kernel_factory
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_attention import CpuNativeBackend
from treadle.worker.cpu.native_linear import NativeLayerOps
from treadle.worker.cpu.native_lora import NativeLoRAOps
from treadle.worker.cpu.native_quant import QuantKernels
from treadle.worker.cpu.native_sampling import NativeSampling
from treadle.worker.platform import Platform

logger = logging.getLogger(__name__)

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo


def cpu_supports_bf16() -> bool:
    """True when the CPU does bfloat16 math natively (x86 AVX512-BF16/AMX, ARM BF16).

    False whenever this cannot be established (non-Linux, unreadable /proc/cpuinfo).
    """
    words = cpu_isa.cpu_flags()
    if host.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in words
    return any(flag in words for flag in _BF16_CPU_FLAGS)


def auto_dtype(kernel_isa: str = "auto") -> tuple[torch.dtype, str]:
    """What `dtype=auto` means on this machine, and why (for the log): models.loader
    `AutoDtype`.

    bfloat16 where the CPU does bf16 math natively, or where the C kernels build for an
    AVX-512 or AVX2 level (kernel_isa: ModelConfig.kernel_isa): they keep bf16 weights and
    KV in memory and widen them to fp32 in registers, so a decode step reads half the
    bytes of float32. float32 only where neither holds.
    """
    if cpu_supports_bf16():
        return torch.bfloat16, "the CPU has bf16 instructions"
    kernels = load_kernels(kernel_isa)
    if kernels is not None and kernels.simd_width:
        return torch.bfloat16, (f"no bf16 instructions, but the {kernels.isa} C kernels "
                                f"widen bf16 to fp32 in registers")
    return torch.float32, "no bf16 instructions and no AVX-512 or AVX2 C kernels"


class CpuPlatform(Platform):
    """The host's cores, with the C kernels where they build."""

    name = "cpu"
    dist_backend = "gloo"
    attention_backends = ("cpu-native", "torch", "reference", "triton")
    pin_swap_memory = False
    kv_medium = "CPU"
    triton_needs_interpreter = True

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def auto_dtype(self, kernel_isa: str = "auto") -> tuple[torch.dtype, str]:
        return auto_dtype(kernel_isa)

    def prepare_process(self, keep_freed_memory: bool) -> None:
        """glibc keeps what a step frees for the next one (heap.py)."""
        if keep_freed_memory and not heap.keep_freed_memory():
            logger.info("keep_freed_memory: not glibc, the C library's malloc left as is")

    def load_native_kernels(self, kernel_isa: str, attention_backend: str,
                            dtype: torch.dtype) -> Any:
        """The compiled C kernels (native.NativeKernels), or None when they cannot be
        built or nothing would use them: the attention backend is not cpu-native and the
        model is not bf16 (the layer kernels are bf16 only)."""
        if attention_backend in ("torch", "reference") and dtype != torch.bfloat16:
            return None
        return load_kernels(kernel_isa)

    def layer_ops(self, native: Any, dtype: torch.dtype,
                  batch_invariant: bool = False) -> NativeLayerOps | None:
        if native is None or dtype != torch.bfloat16:
            return None
        return NativeLayerOps.load(native.lib, batch_invariant=batch_invariant)

    def attach_linear_kernels(self, model: Any, dtype: torch.dtype, layer_ops: Any) -> int:
        """Dense kernels on every linear (linear_kernels.py: oneDNN packs host weights; the
        C kernels with `layer_ops`)."""
        count = model.set_kernels(dense_kernel_factory(dtype, layer_ops), layer_ops)
        if count:
            logger.info("linear layers: %d kernels attached (%s)", count,
                        "C kernels: " + layer_ops.describe() if layer_ops is not None
                        else "oneDNN prepacked bf16")
        return count

    def quantize(self, model: Any, config: Any, dtype: torch.dtype, native: Any,
                 world_size: int) -> quantized_linears.QuantizedModel | None:
        """--quantization on the C quantized kernels (quantized_linears.py), bf16 or fp32;
        what they make is kept in the weight cache (weight_cache.py) for the next start."""
        from treadle.models.resolve import gguf_source

        m = config.model
        if m.quantization == "none":
            return None
        if m.quantization != "auto" and dtype not in (torch.bfloat16, torch.float32):
            return super().quantize(model, config, dtype, native, world_size)
        kernels = (QuantKernels.load(native.lib, m.batch_invariant) if native is not None
                   else None)
        gguf = gguf_source(m.model, m.revision, m.download_dir)

        def cache(mode: str):
            return None if gguf is None else weight_cache.cache_path(mode, dtype, kernels, gguf)

        known = m.quantization == "auto" and gguf is not None and cache("gguf").is_file()
        mode = quantized_linears.resolve_mode(
            m.quantization, gguf, kernels, dtype=dtype, world_size=world_size,
            lora=config.lora.enable_lora, has_quantized_linears=True if known else None)
        report = quantized_linears.attach(model, mode, kernels, gguf,
                                          cache(mode) if mode != "none" else None)
        if report is not None:
            logger.info("%s", report.describe())
        return report

    def lora_ops(self, native: Any, dtype: torch.dtype, num_targets: int) -> Any:
        if native is None or dtype != torch.bfloat16:
            return None
        return NativeLoRAOps.load(native.lib, num_targets)

    def lora_weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """fp32 adapters under a bf16 / fp16 model (worker/lora/layers.py says why)."""
        return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype

    def decode_stack(self, model: Any, layer_ops: Any,
                     attention: Any) -> DecodeStack | GemmaDecodeStack | None:
        """The plain Llama stack (decode_stack.py) or Gemma 3's (gemma_stack.py), by the
        layer shape the model declares; None where neither qualifies."""
        return (DecodeStack.build(model, layer_ops, attention)
                or GemmaDecodeStack.build(model, layer_ops, attention))

    def sampler_kernels(self, native: Any, attention: Any) -> NativeSampling | None:
        """The C sampling kernel runs with the cpu-native attention backend; the other
        backends are the all-torch path."""
        if native is None or attention.name != "cpu-native":
            return None
        return NativeSampling(native)

    def describe_kernels(self, native: Any, dtype: torch.dtype, head_dim: int,
                         layer_ops: Any, attention: Any) -> str:
        return cpu_isa.describe_kernels(
            native, dtype, head_dim, layer_ops, native_attention=attention.name == "cpu-native",
            prefill_kernel=getattr(attention, "native_prefill", None))

    def use_native_kernels(self, model: Any, attention: Any, sampler: Any, kernels: Any,
                           layer_ops: Any) -> None:
        """Every dense linear (under a LoRA layer's kernel too), the model's fused ops, the
        cpu-native backend, the decode stack and a sampler that runs the C kernel, onto
        `kernels` (native.NativeKernels of some ISA level) and `layer_ops` (its
        NativeLayerOps, or None for torch's layers)."""
        for module in model.modules():
            kernel = getattr(module, "kernel", None)
            kernel = getattr(kernel, "base", kernel)  # under a LoRA layer's kernel
            if isinstance(kernel, DenseLinearKernel):
                kernel.native = layer_ops
        if isinstance(model.lm_head_kernel, DenseLinearKernel):
            model.lm_head_kernel.native = layer_ops
        model.ops = layer_ops
        for module in model.modules():
            if hasattr(module, "ops"):
                module.ops = layer_ops
        if isinstance(attention, CpuNativeBackend):
            attention.kernels = kernels
            attention.layer_ops = layer_ops
        if hasattr(model, "decode_stack"):
            model.decode_stack = self.decode_stack(model, layer_ops, attention)
        if sampler is not None and sampler.kernels is not None:
            sampler.kernels = None if kernels is None else NativeSampling(kernels)


CPU = CpuPlatform()
"""The CPU platform (it holds no state: one instance serves every worker)."""
