"""Typed wrappers of the C kernels for bf16 layers (kernels/gemv_bf16.c, gemm_bf16_amx.c,
gemm_bf16_widen.c, gemm_bf16_vnni.c, norm_bf16.c): the linear layer, fused residual-add +
RMSNorm, silu(gate) * up, and rotary embedding fused with the K/V cache write.

A decode step runs every layer on a few rows (one per request), where a linear layer is
bound by reading its weight and the elementwise steps by per-op dispatch. `NativeLayerOps`
takes the library that `treadle.worker.cpu.native.load_kernels` built (all kernels live in one
shared object) and is handed by the worker to the model's layers (`LlamaForCausalLM.
set_kernels`, worker/cpu/linear_kernels.py) and to the cpu-native attention backend
(`rope_kv`); each method returns None where it does not apply (dtype, rows, layout)
so that the caller runs its torch path instead. How many rows the linear kernel takes
depends on the library's ISA level and on whether oneDNN has AMX (`MAX_ROWS`,
`AMX_MAX_ROWS`, `WIDENING_MAX_ROWS`); where the level has no bf16 arithmetic, batches
from `WIDENING_GEMM_ROWS` rows on take the register-tiled GEMM instead of the
dot-product kernel. Where it has vdpbf16ps and oneDNN has no AMX (`NativeLayerOps.vnni`),
a linear whose weight has its packed copy (`pack`, made at load by
worker/cpu/linear_kernels.py) runs on the packed GEMM at every row count, prefill included.

Batch-invariant ops (`load(..., batch_invariant=True)`, docs/batch_invariance.md) give
each weight one kernel for every row count, whose sums run over K in the same order
whatever the rows: the AMX tile kernel where the CPU has AMX-BF16 (measured the cheapest
there: `INVARIANT_KERNELS`), the packed GEMM where it has vdpbf16ps without AMX, the
widening GEMM elsewhere and for a weight the first two do not take (shape, no packed
copy). They never decline a call that fits the operands (no oneDNN, whose kernels change
with the rows).
"""

from __future__ import annotations

import ctypes
import os

import torch

from treadle.worker.cpu.huge_pages import HugePageArena

MAX_ROWS = 64
"""Rows up to which the C linear kernel is used where it has vdpbf16ps (AVX-512 BF16) and
oneDNN has no AMX. Up to 16 rows it reads each weight once and beats oneDNN's packed
kernel; from 17 to 64 it is level with oneDNN or faster, and taking those rows lets the
decode stack run their steps without Python between the kernels. A SmolLM2-135M step's
layer linears, 2 threads, Zen 4, ms at 16 / 24 / 32 / 48 / 64 / 128 rows: C 14.3 / 19.1 /
24.3 / 37.7 / 43.9 / 74.9, oneDNN 15.8 / 20.0 / 28.7 / 39.5 / 42.3 / 72.8; a 48-request
decode step 78.6 -> 64.4 ms (docs/benchmarks.md, "Round 16")."""
AMX_MAX_ROWS = 4
"""Rows up to which the C kernel (vdpbf16ps) is used where oneDNN runs bf16 on AMX tiles
(`onednn_uses_amx`): there oneDNN's packed kernel costs about the same from 1 to 16 rows,
while the C kernel's cost grows with each row. All of a SmolLM2-135M step's linears, 2
threads, on an AMX Xeon: C 10.9 / 12.3 / 15.1 / 18.2 / 30.2 ms at 1 / 4 / 6 / 8 / 16 rows,
oneDNN 14.2 / 13.9 / 13.9 / 14.4 / 15.7 (docs/benchmarks.md, "Every CPU")."""
AMX_GEMM_ROWS = (4, 64)
"""Rows (first, last) for which the AMX tile kernel (kernels/gemm_bf16_amx.c) takes a
linear where the CPU has AMX-BF16 and the shape fits it (K % 32, N % 16). All of a
SmolLM2-135M step's linears, 2 threads, on an AMX Xeon, ms at 1 / 2 / 4 / 8 / 16 / 32 /
48 / 64 rows (`python -m treadle.bench.linear_kernel --rows 1,2,4,8,16,32,48,64 --isa
avx512bf16 --repeats 5`, model_ms): AMX 8.0 / 7.7 / 8.5 / 9.7 / 10.8 / 13.8 / 18.2 / 21.9,
the dot-product kernel 7.5 / 7.7 / 9.2 / 14.9 / 25.6 / 46.8 / 69 / 94, oneDNN's packed
kernel 13.5 / 13.4 / 13.6 / 13.7 / 14.5 / 17.3 / 18.6 / 20.8. Alone it is level with
oneDNN from ~48 rows (it re-reads the packed x from L2 for every 16 weight rows), but in
whole decode steps it lets the decode stack take them: 48 and 64 requests' steps 12% and
10% shorter (docs/benchmarks.md, "A decode step without Python between the kernels")."""
WIDENING_MAX_ROWS = 65536
"""Rows up to which the widening kernel (AVX-512F or AVX2, no bf16 instructions) is used:
every step's rows in practice. Without bf16 instructions torch's bf16 linear was 2-6x slower
than fp32 at 16-512 rows and 1.5-4.7x slower than this kernel at every row count
(docs/benchmarks.md, "Every CPU"), so the torch path would be the slow one at any row
count."""

