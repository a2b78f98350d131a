"""The LoRA term of a linear layer over a flat batch of several adapters' segments.

`LoRALinearKernel` is the kernel object (layers/linear.py) of a layer an adapter may
change: it runs the layer's own kernel once over every row (one base matmul for the whole
batch), then adds each adapter segment's low-rank term, y[rows] += (x[rows] @ A.T) @ B.T
per module, in the spirit of Punica's SGMV: the runner orders its rows so that each
adapter's rows are contiguous (worker/model_runner.py), and `LoRAStep` holds the step's
segments, shared by every layer. Fused layers stay fused: q, k and v (or gate and up) share
one shrink matmul over their stacked A, and each adds into its own columns of the fused
output. Under tensor parallelism a row-parallel layer adds its partial term before the
base layer's all-reduce (the sum of the partial terms is the whole term), so no
collective is added. Which kernel computes a segment's term is `LoRAOps`' choice; this
module decides nothing about which adapters are resident (manager.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from treadle.worker.lora.weights import AdapterWeights, TargetWeights


class TorchLoRAOps:
    """Segments' terms with torch: one shrink matmul and one addmm per module. Adapter
    weights in fp32 under a bf16 / fp16 model on CPU (the manager's choice): the rows are
    widened, the term computed in fp32 and added with one rounding, because torch's CPU
    matmuls of these small shapes are several times faster in fp32 than in bf16. The
    C kernel (native_ops.py) is the faster choice where it is built."""

    name = "torch"

    def prepare(self, segments: list[tuple[AdapterWeights, int, int]]) -> None:
        """Nothing to do per step: every layer filters the step's segments itself."""

    def apply_layer(self, index: int, x: torch.Tensor, y: torch.Tensor,
                    segments: list[tuple[AdapterWeights, int, int]]) -> None:
        """Add the terms of target `index` of the step's segments to y."""
        apply_segments(x, y, [(adapter.targets[index], start, end)
                              for adapter, start, end in segments if index in adapter.targets])


def apply_segments(x: torch.Tensor, y: torch.Tensor,
                   segments: list[tuple[TargetWeights, int, int]]) -> None:
    """y[start:end] += the term of each (weights, start, end), with torch."""
    for weights, start, end in segments:
        rows_in = x[start:end]
        if rows_in.dtype != weights.a.dtype:
            rows_in = rows_in.to(weights.a.dtype)
        t = F.linear(rows_in, weights.a)
        rows = y[start:end]
        for part in weights.parts:
            c0, c1 = part.columns
            r0, r1 = part.ranks
            if rows.dtype == t.dtype:
                rows[:, c0:c1].addmm_(t[:, r0:r1], part.b.t())
            else:  # in fp32, rounded once into the output
                rows[:, c0:c1].add_(torch.mm(t[:, r0:r1], part.b.t()))


class LoRAStep:
    """The adapter segments of the current step: (weights, first token, end token) in the
    flat batch, empty when no row has an adapter."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.segments: list[tuple[AdapterWeights, int, int]] = []

    def set_segments(self, segments: list[tuple[AdapterWeights, int, int]]) -> None:
        self.segments = segments
        self.ops.prepare(segments)


class LoRALinearKernel:
    """A layer's base kernel plus the LoRA terms of the step's adapter segments."""

    def __init__(self, base: Callable[[torch.Tensor], torch.Tensor], index: int,
                 step: LoRAStep) -> None:
        self.base = base
        """The layer's own kernel (worker/cpu/linear_kernels.py, or F.linear)."""
        self.index = index
        """This layer's index among the model's LoRA targets (AdapterWeights.targets)."""
        self.step = step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.step.segments:
            self.step.ops.apply_layer(self.index, x, y, self.step.segments)
        return y


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear as a kernel, for a layer that has none attached."""
    return lambda x: F.linear(x, weight, bias)
