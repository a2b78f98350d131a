"""What a quantized KV cache buys at a fixed KV memory: requests running at once and
offline engine-core throughput, int8 (or fp8) against the model-dtype cache.

The azure-conv replay (treadle.measure.workloads.azure_conv: the Azure conversation
trace's prompt and output lengths, token ids at random) is handed to `LLM.generate` all
at once, on the benchmark model (`demo`, bf16 weights), with the same `kv_cache_memory`
for every cache dtype. Each scheduler step's number of running requests is recorded (the
scheduler's own list, read after `schedule()`): its maximum, and its mean over the steps
where requests were still waiting (when memory, not the queue, bounds the batch). Runs of
the dtypes alternate, `--repeats` times, so background load hits them alike; throughput
is reported per run and as min/median/max ratios of interleaved pairs.

    python benchmarks/kv_capacity.py --num-requests 64 --token-scale 0.25 \
        --kv-cache-memory 64MiB --repeats 3 --output kv_capacity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from treadle import LLM, SamplingParams
from treadle.measure.workloads import azure_conv


def run_once(workload, kind: str, args) -> dict:
    llm = LLM(model=args.model, dtype="bfloat16", kv_cache_dtype=kind,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, distributed_executor_backend="uni")
    scheduler = llm.engine.scheduler
    running, waiting = [], []
    schedule = scheduler.schedule

    def recorded():
        out = schedule()
        running.append(len(scheduler.running))
        waiting.append(len(scheduler.waiting))
        return out

    llm.generate([{"prompt_token_ids": list(range(3, 67))}] * 2,
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    scheduler.schedule = recorded
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
              for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    bound = [r for r, w in zip(running, waiting) if w > 0]
    stats = llm.get_stats()
    return {"kv_cache_dtype": kind, "num_kv_blocks": llm.engine.num_kv_blocks,
            "kv_bytes_per_token": llm.engine.kv_bytes_per_token,
            "num_errors": sum(bool(o.error) for o in outputs),
            "max_running": max(running), "mean_running_while_waiting":
                statistics.fmean(bound) if bound else None,
            "num_steps": len(running), "num_preemptions": stats["num_preemptions"],
            "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (out_tokens + in_tokens) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--kinds", default="auto,int8", help="first: the baseline")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--token-scale", type=float, default=0.25)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="kv_capacity.json")
    args = ap.parse_args()
    workload = azure_conv(num_requests=args.num_requests, token_scale=args.token_scale,
                          max_model_len=args.max_model_len)
    kinds = args.kinds.split(",")
    runs = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            runs[kind].append(run_once(workload, kind, args))
            print(json.dumps(runs[kind][-1]), flush=True)
    base = kinds[0]
    summary = {}
    for kind in kinds[1:]:
        ratios = {f: sorted(b[f] / a[f] for a, b in zip(runs[base], runs[kind]))
                  for f in ("max_running", "total_tokens_per_s", "output_tokens_per_s")}
        summary[kind] = {f: {"min": v[0], "median": statistics.median(v), "max": v[-1]}
                         for f, v in ratios.items()}
        a, b = (runs[k][0]["mean_running_while_waiting"] for k in (base, kind))
        summary[kind]["mean_running_while_waiting"] = b / a if a and b else None
    result = {"workload": workload.description, "options": vars(args), "runs": runs,
              "ratios_vs_" + base: summary}
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    print("wrote", args.output)


if __name__ == "__main__":
    main()