WIDENING_GEMM_ROWS = 20
"""Rows from which the register-tiled GEMM (kernels/gemm_bf16_widen.c) takes a linear at
the widening levels, instead of the dot-product kernel. All of a SmolLM2-135M step's
layer linears, 2 threads, AVX2 on an AMD EPYC (Zen 3), ms at 8 / 16 / 20 / 24 / 32 / 64 /
512 rows: dot-product kernel 21.3 / 45.4 / 52.8 / 61.5 / 74.2 / 170 / 1,271, GEMM 31.8 /
47.2 / 52.6 / 56.0 / 68.3 / 121 / 841, torch fp32 (MKL) 83.5 / 97.2 / 107 / 114 / 134 /
202 / 1,070 (`python -m treadle.bench.linear_kernel --isa avx2 --fp32`; docs/benchmarks.md,
"A CPU with AVX2 only")."""

VNNI_GEMM = "packed vdpbf16ps GEMM at every row count"
"""What the packed GEMM (kernels/gemm_bf16_vnni.c) takes where it runs. A SmolLM2-135M
step's layer linears, 2 threads, Zen 4 (no AMX), GFLOP/s at 1 / 4 / 16 / 48 / 64 / 1,024
rows: packed GEMM 32 / 129 / 328-366 / 396-422 / 415-431 / 439-454, the dot-product
kernel 27 / 114 / 261-285 / 359-362 / 372 / 383, oneDNN's packed kernel 20 / 92 / 241-257
/ 316 / 356 / 423 (`python -m treadle.bench.linear_kernel`; docs/benchmarks.md, "Round
16")."""

INVARIANT_KERNELS = "one kernel per weight at every row count"
"""What batch-invariant ops run (`NativeLayerOps.batch_invariant`). On the AMX Xeon this
was chosen on, a SmolLM2-135M step's layer linears and LM head, one thread, CPU ms at 1 /
4 / 16 / 64 rows: AMX tiles 18.0 / 17.0 / 20.5 / 33.1, the packed vdpbf16ps GEMM 18.6 /
20.7 / 43.0 / 156, the default routing (dot products to 3 rows, AMX to 64, oneDNN
beyond) 16.6 / 17.2 / 20.7 / 31.0 (a busy machine; the kernels alternating, best of 7):
AMX tiles at every row count there, the packed GEMM where there is no AMX (it is that
CPU's default anyway), the widening GEMM without bf16 instructions (it already takes 20+
rows there)."""

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ANY_ROWS = 1 << 62  # batch-invariant ops: no row limit


def _operands_fit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the bf16 kernels take these operands: x bf16 [M, K] with unit stride along
    K, weight bf16 [N, K] contiguous, bias None or bf16 [N] contiguous."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == x.shape[1]
            and (bias is None or (bias.dtype == torch.bfloat16
                                  and bias.shape == weight.shape[:1]
                                  and bias.is_contiguous())))


