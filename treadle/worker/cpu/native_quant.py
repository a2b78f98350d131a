"""Typed wrappers of the weight-only quantized kernels (kernels/quant_dequant.c,
kernels/quant_gemv.c, kernels/quant_dot.c, kernels/quant_r16.c, the AMX ones): the
decode-row GEMV paths, the r16 repacking they read on AVX-512 VNNI and plain AVX2, tile
dequantization
for the prefill path, and the activation quantizer (for tests).

Owns the calling convention only: which path runs for which rows is decided by
treadle/models/quant_weights.py, and the weight layouts (GGUF blocks, treadle's INT8) by
treadle/models/quant_formats.py. `QuantKernels.load` takes the library that
`treadle.worker.cpu.native.load_kernels` built (every kernels/*.c is linked into one shared
object), or any shared object built from the quant_*.c files alone (the tests build one
per ISA level). Every entry point runs on every x86 level (AVX-512, AVX2, plain C); `isa`
says which one this library was compiled for.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from treadle.paths import cache_dir
from treadle.worker.cpu.native import COMPILE_TIMEOUT_S
from treadle.worker.cpu.huge_pages import HugePageArena

logger = logging.getLogger(__name__)

QUANT_BUILD_CPU_SECONDS_PER_SOURCE = 3.0
"""gcc's CPU time per quant_*.c source, roughly (they build one after another)."""

FORMAT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "INT8": 4}
"""Format name -> the kernels' format number (quant_simd.h)."""

PATHS = ("dot", "deq", "deq_buffered", "amx", "amx_dot", "r16", "gemm")
"""Kernel paths: int8 dot products on per-chunk quantized activations (vpdpbusd /
pmaddubsw); dequantize in registers per tile; dequantize each block of weight rows once
into a buffer and run dense tiles on it (vdpbf16ps / FMA); AMX-BF16 tiles on the
dequantized rows (bf16 x only); AMX-INT8 tiles on per-chunk quantized activations; int8
dot products with 16 weight rows per vector, on the weight repacked by `r16_pack` (the
same activations as `dot`); the register-tiled fp32 GEMM on panels dequantized from the
blocks (quant_gemm_widen.c; bf16 x only). The AMX paths run where `has_amx`, r16 where
`has_r16` and for R16_FORMATS, gemm where `has_gemm`."""

R16_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "INT8", "Q4_K")
"""The formats the r16 layout holds."""

