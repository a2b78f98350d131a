"""Measurements of KV memory under pressure: fragmentation, prefix caching, preemption modes.

Owns three measurements behind the KV-memory issue:
- `fragmentation`: the scheduler's own allocation over a workload's lengths, stepped by a
  runner that samples a fixed token (no model): allocated but unused slots over
  allocated slots, summed over steps.
- `prefix_cache_effect`: throughput and mean TTFT with the prefix cache on vs off.
- `preemption_modes`: throughput of recompute, swap and auto under a small KV cache.
Each reports what it measured; none holds a target.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from treadle.measure.workloads import Workload


def fragmentation(workload: Workload, block_size: int = 16, num_kv_blocks: int = 200_000,
                  max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> dict:
    """KV internal fragmentation of the scheduler's allocations over the workload."""
    from treadle.config import CacheConfig, SchedulerConfig
    from treadle.core.outputs import ModelRunnerOutput
    from treadle.core.scheduler import Scheduler
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=block_size, enable_prefix_caching=False),
        num_kv_blocks=num_kv_blocks, max_model_len=10**9)
    for i, r in enumerate(workload.requests):
        scheduler.add_request(Request(str(i), r.prompt_token_ids,
                                      SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                      arrival_time=float(i)))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, ModelRunnerOutput(
            {s.request_id: [3] for s in out.scheduled if s.sample}))
    s = scheduler.stats
    return {"block_size": block_size, "num_requests": len(workload.requests),
            "num_steps": s.num_steps, "allocated_slot_steps": s.allocated_slots,
            "used_slot_steps": s.used_slots,
            "kv_fragmentation": 1.0 - s.used_slots / s.allocated_slots}


def _timed_run(workload: Workload, **engine_options: Any) -> dict:
    from treadle import LLM, SamplingParams

    llm = LLM(**engine_options)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                 SamplingParams(max_tokens=2, ignore_eos=True, temperature=0), use_tqdm=False)
    before = llm.get_stats()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests],
                           [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                           temperature=0) for r in workload.requests],
                           use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    ttfts = [o.metrics.ttft for o in outputs if o.metrics is not None]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    delta = {k: after[k] - before[k] for k in (
        "num_preemptions", "num_preemptions_recompute", "num_preemptions_swap",
        "swap_bytes_out", "swap_bytes_in", "prefix_cache_queried_tokens",
        "prefix_cache_hit_tokens", "num_steps")}
    return {"options": {k: str(v) for k, v in engine_options.items()}, "wall_s": wall,
            "num_errors": sum(1 for o in outputs if o.error),
            "output_tokens_per_s": output_tokens / wall,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / wall,
            "mean_ttft_s": statistics.fmean(ttfts), "median_ttft_s": statistics.median(ttfts),
            "output_token_ids": [o.outputs[0].token_ids for o in outputs], **delta}


def prefix_cache_effect(workload: Workload, **engine_options: Any) -> dict:
    """The same workload with the prefix cache on and off, outputs compared."""
    on = _timed_run(workload, enable_prefix_caching=True, **engine_options)
    off = _timed_run(workload, enable_prefix_caching=False, **engine_options)
    same = on.pop("output_token_ids") == off.pop("output_token_ids")
    return {"on": on, "off": off, "identical_outputs": same,
            "mean_ttft_ratio_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
            "throughput_ratio_on_over_off": on["output_tokens_per_s"] / off["output_tokens_per_s"]}


def preemption_modes(workload: Workload, num_kv_blocks: int, **engine_options: Any) -> dict:
    """Throughput under a small KV cache for each preemption mode, plus an unpressured run."""
    runs = {mode: _timed_run(workload, num_kv_blocks=num_kv_blocks, preemption_mode=mode,
                             **engine_options)
            for mode in ("recompute", "swap", "auto")}
    reference = _timed_run(workload, **engine_options)
    expected = reference.pop("output_token_ids")
    for run in runs.values():
        run["identical_to_unpressured"] = run.pop("output_token_ids") == expected
    return {"num_kv_blocks": num_kv_blocks, "modes": runs, "unpressured": reference}
