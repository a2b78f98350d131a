"""The machine's matmul limit, and model FLOPs utilization (MFU) against it.

Owns `measure_peak_matmul` (GFLOP/s of `torch.nn.functional.linear` on the benchmark
model's own layer shapes, median over repeats), `measure_memory_bandwidth` (a large copy's
bytes/s; both feed the simulator's measured CPU preset) and the MFU arithmetic. Re-measure the
peak in the same run as every throughput figure: machines are shared and noisy.
Must not: load a model, hard-code any figure, or leave torch's thread count changed.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from treadle.measure.benchmark_shapes import BENCHMARK_MODEL_SHAPES

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
           "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
_MIN_REPEAT_S = 0.002  # one timed repeat runs the matmul enough times to last this long


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' / 'bf16' / 'float32' / ... -> torch.dtype (ValueError names the choices)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def _time_linear(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    """Median seconds of one F.linear(x, w) call."""
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    torch.nn.functional.linear(x, w)
    one = max(time.perf_counter() - start, 1e-7)
    inner = max(1, math.ceil(_MIN_REPEAT_S / one))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            torch.nn.functional.linear(x, w)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def measure_peak_matmul(dtype: str, shapes: dict[str, tuple[int, ...]] | None = None,
                        rows: tuple[int, ...] = (256,), repeats: int = 20,
                        num_threads: int | None = None, seed: int = 0) -> dict:
    """GFLOP/s of F.linear on each shape at each row count (median over `repeats`).

    `shapes` maps a name to (in_features, out_features[, uses per token]); by default the
    benchmark model's layers. For each row count the shapes are combined as a forward pass
    would combine them: total FLOPs over total time, each shape weighted by its uses per
    token. "gflops" is that model-weighted figure at the best row count (the peak to divide
    by for MFU); "best_single_shape" is the fastest (shape, rows) alone.
    """
    if repeats < 1 or not rows or min(rows) < 1:
        raise ValueError(f"need repeats >= 1 and rows >= 1, got repeats={repeats}, rows={rows}")
    dt = torch_dtype(dtype)
    shapes = shapes or BENCHMARK_MODEL_SHAPES
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(seed)
    per_shape: dict[str, dict] = {}
    weighted: dict[str, float] = {}
    try:
        for n_rows in rows:
            total_flops = total_time = 0.0
            for name, shape in shapes.items():
                in_f, out_f = int(shape[0]), int(shape[1])
                uses = int(shape[2]) if len(shape) > 2 else 1
                x = torch.randn(n_rows, in_f, generator=gen).to(dt)
                w = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).to(dt)
                seconds = _time_linear(x, w, repeats)
                flops = 2.0 * n_rows * in_f * out_f
                per_shape[f"{name}@{n_rows}"] = {
                    "name": name, "rows": n_rows, "in_features": in_f, "out_features": out_f,
                    "uses_per_token": uses, "median_s": seconds, "gflops": flops / seconds / 1e9}
                total_flops += flops * uses
                total_time += seconds * uses
            weighted[str(n_rows)] = total_flops / total_time / 1e9
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    best_rows = max(weighted, key=weighted.get)
    best_key = max(per_shape, key=lambda k: per_shape[k]["gflops"])
    return {
        "dtype": str(dt).removeprefix("torch."), "gflops": weighted[best_rows],
        "best_rows": int(best_rows), "weighted_gflops_by_rows": weighted,
        "best_single_shape": {"key": best_key, "gflops": per_shape[best_key]["gflops"]},
        "per_shape": per_shape, "repeats": repeats, "num_threads": threads_used,
    }


def model_flops_per_token(num_params: int) -> int:
    """Model FLOPs per processed token: 2 x parameters (a multiply and an add per weight)."""
    return 2 * int(num_params)


def mfu(tokens_per_s: float, num_params: int, peak_gflops: float) -> float:
    """Model FLOPs utilization: 2 x params x tokens/s over the measured peak (a fraction)."""
    if peak_gflops <= 0:
        raise ValueError(f"peak_gflops must be > 0, got {peak_gflops}")
    return model_flops_per_token(num_params) * tokens_per_s / (peak_gflops * 1e9)


def measure_memory_bandwidth(size_bytes: int = 256 * 1024**2, repeats: int = 10,
                             num_threads: int | None = None) -> dict:
    """Bytes/s of copying a tensor of `size_bytes` into another (read + write counted),
    median over `repeats`: the streaming rate a memory-bound kernel can reach."""
    if size_bytes < 1024 or repeats < 1:
        raise ValueError(f"need size_bytes >= 1024 and repeats >= 1, got {size_bytes}, {repeats}")
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        src = torch.ones(size_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - start)
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    seconds = statistics.median(samples)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_per_s": moved / seconds, "size_bytes": src.numel() * src.element_size(),
            "median_s": seconds, "repeats": repeats, "num_threads": threads_used}