ISA_VARIANTS = {
    "avx512-bf16": (["-march=cooperlake"],
                    ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"]),
    "avx512-vnni": (["-march=cascadelake"],
                    ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"]),
    "avx512f": (["-march=skylake-avx512"], ["avx512f", "avx512bw", "avx512vl", "avx512dq"]),
    "avx2-vnni": (["-march=x86-64-v3", "-mavxvnni"], ["avx2", "fma", "f16c", "avx_vnni"]),
    "avx2": (["-march=x86-64-v3"], ["avx2", "fma", "f16c", "bmi2", "movbe"]),
    "scalar": (["-march=x86-64"], []),
}
"""ISA level -> (compiler flags, /proc/cpuinfo flags a CPU needs to run it): the levels the
quantized kernels have code for, to build and run them side by side on one machine
(tests, benchmarks). The engine itself uses native.py's -march=native build."""


def cpu_runs(variant: str) -> bool:
    """Whether this CPU has what ISA_VARIANTS[variant] needs (x86 Linux only)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in flags for flag in ISA_VARIANTS[variant][1])


_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ISA_BITS = {1: "avx512", 2: "avx2", 4: "bf16", 8: "vnni"}
_AMX_BITS = 16 | 32


def build_variant(flags: list[str]) -> QuantKernels | None:
    """The quant_*.c kernels alone, built with `flags` (e.g. ISA_VARIANTS["avx2"][0])
    into a shared object of their own (cached like native.py's), or None without gcc."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    kernel_dir = Path(__file__).with_name("kernels")
    sources = sorted(kernel_dir.glob("quant_*.c"))
    digest = hashlib.sha256(" ".join([compiler, *flags]).encode())
    for path in sources + sorted(kernel_dir.glob("*.h")):  # quant_gemm_widen.c takes simd.h
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    target = cache_dir() / "kernels" / f"quant-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        logger.info("building the quantized kernels with %s (%d sources, once; about %.0f s "
                    "on an idle machine)", " ".join(flags), len(sources),
                    len(sources) * QUANT_BUILD_CPU_SECONDS_PER_SOURCE)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects = []
            for source in sources:
                objects.append(str(Path(tmp) / (source.stem + ".o")))
                subprocess.run([compiler, "-O3", *flags, "-fopenmp", "-fPIC", "-c", str(source),
                                "-o", objects[-1]], check=True, capture_output=True,
                               timeout=COMPILE_TIMEOUT_S)
            partial = Path(tmp) / target.name
            subprocess.run([compiler, "-shared", "-fopenmp", *objects, "-o", str(partial), "-lm"],
                           check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
            os.replace(partial, target)
    return QuantKernels(ctypes.CDLL(str(target)))


class QuantKernelError(ValueError):
    """A kernel refused its arguments (format, K or row size)."""


class QuantKernels:
    """The quantized-weight kernels of one loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._packed_memory = HugePageArena()  # r16 copies: streamed every decode step
        gemv_args = [_I, _P, _I64, _P, _P, _I64, _I, _P, _P, _I64, _I, _I64, _I64, _I64]
        self._deq = lib.quant_gemv_deq
        self._deq.argtypes = gemv_args + [_I, _I]
        self._deq.restype = _I
        self._dot = lib.quant_gemv_dot
        self._dot.argtypes = gemv_args + [_I]
        self._dot.restype = _I
        self._dequant = lib.quant_dequant
        self._dequant.argtypes = [_I, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _I, _I]
        self._dequant.restype = _I
        self._quantize_x = lib.quant_quantize_x
        self._quantize_x.argtypes = [_P, _I64, _I, _I64, _I64, _P, _P]
        self._quantize_x.restype = _I64
        self._amx = lib.quant_gemm_amx
        self._amx.argtypes = [_I, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I, _I64, _I64, _I64, _I]
        self._amx.restype = _I
        self._amx_dot = lib.quant_gemm_amx_dot
        self._amx_dot.argtypes = gemv_args + [_I]
        self._amx_dot.restype = _I
        self._r16 = lib.quant_gemv_r16
        self._r16.argtypes = [_I, _P, _P, _P, _I64, _I, _P, _P, _I64, _I, _I64, _I64, _I64, _I]
        self._r16.restype = _I
        self._r16_bytes = lib.quant_r16_bytes
        self._r16_bytes.argtypes = [_I, _I64, _I64]
        self._r16_bytes.restype = _I64
        self._r16_pack = lib.quant_r16_pack
        self._r16_pack.argtypes = [_I, _P, _I64, _I64, _I64, _P]
        self._r16_pack.restype = _I
        self._r16_unpack = lib.quant_r16_unpack
        self._r16_unpack.argtypes = [_I, _P, _I64, _I64, _I64, _P]
        self._r16_unpack.restype = _I
        lib.quant_r16_available.restype = _I
        self.has_r16 = bool(lib.quant_r16_available())
        """Whether the r16 path runs here (AVX-512 with VNNI, or AVX2 without VNNI)."""
        self._gemm = lib.quant_gemm_widen
        self._gemm.argtypes = [_I, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I]
        self._gemm.restype = _I
        lib.quant_gemm_widen_available.restype = _I
        self.has_gemm = bool(lib.quant_gemm_widen_available())
        """Whether the gemm path runs here (a build with AVX2 or AVX-512)."""
        lib.quant_isa.restype = _I
        lib.quant_amx_available.restype = _I
        self.isa_flags = int(lib.quant_isa())
        self.has_amx = (self.isa_flags & _AMX_BITS == _AMX_BITS
                        and bool(lib.quant_amx_available()))
        """Whether the AMX paths run here (compiled in, and Linux granted the tile state)."""
        self.r16_formats = R16_FORMATS if self.has_r16 else ()
        """The formats the r16 path runs here."""
        self.batch_invariant = False
        """Whether the weights on these kernels take one path at every row count
        (models/quant_weights.py `invariant_path`; a batch-invariant engine's)."""

    @classmethod
    def load(cls, lib: ctypes.CDLL | None,
             batch_invariant: bool = False) -> QuantKernels | None:
        """The kernels of `lib`, or None when there is no library or it lacks them.
        batch_invariant: see the attribute."""
        if lib is None or not hasattr(lib, "quant_isa"):
            return None
        kernels = cls(lib)
        kernels.batch_invariant = batch_invariant
        return kernels

    @property
    def isa(self) -> str:
        """The level and extensions compiled in, e.g. 'avx512+bf16+vnni', 'avx2', 'scalar'."""
        names = [name for bit, name in _ISA_BITS.items() if self.isa_flags & bit]
        names += ["amx"] if self.has_amx else []
        return "+".join(names) if names else "scalar"

    @property
    def has_vnni(self) -> bool:
        """Whether the dot path has vpdpbusd (else pmaddubsw + pmaddwd)."""
        return bool(self.isa_flags & 8)

    @property
    def has_bf16(self) -> bool:
        """Whether bf16 activations take vdpbf16ps (else they are widened to fp32)."""
        return bool(self.isa_flags & 4)

    def gemv(self, fmt: str, blocks: torch.Tensor, scales: torch.Tensor | None, k: int,
             x: torch.Tensor, bias: torch.Tensor | None, path: str = "deq",
             threads: int = 0) -> torch.Tensor:
        """x [M, k] (bf16 or fp32, unit stride along k) times the quantized weight
        `blocks` [N, row_bytes] (uint8, contiguous; INT8: `scales` fp32 [N]) transposed,
        plus bias (fp32 [N] or None): [M, N] in x's dtype. path: one of PATHS."""
        self._check_weight(blocks, scales)
        if (x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1
                or x.dtype not in (torch.bfloat16, torch.float32)):
            raise ValueError(f"x must be [M, {k}] bfloat16 or float32 with unit stride along "
                             f"K, got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
        n = blocks.shape[0]
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        m, x_bf16 = x.shape[0], int(x.dtype == torch.bfloat16)
        y = torch.empty(m, n, dtype=x.dtype)
        scales_p = None if scales is None else scales.data_ptr()
        bias_p = None if bias is None else bias.data_ptr()
        args = (FORMAT_CODES[fmt], blocks.data_ptr(), blocks.stride(0), scales_p,
                x.data_ptr(), x.stride(0), x_bf16, bias_p, y.data_ptr(), n, x_bf16, m, n, k)
        if path == "dot":
            status = self._dot(*args, threads)
        elif path == "amx_dot":
            if not self.has_amx:
                raise ValueError("the amx_dot path needs AMX (has_amx)")
            status = self._amx_dot(*args, threads)
        elif path == "amx":
            if not self.has_amx or x.dtype != torch.bfloat16:
                raise ValueError("the amx path needs AMX (has_amx) and bfloat16 input")
            status = self._amx(FORMAT_CODES[fmt], blocks.data_ptr(), blocks.stride(0), scales_p,
                               x.data_ptr(), x.stride(0), bias_p, y.data_ptr(), n, x_bf16,
                               m, n, k, threads)
        elif path in ("deq", "deq_buffered"):
            status = self._deq(*args, int(path == "deq_buffered"), threads)
        elif path == "gemm":
            if not self.has_gemm or x.dtype != torch.bfloat16:
                raise ValueError("the gemm path needs AVX2 or AVX-512 (has_gemm) and bfloat16 "
                                 "input")
            status = self._gemm(FORMAT_CODES[fmt], blocks.data_ptr(), blocks.stride(0), scales_p,
                                x.data_ptr(), x.stride(0), bias_p, y.data_ptr(), n, m, n, k,
                                threads)
            if status == -2:
                raise MemoryError("quantized GEMM: could not allocate its buffers")
        elif path == "r16":
            raise ValueError("the r16 path reads the repacked weight: use gemv_r16")
        else:
            raise ValueError(f"path must be one of {PATHS}, not {path!r}")
        self._check(status, fmt, k, blocks)
        return y

    def r16_pack(self, fmt: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
        """The weight `blocks` [N, row_bytes] repacked for the r16 path: a flat uint8
        tensor (16 rows per vector; N padded to 16; the same bytes per weight)."""
        self._check_weight(blocks, None)
        n = blocks.shape[0]
        size = self._r16_bytes(FORMAT_CODES[fmt], n, k) if fmt in R16_FORMATS else -1
        if size < 0:
            raise QuantKernelError(f"the r16 layout does not hold {fmt} with K={k}")
        out = self._packed_memory.empty(size, torch.uint8)
        status = self._r16_pack(FORMAT_CODES[fmt], blocks.data_ptr(), blocks.stride(0), n, k,
                                out.data_ptr())
        self._check(status, fmt, k, blocks)
        return out

    def r16_unpack(self, fmt: str, packed: torch.Tensor, n: int, k: int,
                   row_bytes: int) -> torch.Tensor:
        """The blocks [n, row_bytes] that `r16_pack` made `packed` of, byte for byte."""
        self._check_packed(fmt, packed, n, k)
        out = torch.empty(n, row_bytes, dtype=torch.uint8)
        status = self._r16_unpack(FORMAT_CODES[fmt], packed.data_ptr(), row_bytes, n, k,
                                  out.data_ptr())
        self._check(status, fmt, k, out)
        return out

    def _check_packed(self, fmt: str, packed: torch.Tensor, n: int, k: int) -> int:
        """The bytes of an r16 `fmt` [n, k] weight, which `packed` must hold
        (QuantKernelError otherwise)."""
        size = self._r16_bytes(FORMAT_CODES[fmt], n, k) if fmt in R16_FORMATS else -1
        if size < 0 or packed.dtype != torch.uint8 or packed.numel() != size:
            raise QuantKernelError(f"a packed r16 {fmt} weight [{n}, {k}] needs {size} bytes, "
                                   f"got {packed.numel()} {packed.dtype}")
        return size

    def r16_adopt(self, fmt: str, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """A copy, in the memory r16 weights live in, of `packed`: what `r16_pack` made of
        an [n, k] weight of `fmt` with this library (the weight cache's copy,
        worker/cpu/weight_cache.py); QuantKernelError when its size is not that."""
        size = self._check_packed(fmt, packed, n, k)
        out = self._packed_memory.empty(size, torch.uint8)
        out.copy_(packed.reshape(-1))
        return out

    def gemv_r16(self, fmt: str, packed: torch.Tensor, scales: torch.Tensor | None, n: int,
                 k: int, x: torch.Tensor, bias: torch.Tensor | None,
                 threads: int = 0) -> torch.Tensor:
        """`gemv` on the r16 path: x [M, k] times the weight `packed` (r16_pack of an
        [n, k] weight; INT8: `scales` fp32 [n]) transposed, plus bias: [M, n] in x's
        dtype."""
        if not self.has_r16:
            raise ValueError("the r16 path needs AVX-512 VNNI or AVX2 without VNNI (has_r16)")
        if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.numel() != \
                self._r16_bytes(FORMAT_CODES[fmt], n, k):
            raise ValueError(f"packed must be r16_pack's output for a {fmt} [{n}, {k}] weight")
        if (x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1
                or x.dtype not in (torch.bfloat16, torch.float32)):
            raise ValueError(f"x must be [M, {k}] bfloat16 or float32 with unit stride along "
                             f"K, got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        m, x_bf16 = x.shape[0], int(x.dtype == torch.bfloat16)
        y = torch.empty(m, n, dtype=x.dtype)
        status = self._r16(FORMAT_CODES[fmt], packed.data_ptr(),
                           None if scales is None else scales.data_ptr(), x.data_ptr(),
                           x.stride(0), x_bf16, None if bias is None else bias.data_ptr(),
                           y.data_ptr(), n, x_bf16, m, n, k, threads)
        if status == -3:
            raise MemoryError("quantized kernel: could not allocate its scratch buffers")
        if status != 0:
            raise QuantKernelError(f"the r16 kernel refused {fmt} with K={k} (status {status})")
        return y

    def dequantize(self, fmt: str, blocks: torch.Tensor, scales: torch.Tensor | None, k: int,
                   rows: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None, threads: int = 0) -> torch.Tensor:
        """Rows [n0, n1) (default: all) of the weight as a dense [n1 - n0, k] tensor of
        dtype (float32 or bfloat16), into `out` when given (contiguous rows, unit stride)."""
        self._check_weight(blocks, scales)
        n0, n1 = rows if rows is not None else (0, blocks.shape[0])
        if not 0 <= n0 <= n1 <= blocks.shape[0]:
            raise ValueError(f"rows ({n0}, {n1}) outside the weight's {blocks.shape[0]} rows")
        if out is None:
            out = torch.empty(n1 - n0, k, dtype=dtype)
        if (out.dtype not in (torch.float32, torch.bfloat16) or out.stride(1) != 1
                or out.shape != (n1 - n0, k)):
            raise ValueError(f"out must be [{n1 - n0}, {k}] float32 or bfloat16 with unit "
                             f"stride along K, got {tuple(out.shape)} {out.dtype}")
        status = self._dequant(FORMAT_CODES[fmt], blocks.data_ptr(), blocks.stride(0),
                               None if scales is None else scales.data_ptr(), n0, n1, k,
                               out.data_ptr(), out.stride(0), int(out.dtype == torch.bfloat16),
                               threads)
        self._check(status, fmt, k, blocks)
        return out

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] as the dot path quantizes it: int8 [M, Kp] (Kp = K rounded up to 64,
        zero past K) and the fp32 chunk scales [M, Kp / 32]."""
        m, k = x.shape
        kp = (k + 63) // 64 * 64
        q = torch.empty(m, kp, dtype=torch.int8)
        d = torch.empty(m, kp // 32, dtype=torch.float32)
        status = self._quantize_x(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16),
                                  m, k, q.data_ptr(), d.data_ptr())
        if status < 0:
            raise MemoryError("quant_quantize_x: out of memory")
        return q, d

    @staticmethod
    def _check_weight(blocks: torch.Tensor, scales: torch.Tensor | None) -> None:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
            raise ValueError(f"blocks must be contiguous uint8 [N, row_bytes], got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        if scales is not None and (scales.dtype != torch.float32 or not scales.is_contiguous()
                                   or scales.shape != blocks.shape[:1]):
            raise ValueError(f"scales must be contiguous float32 [{blocks.shape[0]}]")

    @staticmethod
    def _check(status: int, fmt: str, k: int, blocks: torch.Tensor) -> None:
        if status == -3:
            raise MemoryError("quantized kernel: could not allocate its scratch buffers")
        if status != 0:
            raise QuantKernelError(f"quantized kernel refused format {fmt} with K={k} and "
                                   f"{blocks.stride(0)} bytes per row")
