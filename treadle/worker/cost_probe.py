"""Start-up measurements behind the choice between recompute and swap.

Measures, on this machine and now, how fast the model's dtype multiplies matrices and how
fast KV bytes copy. Each probe takes tens of milliseconds; figures are medians of a few
repeats. Nothing here decides anything: core/policy.py turns the numbers into choices.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul_flops_per_s(in_features: int, out_features: int, dtype: torch.dtype,
                               rows: int = 256) -> float:
    """Matmul rate of a [rows, in] x [in, out] product, the shape of a prefill chunk."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    seconds = _median_seconds(lambda: F.linear(x, w))
    return 2 * rows * in_features * out_features / seconds


def measure_copy_bytes_per_s(num_bytes: int = 32 * 1024**2) -> float:
    """Rate of copying a buffer of KV-block size scale between two host tensors."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return num_bytes / _median_seconds(lambda: dst.copy_(src))
