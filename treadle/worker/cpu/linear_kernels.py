"""Kernels for the model's linear layers on CPU: weights prepacked for oneDNN (bfloat16 on
x86), and the small-batch C kernel.

torch's `F.linear` re-lays out a bf16 weight for oneDNN on every call; packing it once at
load time and calling the packed kernel is ~2x faster at the 1-16 rows of a decode-heavy
step and ~15% faster at 64 rows (measured on the benchmark model's shapes, 2 cores,
torch 2.13), with the same results. The packed kernel is a torch-internal op (the one
inductor uses for frozen CPU models), so it is probed once and the plain `F.linear`
path is kept wherever the probe fails or the dtype is not bfloat16.

At the few rows of a decode step, a C kernel that streams the original [out, in] weight
(worker/cpu/native_linear.py, `NativeLayerOps.linear`) is faster still; `DenseLinearKernel`
takes it first wherever it applies. Where the C kernels have the packed vdpbf16ps GEMM
(AVX-512 BF16 without AMX: `NativeLayerOps.vnni`), each weight gets that GEMM's packed
copy instead of oneDNN's, and the C kernels take every row count; oneDNN's copy is then
made only if a call ever falls back to it. The worker attaches one kernel per layer
(layers.linear.attach_linear_kernels with `dense_kernel_factory`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_kernel_works(dtype: torch.dtype) -> bool:
    """Whether the packed kernel exists here and matches F.linear on a probe."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=generator).to(dtype)
        x = torch.randn(5, 32, generator=generator).to(dtype)
        got = _packed_linear(x, _pack(weight), None).float()
    except (RuntimeError, AttributeError) as exc:
        logger.info("packed bf16 linear unavailable (%s); using F.linear", exc)
        return False
    return torch.allclose(got, F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


class DenseLinearKernel:
    """One layer's matmul on its dense weight: the C kernels where they cover the input
    (bf16; few rows, or any rows on the packed GEMM's copy `vnni`), else the prepacked
    oneDNN weight when there is one (`packed`; made on first use when `pack_on_use`), else
    F.linear. The packed copies do not follow later changes of the weight; the
    dot-product kernel reads the weight in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: torch.Tensor | None, native=None, vnni: torch.Tensor | None = None,
                 pack_on_use: bool = False) -> None:
        self.weight, self.bias, self.packed, self.native = weight, bias, packed, native
        self.vnni = vnni
        """The weight's copy for the packed GEMM (NativeLayerOps.pack), or None."""
        self.pack_on_use = pack_on_use
        """Make oneDNN's copy the first time a call falls back to torch."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            y = self.native.linear(x, self.weight, self.bias, packed=self.vnni)
            if y is not None:
                return y
        if self.packed is None and self.pack_on_use:
            self.packed, self.pack_on_use = _pack(self.weight.detach()), False
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def float_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """`self(x).float()` in one pass (float32 outputs rounded to bf16 first), or None
        where the packed GEMM does not run this weight (the native ops decline a missing
        packed copy)."""
        if self.native is None:
            return None
        return self.native.linear_float(x, self.weight, self.bias, self.vnni)

    def argmax(self, x: torch.Tensor, columns: int | None = None) -> torch.Tensor | None:
        """Per row of x, the first column of the largest output among the first `columns`,
        int64 [M], computed without the outputs (the packed GEMM's argmax), or None where
        that GEMM does not run this weight."""
        if self.native is None:
            return None
        return self.native.argmax(x, self.weight, self.bias, self.vnni, columns)


def dense_kernel_factory(dtype: torch.dtype, native=None):
    """The factory of DenseLinearKernels for a model of `dtype` (models.linear
    LinearKernelFactory): weights packed where the packed kernel works, `native`
    (worker.cpu.native_linear.NativeLayerOps) for small batches when given. None when
    neither applies (the layers keep plain F.linear)."""
    packs = packed_kernel_works(dtype)
    if not packs and native is None:
        return None

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinearKernel:
        vnni = native.pack(weight.detach()) if native is not None else None
        if vnni is not None:
            return DenseLinearKernel(weight, bias, None, native, vnni, pack_on_use=packs)
        return DenseLinearKernel(weight, bias, _pack(weight.detach()) if packs else None,
                                 native)
    return make
