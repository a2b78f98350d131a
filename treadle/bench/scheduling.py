"""Out-of-order scheduling measured: an open-loop replay of timed arrivals into EngineCore.

Owns the replay driver (`replay`: requests join the engine at their arrival times on the
wall clock, the engine steps whenever it has work, TTFT and E2E are taken per request
from the arrival time) and the two measurements of the out-of-order scheduling issue,
over the `mixed-priority` workload (a saturating low-priority background plus a stream
of high-priority requests; treadle/measure/workloads.py, which the simulator shares):

- `run_mixed_priority`: high-priority TTFT under `priority` vs `fcfs` at saturation, with
  the background in the batch band, the same high-priority requests alone on an idle
  engine, and the total throughput of each;
- `run_azure_srpt`: a scaled azure-conv replay, mean and p99 E2E under `srpt` vs `fcfs`.

Run them with `python -m treadle.bench.scheduling mixed-priority|azure-conv`. Every figure
is measured in the run that reports it; nothing here is a target or a constant. Must not:
change the engine's behaviour, or time anything but the replay itself (model loading
and warm-up are outside the clock).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from treadle.measure.report import environment, format_table, percentiles, write_json
from treadle.measure.workloads import ReplayRequest, Workload, azure_conv, mixed_priority_workload


@dataclass
class RequestTiming:
    """What happened to one request of a replay (seconds; arrival since replay start)."""

    request_id: str
    label: str
    priority: int
    arrival: float
    ttft: float | None = None
    e2e: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass
class ReplayResult:
    timings: list[RequestTiming]
    wall_s: float
    """From the replay's start to the last request's end."""
    busy_s: float = 0.0
    """Time spent inside engine steps (the rest is waiting for arrivals)."""
    engine_stats: dict = field(default_factory=dict)


def replay(engine, requests: Sequence[ReplayRequest], id_prefix: str = "",
           batch_labels: Sequence[str] = ()) -> ReplayResult:
    """Feed `requests` to an EngineCore at their arrival times and step it until all end.

    Open loop: a request's arrival time is fixed by the workload, so time it spends
    waiting for the engine to finish a step counts in its TTFT, as it would for a client.
    The engine idles (sleeps) only when it has nothing to do. Requests whose label is in
    `batch_labels` run in the batch band.
    """
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    timings: dict[str, RequestTiming] = {}
    start = time.monotonic()
    next_index = 0
    last_end = start
    busy_s = 0.0
    stats_before = engine.stats()
    while next_index < len(order) or engine.has_unfinished_requests():
        now = time.monotonic()
        while next_index < len(order) and start + requests[order[next_index]].arrival_time <= now:
            i = order[next_index]
            spec = requests[i]
            request_id = f"{id_prefix}{i}"
            request = Request(request_id, spec.prompt_token_ids,
                              SamplingParams(max_tokens=spec.max_tokens, temperature=0.0,
                                             ignore_eos=True),
                              arrival_time=start + spec.arrival_time, priority=spec.priority,
                              tenant=spec.tenant,
                              band="batch" if spec.label in batch_labels else "interactive")
            timing = RequestTiming(request_id, spec.label, spec.priority, spec.arrival_time,
                                   num_prompt_tokens=len(spec.prompt_token_ids))
            timings[request_id] = timing
            rejected = engine.add_request(request)
            if rejected is not None:
                timing.error = rejected.error
            next_index += 1
        if not engine.has_unfinished_requests():
            if next_index < len(order):
                wake = start + requests[order[next_index]].arrival_time
                time.sleep(max(0.0, wake - time.monotonic()))
            continue
        t_step = time.monotonic()
        outputs = engine.step()
        t = time.monotonic()
        busy_s += t - t_step
        for out in outputs:
            timing = timings[out.request_id]
            if out.new_token_ids:
                timing.num_output_tokens += len(out.new_token_ids)
                if timing.ttft is None:
                    timing.ttft = t - (start + timing.arrival)
            if out.finished:
                timing.e2e = t - (start + timing.arrival)
                last_end = t
    stats = engine.stats()
    for key in ("num_steps", "num_preemptions", "num_admission_preemptions",
                "num_preemptions_swap", "num_head_bypasses", "time_prepare_s",
                "time_forward_s", "time_sample_s"):
        if key in stats and key in stats_before:
            stats[key] -= stats_before[key]
    return ReplayResult(list(timings.values()), last_end - start, busy_s, stats)


def from_workload(workload: Workload) -> list[ReplayRequest]:
    return [ReplayRequest(r.prompt_token_ids, r.max_tokens, r.arrival_time)
            for r in workload.requests]


def summarize(result: ReplayResult, labels: Sequence[str] | None = None) -> dict:
    """TTFT and E2E percentiles (overall and per label), throughput, engine counters."""
    done = [t for t in result.timings if t.e2e is not None and t.error is None]
    prompt = sum(t.num_prompt_tokens for t in done)
    output = sum(t.num_output_tokens for t in done)
    summary: dict[str, Any] = {
        "num_requests": len(result.timings),
        "num_errors": sum(t.error is not None for t in result.timings),
        "wall_s": result.wall_s,
        "total_tokens_per_s": (prompt + output) / result.wall_s if result.wall_s else 0.0,
        "output_tokens_per_s": output / result.wall_s if result.wall_s else 0.0,
        "busy_s": result.busy_s,
        "tokens_per_busy_s": (prompt + output) / result.busy_s if result.busy_s else 0.0,
        "ttft_s": percentiles(t.ttft for t in done),
        "e2e_s": percentiles(t.e2e for t in done),
        "engine": {k: result.engine_stats.get(k) for k in (
            "num_steps", "num_preemptions", "num_admission_preemptions",
            "num_preemptions_swap", "num_head_bypasses", "time_prepare_s", "time_forward_s",
            "time_sample_s")},
    }
    for label in labels or sorted({t.label for t in done if t.label}):
        chosen = [t for t in done if t.label == label]
        summary[label] = {"num_requests": len(chosen),
                          "ttft_s": percentiles(t.ttft for t in chosen),
                          "e2e_s": percentiles(t.e2e for t in chosen)}
    return summary


def _engine(**options: Any):
    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore

    engine = EngineCore(EngineConfig.from_options(**{"model": "demo", **options}))
    warmup = [ReplayRequest(list(range(3, 131)), 4, 0.0),
              ReplayRequest(list(range(3, 35)), 4, 0.0)]
    replay(engine, warmup, id_prefix="warmup-")
    return engine


def run_mixed_priority(workload: list[ReplayRequest],
                       policies: Sequence[str] = ("fcfs", "priority"),
                       **engine_options: Any) -> dict:
    """The mixed-priority workload under each policy, then its high-priority requests
    alone on an idle engine; high-priority TTFT and total throughput of each run."""
    runs = {}
    for policy in policies:
        engine = _engine(scheduling_policy=policy, **engine_options)
        runs[policy] = summarize(replay(engine, workload), ["high", "background"])
        del engine
    # The same background in the batch band (what work for idle capacity should be).
    engine = _engine(scheduling_policy="fcfs", **engine_options)
    runs["batch-band"] = summarize(replay(engine, workload, batch_labels=["background"]),
                                   ["high", "background"])
    del engine
    engine = _engine(scheduling_policy="fcfs", **engine_options)
    highs = [r for r in workload if r.label == "high"]
    runs["idle"] = summarize(replay(engine, highs), ["high"])
    result = {"runs": runs}
    result["high_p99_ttft_batch_band_over_idle"] = (runs["batch-band"]["high"]["ttft_s"]["p99"]
                                                   / runs["idle"]["high"]["ttft_s"]["p99"])
    if "fcfs" in runs and "priority" in runs:
        fcfs, prio, idle = runs["fcfs"]["high"], runs["priority"]["high"], runs["idle"]["high"]
        result["high_p99_ttft_fcfs_over_priority"] = fcfs["ttft_s"]["p99"] / prio["ttft_s"]["p99"]
        result["high_p99_ttft_priority_over_idle"] = prio["ttft_s"]["p99"] / idle["ttft_s"]["p99"]
        result["throughput_cost"] = 1.0 - (runs["priority"]["total_tokens_per_s"]
                                           / runs["fcfs"]["total_tokens_per_s"])
        result["steps_cost"] = (runs["priority"]["engine"]["num_steps"]
                                / runs["fcfs"]["engine"]["num_steps"] - 1.0)
    return result


def run_azure_srpt(workload: Workload, policies: Sequence[str] = ("fcfs", "srpt"),
                   **engine_options: Any) -> dict:
    """The azure-conv replay under each policy: mean / p99 E2E and TTFT."""
    requests = from_workload(workload)
    runs = {}
    for policy in policies:
        engine = _engine(scheduling_policy=policy, **engine_options)
        runs[policy] = summarize(replay(engine, requests))
        del engine
    result = {"runs": runs}
    if "fcfs" in runs and "srpt" in runs:
        for stat in ("mean", "p99"):
            result[f"e2e_{stat}_fcfs_over_srpt"] = (runs["fcfs"]["e2e_s"][stat]
                                                   / runs["srpt"]["e2e_s"][stat])
    return result


def _table(runs: dict, label: str | None) -> str:
    rows = []
    for name, run in runs.items():
        part = run.get(label, run) if label else run
        rows.append({"run": name, "requests": part["num_requests"],
                     "ttft mean": part["ttft_s"]["mean"], "ttft p99": part["ttft_s"]["p99"],
                     "e2e mean": part["e2e_s"]["mean"], "e2e p99": part["e2e_s"]["p99"],
                     "tok/s": run["total_tokens_per_s"],
                     "busy tok/s": run["tokens_per_busy_s"],
                     "steps": run["engine"]["num_steps"],
                     "preempt": run["engine"]["num_preemptions"]})
    return format_table(rows, ["run", "requests", "ttft mean", "ttft p99", "e2e mean",
                               "e2e p99", "tok/s", "busy tok/s", "steps", "preempt"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.scheduling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmark", choices=["mixed-priority", "azure-conv"])
    parser.add_argument("--duration", type=float, default=40.0,
                        help="mixed-priority: seconds of arrivals")
    parser.add_argument("--background-rate", type=float, default=2.5,
                        help="mixed-priority: low-priority requests per second")
    parser.add_argument("--high-rate", type=float, default=0.75,
                        help="mixed-priority: high-priority requests per second")
    parser.add_argument("--num-requests", type=int, default=200, help="azure-conv: trace rows")
    parser.add_argument("--token-scale", type=float, default=0.15,
                        help="azure-conv: multiply the trace's token counts by this")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="azure-conv: divide the trace's arrival gaps by this")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--attention-backend", default="torch",
                        help="torch by default: steadier than the native kernel's threads on "
                             "a machine other programs share")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch threads (1 by default: no parallel-region stalls when "
                             "other programs take a core)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    engine_options = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len,
                          attention_backend=args.attention_backend,
                          num_threads=args.num_threads)
    if args.benchmark == "mixed-priority":
        workload = mixed_priority_workload(args.duration, args.background_rate, args.high_rate)
        result = run_mixed_priority(workload, **engine_options)
        description = {"workload": "mixed-priority", "duration_s": args.duration,
                       "background_rate": args.background_rate, "high_rate": args.high_rate,
                       "num_requests": len(workload)}
        print(_table(result["runs"], "high"))
        for key in ("high_p99_ttft_fcfs_over_priority", "high_p99_ttft_priority_over_idle",
                    "high_p99_ttft_batch_band_over_idle", "throughput_cost", "steps_cost"):
            print(f"{key}: {result[key]:.3f}")
    else:
        workload = azure_conv(num_requests=args.num_requests, token_scale=args.token_scale,
                              time_scale=args.time_scale, max_model_len=args.max_model_len)
        result = run_azure_srpt(workload, **engine_options)
        description = workload.description
        print(_table(result["runs"], None))
        for key in ("e2e_mean_fcfs_over_srpt", "e2e_p99_fcfs_over_srpt"):
            print(f"{key}: {result[key]:.3f}")
    result.update({"benchmark": args.benchmark, "workload": description,
                   "engine_options": engine_options, "environment": environment()})
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps({k: result[k] for k in ("benchmark", "workload", "engine_options")},
                         indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
