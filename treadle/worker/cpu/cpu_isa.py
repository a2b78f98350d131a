"""Which instruction-set level the C kernels are built for, and the start-up line that says
which kernel set runs.

Owns the ISA levels (`avx512bf16`: AVX-512 with vdpbf16ps; `avx512`: AVX-512F/BW/VL/DQ/CD,
bf16 widened to fp32 in registers; `avx2`: x86-64-v3, AVX2 + FMA + F16C, widened likewise;
`native`: gcc's -march=native, whatever that enables), the gcc flags of each, which levels
this CPU can execute (its /proc/cpuinfo flags), the order `auto` tries them in, and
`describe_kernels`. It must not build or load anything (worker/cpu/native.py does) and does
not import torch.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from treadle.config import KERNEL_ISA_CHOICES, KERNEL_ISA_LEVELS

ISA_LEVELS = KERNEL_ISA_LEVELS
"""The explicit levels, best first (config.py holds the list, so that it validates
--kernel-isa without importing the worker); KERNEL_ISA_CHOICES adds `auto` and `native`."""
WIDENING_LEVELS = ("avx512", "avx2")
"""Levels without vdpbf16ps whose kernels keep bf16 in memory and widen it to fp32."""

# x86-64 micro-architecture levels as gcc's -march=x86-64-v3/-v4 assume them, in the
# names /proc/cpuinfo uses (pni = SSE3, abm = LZCNT).
_X86_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
_X86_V3 = _X86_V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_X86_V4 = _X86_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
REQUIRED_CPU_FLAGS = {"avx512bf16": _X86_V4 + ("avx512_bf16", "avx512_vnni"), "avx512": _X86_V4,
                      "avx2": _X86_V3}
"""level -> the /proc/cpuinfo flags a CPU needs to execute its build. The avx512bf16 build
also has AVX-512 VNNI (every CPU with AVX-512 BF16 has it: Cooper Lake, Sapphire Rapids,
Zen 4), which the quantized kernels' int8 dot products use (quant_dot.c)."""

_MARCH = {"avx512bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"],
          "avx512": ["-march=x86-64-v4", "-mtune=native"],
          "avx2": ["-march=x86-64-v3", "-mtune=native"],
          "native": ["-march=native"]}


_EXTENSIONS_WHERE_PRESENT = {"avx512": (("avx512_vnni", "-mavx512vnni"),)}
"""level -> (CPU flag, gcc option) its build adds where this CPU has the flag. AVX-512
VNNI without AVX-512 BF16 is a common Xeon: Cascade Lake, Ice Lake, and cloud guests of
newer Xeons whose hypervisor hides BF16 and AMX. With it the avx512 level's quantized
kernels take their int8 dot products on vpdpbusd and the r16 decode path (quant_r16.c),
which an AVX-512 build without VNNI does not have: without it a GGUF model ran dense
bf16 there (17.1 ms a token for SmolLM2 Q4_1 against llama.cpp's 16.8; 6.9 with it;
docs/benchmarks.md)."""


def compile_flags(level: str, flags: frozenset[str] | None = None) -> list[str]:
    """gcc's target flags for a level (tuned for this CPU: the cache key has its flags),
    with the extensions this CPU (or `flags`) has that the level adds where present."""
    if level not in _MARCH:
        raise ValueError(f"kernel_isa must be one of {', '.join(KERNEL_ISA_CHOICES)}, "
                         f"got {level!r}")
    extensions = _EXTENSIONS_WHERE_PRESENT.get(level, ())
    if extensions and flags is None:
        flags = cpu_flags() if _is_x86() else frozenset()
    march, tune = _MARCH[level][:-1], _MARCH[level][-1:]  # -mtune (or -march=native) last
    return march + [option for flag, option in extensions if flag in flags] + tune


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`); empty when unknown. This
    machine's (no `cpuinfo`) are read once: compile_flags asks for them per kernel source,
    and /proc/cpuinfo has a block per CPU."""
    if cpuinfo is None:
        return _this_cpu_flags()
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    return frozenset(words)


@functools.lru_cache(maxsize=1)
def _this_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def executable_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The explicit levels whose builds this CPU can run, best first."""
    if flags is None:
        if not _is_x86():
            return []
        flags = cpu_flags()
    return [level for level in ISA_LEVELS if set(REQUIRED_CPU_FLAGS[level]) <= flags]


def candidate_levels(requested: str, flags: frozenset[str] | None = None) -> list[str]:
    """The levels to try building, in order, for `requested` (one of KERNEL_ISA_CHOICES).

    auto: every level this CPU executes, best first, then native (which is what a CPU
    with none of them gets). An explicit level this CPU cannot execute is a ValueError
    (its library would die on an illegal instruction).
    """
    if requested not in KERNEL_ISA_CHOICES:
        raise ValueError(f"kernel_isa must be one of {', '.join(KERNEL_ISA_CHOICES)}, "
                         f"got {requested!r}")
    levels = executable_levels(flags)
    if requested == "auto":
        return levels + ["native"]
    if requested == "native":
        return ["native"]
    if requested not in levels:
        have = flags if flags is not None else (cpu_flags() if _is_x86() else frozenset())
        missing = [f for f in REQUIRED_CPU_FLAGS[requested] if f not in have]
        raise ValueError(f"kernel_isa={requested!r} needs the CPU flags {', '.join(missing)}, "
                         f"which this CPU lacks (it runs: "
                         f"{', '.join(levels + ['native'])})")
    return [requested]


def describe_kernels(kernels, dtype, head_dim: int | None = None, layer_ops=None,
                     native_attention: bool = True, prefill_kernel: bool | None = None) -> str:
    """One line for the start-up log: the model dtype, the kernel ISA level and which C
    kernels run.

    kernels: the worker.cpu.native.NativeKernels loaded (None: none could be built); dtype:
    the model's torch dtype; head_dim: the model's (it decides the attention fast paths);
    layer_ops: the worker.cpu.native_linear.NativeLayerOps attached to the model (None: its
    layers run torch); native_attention: False when the attention backend is torch;
    prefill_kernel: whether the backend runs prefills on the C kernel (None: wherever the
    build has it for this dtype and head size).
    """
    dtype_name = str(dtype).replace("torch.", "")
    if kernels is None:
        return (f"dtype {dtype_name}; no CPU kernels (no C compiler, or the build failed): "
                f"torch runs the layers, attention and sampling")
    width = kernels.simd_width
    how = ("bf16 pairs on vdpbf16ps" if kernels.has_dpbf16
           else f"bf16 widened to fp32 in {width}-lane registers" if width
           else "no SIMD fast paths")
    active, on_torch = [], []
    if layer_ops is not None:
        active.append(f"linear ({layer_ops.describe()}), add+rmsnorm, silu*mul, "
                      f"rope+kv write")
    else:
        on_torch.append("layers")
    if native_attention and kernels.supports(dtype):
        fast = head_dim is not None and kernels.supports_fast_decode(head_dim)
        active.append("decode attention" + ("" if fast else " (generic loops)"))
        if prefill_kernel is None:
            prefill_kernel = head_dim is not None and kernels.supports_prefill(dtype, head_dim)
        if prefill_kernel:
            active.append("prefill attention")
        else:
            on_torch.append("prefill attention")
    else:
        on_torch.append("attention")
    active.append("sampling")
    line = (f"dtype {dtype_name}; CPU kernels {kernels.isa} ({' '.join(kernels.march)}, "
            f"{how}): {', '.join(active)}")
    return line + (f"; torch: {', '.join(on_torch)}" if on_torch else "")
