"""Offline throughput of treadle: `LLM.generate` over a workload, with the engine's stats.

Owns `run_throughput` (one timed run after a short warm-up) and `run_engine_core`, the
side-by-side measurement of the engine-core issue: treadle against transformers' static
batching on the same workload in the same run, each with model FLOPs utilization against
the peak matmul rate measured in that run. It reports what it measured; nothing here is
a target or a constant result.
"""

from __future__ import annotations

import time
from typing import Any

from treadle.measure.peak import measure_peak_matmul, mfu
from treadle.measure.workloads import Workload


def run_throughput(workload: Workload, progress: bool = True, warmup: bool = True,
                   **engine_options: Any) -> dict:
    """Generate every request of the workload at once (ignore EOS); return the figures."""
    from treadle import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_options)
    load_s = time.perf_counter() - t0
    if warmup:
        llm.generate([{"prompt_token_ids": list(range(3, 67))}] * 2,
                     SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                     use_tqdm=False)
    stats_before = llm.get_stats()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
              for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    wall_s = time.perf_counter() - start
    stats = _stats_delta(stats_before, llm.get_stats())

    errors = [o.error for o in outputs if o.error]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "system": "treadle",
        "engine_options": {k: str(v) for k, v in engine_options.items()},
        "dtype": llm.engine.info.dtype,
        "num_params": llm.engine.info.num_parameters,
        "num_requests": len(outputs),
        "num_errors": len(errors),
        "errors": errors[:5],
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": workload.total_output_tokens,
        "load_s": load_s,
        "wall_s": wall_s,
        "requests_per_s": len(outputs) / wall_s,
        "output_tokens_per_s": output_tokens / wall_s,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / wall_s,
        "engine": stats,
    }


_GAUGES = ("num_kv_blocks", "num_swapped")
"""num_* figures of the engine's stats that are states, not running totals."""


def _is_counter(key: str) -> bool:
    return (key.startswith(("num_", "time_", "swap_bytes_", "prefix_cache_", "spec_num_"))
            and key not in _GAUGES)


def _stats_delta(before: dict, after: dict) -> dict:
    """Counters of the timed run only (the warm-up's are subtracted)."""
    delta = dict(after)
    steps = after["num_steps"] - before["num_steps"]
    for key, value in after.items():
        if _is_counter(key) and isinstance(value, (int, float)) and key in before:
            delta[key] = value - before[key]
    # Means over the timed run: recover sums from the cumulative means.
    for key in ("mean_batch_size", "batch_slot_efficiency", "mean_tokens_per_step"):
        total = after[key] * after["num_steps"] - before[key] * before["num_steps"]
        delta[key] = total / steps if steps else 0.0
    return delta


def add_mfu(result: dict, peak: dict) -> None:
    """Model FLOPs utilization of a result against a measured peak (same dtype)."""
    tokens_per_s = result["total_tokens_per_s"]
    result["peak_gflops"] = peak["gflops"]
    result["mfu"] = mfu(tokens_per_s, result["num_params"], peak["gflops"])


def run_engine_core(model_path: str, workload: Workload, dtype: str = "bfloat16",
                    static_batch_size: int = 16, progress: bool = True,
                    **engine_options: Any) -> dict:
    """treadle vs static batching on one workload in one run, with MFU for each."""
    from treadle.bench.static import run_static

    peak_before = measure_peak_matmul(dtype)
    treadle_result = run_throughput(workload, progress=progress, model=model_path, dtype=dtype,
                                    **engine_options)
    static_result = run_static(model_path, workload, batch_size=static_batch_size, dtype=dtype,
                               progress=progress)
    peak_after = measure_peak_matmul(dtype)
    # The machine is shared: take the better of the two peak readings as the ceiling.
    peak = max(peak_before, peak_after, key=lambda p: p["gflops"])
    add_mfu(treadle_result, peak)
    static_result["total_tokens_per_s_useful"] = (
        (static_result["useful_output_tokens"] + static_result["prompt_tokens"])
        / static_result["wall_s"])
    static_result["mfu"] = mfu(static_result["total_tokens_per_s_useful"],
                               static_result["num_params"], peak["gflops"])
    return {
        "workload": workload.description | {"name": workload.name},
        "peak_matmul": {"before": peak_before, "after": peak_after, "used_gflops": peak["gflops"]},
        "treadle": treadle_result,
        "static": static_result,
        "speedup_output_tokens_per_s": (treadle_result["output_tokens_per_s"]
                                        / static_result["output_tokens_per_s"]),
    }