def onednn_uses_amx() -> bool:
    """Whether torch's oneDNN runs bf16 linears on AMX tiles here: the CPU has them (as
    torch reports) and ONEDNN_MAX_CPU_ISA, when set, does not cap oneDNN below AMX."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if supported is None or not supported():
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not cap or cap in ("ALL", "DEFAULT") or "AMX" in cap


class NativeLayerOps:
    """The bf16 layer kernels of one loaded library."""

    def __init__(self, lib: ctypes.CDLL, max_rows: int = MAX_ROWS,
                 amx_rows: tuple[int, int] | None = None, gemm_rows: int | None = None,
                 vnni: bool = False, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        """One kernel per weight for every row count, never oneDNN (see the top)."""
        self.max_rows = max_rows
        """Rows up to which the dot-product kernel (gemv_bf16.c) runs a linear (or, from
        `gemm_rows` on, the widening GEMM)."""
        self.amx_rows = amx_rows
        """(first, last) rows the AMX tile kernel takes, or None (no AMX here)."""
        self.gemm_rows = gemm_rows
        """Rows from which the widening GEMM (gemm_bf16_widen.c) takes a linear, or None
        (a level with bf16 arithmetic, where oneDNN has the batches)."""
        self.vnni = vnni
        """Whether a linear with a packed copy of its weight (`pack`) runs on the packed
        GEMM (gemm_bf16_vnni.c) at every row count: vdpbf16ps here and no AMX in oneDNN."""
        self._packed_memory = HugePageArena()
        """Where `pack` puts the packed copies: huge pages, which every decode step
        streams (worker/cpu/huge_pages.py)."""
        self.lib = lib
        """The library (worker/cpu/decode_stack.py finds its layer driver there)."""
        self._gemv = lib.gemv_bf16
        self._gemv.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int]
        self._gemv.restype = ctypes.c_int
        self._add_rms_norm = lib.add_rms_norm_bf16
        self._add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, ctypes.c_float]
        self._add_rms_norm.restype = ctypes.c_int
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.argtypes = [_P, _P, _I64, _I64]
        self._silu_mul.restype = ctypes.c_int
        self._gemma_add_norm = lib.gemma_add_norm_bf16
        self._gemma_add_norm.argtypes = [_P] * 5 + [_I64, _I64, ctypes.c_float]
        self._gemma_add_norm.restype = ctypes.c_int
        self._gemma_head_norms = lib.gemma_head_norms_bf16
        self._gemma_head_norms.argtypes = [_P, _I64, _P, _P] + [_I64] * 4 + [ctypes.c_float]
        self._gemma_head_norms.restype = ctypes.c_int
        self._gelu_tanh_mul = lib.gelu_tanh_mul_bf16
        self._gelu_tanh_mul.argtypes = self._silu_mul.argtypes
        self._gelu_tanh_mul.restype = ctypes.c_int
        self._rope_kv = lib.rope_kv_bf16
        self._rope_kv.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _P, _P] + [_I64] * 5
        self._rope_kv.restype = ctypes.c_int
        self._rope_kv_q8 = lib.rope_kv_q8_bf16
        self._rope_kv_q8.argtypes = self._rope_kv.argtypes
        self._rope_kv_q8.restype = ctypes.c_int
        self._amx = lib.gemm_bf16_amx
        self._amx.argtypes = self._gemv.argtypes
        self._amx.restype = ctypes.c_int
        self._widen = lib.gemm_bf16_widen
        self._widen.argtypes = self._gemv.argtypes
        self._widen.restype = ctypes.c_int
        self._vnni = lib.gemm_bf16_vnni
        self._vnni.argtypes = self._gemv.argtypes
        self._vnni.restype = ctypes.c_int
        self._vnni_f32 = lib.gemm_bf16_vnni_f32
        self._vnni_f32.argtypes = self._gemv.argtypes
        self._vnni_f32.restype = ctypes.c_int
        self._vnni_argmax = lib.gemm_bf16_vnni_argmax
        self._vnni_argmax.argtypes = self._gemv.argtypes[:4] + [_P, _I64, _I64, _I64,
                                                                ctypes.c_int]
        self._vnni_argmax.restype = ctypes.c_int
        self._vnni_elems = lib.gemm_bf16_vnni_packed_elems
        self._vnni_elems.argtypes = [_I64, _I64]
        self._vnni_elems.restype = _I64
        self._vnni_pack = lib.gemm_bf16_vnni_pack
        self._vnni_pack.argtypes = [_P, _I64, _I64, _P]
        self._vnni_pack.restype = ctypes.c_int

    @classmethod
    def load(cls, lib: ctypes.CDLL | None, max_rows: int | None = None,
             batch_invariant: bool = False) -> NativeLayerOps | None:
        """The kernels of `lib`, or None when it lacks them or was built without a vector
        unit (neither AVX-512 nor AVX2). max_rows: None for the level's default (MAX_ROWS
        with vdpbf16ps, AMX_MAX_ROWS where oneDNN has AMX too, else WIDENING_MAX_ROWS, with
        the widening GEMM from WIDENING_GEMM_ROWS rows on). batch_invariant: one kernel per
        weight at every row count (`INVARIANT_KERNELS`; max_rows is then ignored)."""
        if lib is None or not hasattr(lib, "gemv_bf16_available"):
            return None
        lib.gemv_bf16_available.restype = ctypes.c_int
        if not lib.gemv_bf16_available():
            return None
        lib.kernels_have_dpbf16.restype = ctypes.c_int
        dpbf16 = bool(lib.kernels_have_dpbf16())
        if batch_invariant:
            return cls._invariant(lib, dpbf16)
        if max_rows is None:
            if not dpbf16:
                max_rows = WIDENING_MAX_ROWS
            else:
                max_rows = AMX_MAX_ROWS if onednn_uses_amx() else MAX_ROWS
        lib.gemm_bf16_amx_available.restype = ctypes.c_int
        amx = dpbf16 and bool(lib.gemm_bf16_amx_available()) and onednn_uses_amx()
        lib.gemm_bf16_vnni_available.restype = ctypes.c_int
        vnni = dpbf16 and bool(lib.gemm_bf16_vnni_available()) and not onednn_uses_amx()
        return cls(lib, max_rows, AMX_GEMM_ROWS if amx else None,
                   None if dpbf16 else WIDENING_GEMM_ROWS, vnni)

    @classmethod
    def _invariant(cls, lib: ctypes.CDLL, dpbf16: bool) -> NativeLayerOps:
        """Batch-invariant ops of `lib`: AMX tiles at every row count where the CPU has
        them (whatever oneDNN runs on), else the packed GEMM where there is vdpbf16ps, else
        the widening GEMM; the widening GEMM for what the first two do not take."""
        lib.gemm_bf16_amx_available.restype = ctypes.c_int
        lib.gemm_bf16_vnni_available.restype = ctypes.c_int
        if dpbf16 and lib.gemm_bf16_amx_available():
            return cls(lib, 0, (1, _ANY_ROWS), batch_invariant=True)
        vnni = dpbf16 and bool(lib.gemm_bf16_vnni_available())
        return cls(lib, _ANY_ROWS, None, 1, vnni, batch_invariant=True)

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of a bf16 weight [N, K] for the packed GEMM (a flat bf16 tensor
        of the same size, rounded up to 16 rows and an even K), or None where that GEMM
        does not run (`vnni` false) or the weight is not a contiguous bf16 matrix."""
        if (not self.vnni or weight.dtype != torch.bfloat16 or weight.dim() != 2
                or not weight.is_contiguous()):
            return None
        n, k = weight.shape
        out = self._packed_memory.empty(self._vnni_elems(n, k), torch.bfloat16)
        self._vnni_pack(weight.data_ptr(), n, k, out.data_ptr())
        return out

    def packed_fits(self, packed: torch.Tensor | None, weight: torch.Tensor) -> bool:
        """Whether `packed` is `weight`'s packed copy (by size) and the packed GEMM runs."""
        return (packed is not None and self.vnni and weight.dim() == 2
                and packed.dtype == torch.bfloat16
                and packed.numel() == self._vnni_elems(*weight.shape))

    def amx_covers(self, rows: int, n: int, k: int) -> bool:
        """Whether the AMX tile kernel takes an [rows, k] x [n, k]^T linear."""
        return (self.amx_rows is not None and self.amx_rows[0] <= rows <= self.amx_rows[1]
                and k % 32 == 0 and n % 16 == 0)

    @property
    def linear_rows(self) -> int:
        """Rows up to which `linear` covers every shape the AMX kernel takes."""
        return max(self.max_rows, 0 if self.amx_rows is None else self.amx_rows[1])

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               threads: int = 0, packed: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [M, K] @ weight[N, K].T + bias as bf16 [M, N] on the packed GEMM (any M, when
        `packed` is the weight's copy from `pack`), the AMX tile kernel (`amx_covers`), the
        widening GEMM (from `gemm_rows` rows) or the dot-product kernel, or None when not
        covered: not bf16, M past every kernel's rows, x not 2-D with unit stride along K,
        weight or bias not contiguous. threads: 0 = OpenMP's default."""
        if not _operands_fit(x, weight, bias):
            return None
        m, k = x.shape
        n = weight.shape[0]
        vnni = self.packed_fits(packed, weight)
        amx = not vnni and self.amx_covers(m, n, k)
        widen = self.gemm_covers(m) or (self.batch_invariant and not (vnni or amx))
        if not (vnni or amx or widen) and m > self.max_rows:
            return None
        y = torch.empty(m, n, dtype=torch.bfloat16)
        fn = (self._vnni if vnni else self._amx if amx
              else self._widen if widen else self._gemv)
        status = fn(x.data_ptr(), x.stride(0), packed.data_ptr() if vnni else weight.data_ptr(),
                    None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, threads)
        if status:
            raise RuntimeError(f"bf16 linear kernel failed with status {status} (-2: out of "
                               f"memory) at {m} x {k} by {n}")
        return y

    def linear_float(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None, threads: int = 0) -> torch.Tensor | None:
        """`linear(x, weight, bias, packed=packed).float()` in one pass, float32 [M, N]
        (each value rounded to bf16 as `linear` rounds it): the packed GEMM storing its
        outputs widened (gemm_bf16_vnni_f32), for logits the sampler reads in float32.
        None where that GEMM does not take the call (as `argmax`)."""
        if not (self.packed_fits(packed, weight) and _operands_fit(x, weight, bias)):
            return None
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        status = self._vnni_f32(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                None if bias is None else bias.data_ptr(), y.data_ptr(), n,
                                m, n, k, threads)
        if status:
            raise RuntimeError(f"bf16 linear kernel (float32 out) failed with status {status} "
                               f"at {m} x {k} by {n}")
        return y

    def argmax(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None, columns: int | None = None,
               threads: int = 0) -> torch.Tensor | None:
        """Per row of x, the first column of the largest value of `linear(x, weight, bias,
        packed=packed)` among its first `columns` (default: all), int64 [M], without
        writing the product out: the packed GEMM's greedy choice (gemm_bf16_vnni_argmax).
        None where that GEMM does not take the call (no packed copy, not bf16, x not 2-D
        with unit stride along K)."""
        if not (self.packed_fits(packed, weight) and _operands_fit(x, weight, bias)):
            return None
        m, k = x.shape
        n = weight.shape[0] if columns is None else min(columns, weight.shape[0])
        out = torch.empty(m, dtype=torch.int64)
        status = self._vnni_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   m, n, k, threads)
        if status:
            raise RuntimeError(f"bf16 argmax kernel failed with status {status} (-2: out of "
                               f"memory) at {m} x {k} by {n}")
        return out

    def describe(self) -> str:
        """Which kernel takes which rows, for the start-up log."""
        if self.batch_invariant:
            kernel = ("AMX tiles" if self.amx_rows is not None else
                      "packed vdpbf16ps GEMM" if self.vnni else "tiled GEMM")
            return (f"batch-invariant: {kernel} at every row count"
                    + ("" if kernel == "tiled GEMM" else " (tiled GEMM for other weights)"))
        if self.vnni:
            return f"{VNNI_GEMM} (dot products <= {self.max_rows} rows without a packed copy)"
        parts = []
        if self.gemm_rows is not None:
            parts.append(f"dot products <= {min(self.max_rows, self.gemm_rows - 1)} rows, "
                         f"tiled GEMM {self.gemm_rows}-{self.max_rows}")
        else:
            parts.append(f"dot products <= {self.max_rows} rows")
        if self.amx_rows is not None:
            parts.append(f"AMX tiles {self.amx_rows[0]}-{self.amx_rows[1]}")
        return ", ".join(parts)

    def gemm_covers(self, rows: int) -> bool:
        """Whether the widening GEMM takes a linear of `rows` rows (within max_rows)."""
        return self.gemm_rows is not None and self.gemm_rows <= rows <= self.max_rows

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """`hidden += delta` (in place; skipped when delta is None), then rms_norm(hidden)
        * weight as a new tensor; None when not covered (bf16, contiguous [M, H])."""
        if (hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or not hidden.is_contiguous()
                or weight.dtype != torch.bfloat16 or not weight.is_contiguous()
                or weight.shape != hidden.shape[1:]
                or (delta is not None and (delta.dtype != torch.bfloat16
                                           or delta.shape != hidden.shape
                                           or not delta.is_contiguous()))):
            return None
        out = torch.empty_like(hidden)
        self._add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                           weight.data_ptr(), out.data_ptr(), hidden.shape[0], hidden.shape[1],
                           eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate_up[:, :I]) * gate_up[:, I:] as bf16 [M, I]; None when not covered."""
        if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return None
        m, two_i = gate_up.shape
        out = torch.empty(m, two_i // 2, dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
        return out

    def gemma_add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                       delta_weight: torch.Tensor | None, weight: torch.Tensor | None,
                       eps: float) -> torch.Tensor | bool | None:
        """Gemma 3's norms around a residual add (kernels/norm_bf16.c): `hidden +=
        gemma_norm(delta, delta_weight)` in place (skipped when delta is None), then
        gemma_norm(hidden, weight) as a new tensor (with weight None: nothing, and True
        returned). None when not covered (bf16, contiguous [M, H]): nothing was written."""
        shape = hidden.shape
        if (hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or not hidden.is_contiguous()
                or any(w is not None and (w.dtype != torch.bfloat16 or not w.is_contiguous()
                                          or w.shape != shape[1:])
                       for w in (delta_weight, weight))
                or (delta is not None and (delta_weight is None
                                           or delta.dtype != torch.bfloat16
                                           or delta.shape != shape
                                           or not delta.is_contiguous()))):
            return None
        out = None if weight is None else torch.empty_like(hidden)
        self._gemma_add_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                             None if delta_weight is None else delta_weight.data_ptr(),
                             None if weight is None else weight.data_ptr(),
                             None if out is None else out.data_ptr(), shape[0], shape[1], eps)
        return True if out is None else out

    def gemma_head_norms(self, qkv: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, heads: int, kv_heads: int,
                         eps: float) -> bool:
        """Gemma's per-head norms of the queries and keys of a fused [M, (heads + 2 *
        kv_heads) * head_dim] projection, in place; False when not covered (nothing
        written)."""
        d = q_weight.shape[0]
        if (qkv.dtype != torch.bfloat16 or qkv.dim() != 2 or qkv.stride(1) != 1
                or qkv.shape[1] < (heads + kv_heads) * d
                or any(w.dtype != torch.bfloat16 or not w.is_contiguous() or w.shape != (d,)
                       for w in (q_weight, k_weight))):
            return False
        return self._gemma_head_norms(qkv.data_ptr(), qkv.stride(0), q_weight.data_ptr(),
                                      k_weight.data_ptr(), qkv.shape[0], heads, kv_heads, d,
                                      eps) == 0

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gelu_tanh(gate_up[:, :I]) * gate_up[:, I:] as bf16 [M, I]; None when not
        covered."""
        if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return None
        m, two_i = gate_up.shape
        out = torch.empty(m, two_i // 2, dtype=torch.bfloat16)
        self._gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
        return out

    def rope_kv(self, qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Rotate queries and keys, store keys and values at their cache slots, and return
        the rotated queries as a contiguous [M, heads, head_dim]; None when not covered
        (then nothing was written).

        qk: [M, heads + kv_heads, head_dim] (queries, then keys); value: [M, kv_heads,
        head_dim]; cos, sin: [M, 1, head_dim // 2] (RotaryEmbedding.cos_sin); kv_cache:
        [2, kv_heads, num_blocks, block_size, head_dim] bf16, or int8 rows [..., head_dim
        + 2] (worker/kv_quant.py: keys and values quantized as they are stored);
        slot_mapping: [M] int64.
        """
        m, num_qk, head_dim = qk.shape
        num_kv_heads = kv_cache.shape[1]
        tensors = (qk, value, cos, sin)
        q8 = kv_cache.dtype == torch.int8
        if q8 and kv_cache.shape[-1] != head_dim + 2:
            return None
        if (any(t.dtype != torch.bfloat16 for t in tensors) or not kv_cache.is_contiguous()
                or not (q8 or kv_cache.dtype == torch.bfloat16)
                or qk.stride(2) != 1 or qk.stride(1) != head_dim
                or value.stride(2) != 1 or value.stride(1) != head_dim
                or value.shape != (m, num_kv_heads, head_dim)
                or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)
                or cos.shape[0] != m or cos.shape[-1] * 2 != head_dim
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
                or slot_mapping.shape != (m,)):
            return None
        num_heads = num_qk - num_kv_heads
        slots_per_head = kv_cache.shape[2] * kv_cache.shape[3]
        q = torch.empty(m, num_heads, head_dim, dtype=torch.bfloat16)
        fn = self._rope_kv_q8 if q8 else self._rope_kv
        status = fn(qk.data_ptr(), qk.stride(0), value.data_ptr(), value.stride(0),
                               cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                               slot_mapping.data_ptr(), q.data_ptr(), kv_cache[0].data_ptr(),
                               kv_cache[1].data_ptr(), m, num_heads, num_kv_heads, head_dim,
                               slots_per_head)
        return q if status == 0 else None
