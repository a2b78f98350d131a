"""Replicas and P/D measured over HTTP (`python -m treadle.bench.replicas
prefix|multiturn|pd`).

`prefix`: the shared-prefix workload (treadle/measure/workloads.py) through 2 replicas of 1
thread each under `prefix` routing (on the prompts sent, and on the replicas' KV events:
`--kv-events-endpoint`) and `round-robin` routing, and through 1 engine of 2 threads,
the same total KV blocks each, servers started in turn and repeated alternately: the
prefix-cache hit rate (hit tokens / queried tokens, summed over the replicas' /metrics)
and TTFT p50/p99. `multiturn`: the same systems on a multi-turn replay (conversations
re-sending their history turn by turn, 4 turns each, an odd number of conversations
near `--num-requests` / 4). `pd`: a long-prompt-interference workload (short chats decoding while
long prompts arrive) through 2 colocated replicas and through 1 prefill + 1 decode
replica: TPOT p50/p99 of the short requests, and the KV transfer seconds per request
(the decode replica's treadle:pd_kv_transfer_seconds). The load generator and the
summary are treadle bench serve's (treadle/measure/http_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import httpx
import numpy as np

from treadle.measure import workloads
from treadle.measure.launch import launched_server
from treadle.measure.report import percentiles
from treadle.measure.http_load import run_load, summarize


def metric_sum(text: str, name: str) -> float:
    """A metric summed over every label set (every replica)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key = line.split(" ")[0].split("{")[0]
        if key == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


def interference(num_short: int, num_long: int, long_len: int, short_out: int,
                 vocab_size: int = 49152, seed: int = 0) -> workloads.Workload:
    """Short chats (64-token prompts, `short_out` tokens) and a few long prompts (16
    output tokens), the long ones spread over the run."""
    rng = np.random.default_rng(seed)
    reqs = [workloads.WorkloadRequest(rng.integers(0, vocab_size, 64).tolist(), short_out)
            for _ in range(num_short)]
    step = max(1, num_short // max(1, num_long))
    for k in range(num_long):
        reqs.insert(min(len(reqs), (k + 1) * step + k),
                    workloads.WorkloadRequest(rng.integers(0, vocab_size, long_len).tolist(), 16))
    return workloads.Workload("long-prompt-interference", reqs, {
        "num_short": num_short, "num_long": num_long, "long_len": long_len,
        "short_out": short_out})


def run_one(serve_args: list[str], workload: workloads.Workload, rate: float,
            seed: int) -> dict:
    with launched_server(serve_args, startup_timeout=600) as (url, _):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # warm-up: one request, so kernel builds and first-step costs stay out
        asyncio.run(run_load(url, workloads.Workload("warm", [workloads.WorkloadRequest(
            [1, 2, 3, 4], 4)]), model, progress=False))
        before = httpx.get(url + "/metrics").text
        results, duration = asyncio.run(run_load(url, workload, model, rate=rate, seed=seed,
                                                 progress=False))
        after = httpx.get(url + "/metrics").text
    summary = summarize(results, duration)

    def delta(name):
        return metric_sum(after, name) - metric_sum(before, name)

    queried = delta("treadle:prefix_cache_queries_total")
    summary["prefix_hit_rate"] = delta("treadle:prefix_cache_hits_total") / queried \
        if queried else None
    n = delta("treadle:pd_kv_transfer_seconds_count")
    if n:
        summary["kv_transfer"] = {
            "requests": n, "mean_ms": 1000 * delta("treadle:pd_kv_transfer_seconds_sum") / n,
            "mean_bytes": delta("treadle:pd_kv_transfer_bytes_total") / n,
            "blocks_sent": delta("treadle:pd_kv_blocks_sent_total"),
            "blocks_skipped": delta("treadle:pd_kv_blocks_skipped_total")}
    summary["results"] = results
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.replicas")
    parser.add_argument("experiment", choices=["prefix", "multiturn", "pd"])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--kv-blocks", type=int, default=160,
                        help="KV blocks per replica (the single engine gets twice as many)")
    parser.add_argument("--systems", default=None,
                        help="comma-separated names of the systems to run (default: all)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    events = f"ipc://{tempfile.mkdtemp(prefix='treadle-bench-kv-')}/events"
    common = ["--model", args.model, "--num-kv-blocks", str(args.kv_blocks)]
    double = ["--model", args.model, "--num-kv-blocks", str(2 * args.kv_blocks)]
    if args.experiment in ("prefix", "multiturn"):
        if args.experiment == "prefix":
            workload = workloads.shared_prefix(num_requests=args.num_requests, num_prefixes=8,
                                               prefix_len=512, suffix_len=(16, 48),
                                               output_len=16)
        else:
            # An odd number of conversations: round-robin over 2 replicas would otherwise
            # keep each conversation on one replica by accident (its turns are an even
            # number of requests apart).
            workload = workloads.multi_turn(num_conversations=max(1, args.num_requests // 4) | 1,
                                            turns=4, system_len=256, reply_len=16)
        systems = {
            "prefix": common + ["--replicas", "2", "--num-threads", "1", "--routing", "prefix"],
            "prefix (KV events)": common + ["--replicas", "2", "--num-threads", "1",
                                            "--routing", "prefix",
                                            "--kv-events-endpoint", events],
            "round-robin": common + ["--replicas", "2", "--num-threads", "1",
                                     "--routing", "round-robin"],
            "1 engine x 2 threads": double + ["--num-threads", "2"],
        }
    else:
        workload = interference(args.num_requests, max(2, args.num_requests // 8), 1536, 96)
        systems = {
            "1P + 1D": common + ["--prefill-replicas", "1", "--decode-replicas", "1",
                                 "--num-threads", "1"],
            "2 colocated (least-load)": common + ["--replicas", "2", "--num-threads", "1",
                                                  "--routing", "least-load"],
            "1 engine x 2 threads": double + ["--num-threads", "2"],
        }
    if args.systems:
        wanted = [name.strip() for name in args.systems.split(",")]
        unknown = [name for name in wanted if name not in systems]
        if unknown:
            parser.error(f"--systems: unknown {unknown}; one of {list(systems)}")
        systems = {name: systems[name] for name in wanted}
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name, serve_args in systems.items():
            t0 = time.perf_counter()
            summary = run_one(serve_args, workload, args.rate, seed=repeat)
            results = summary.pop("results")
            if args.experiment == "pd":  # the short requests' decode rate
                short = [r for r in results if r.prompt_tokens <= 64]
                summary["short_tpot_ms"] = percentiles(
                    r.tpot * 1000 for r in short if r.ok and r.tpot is not None)
            runs[name].append(summary)
            print(f"[{repeat}] {name}: {time.perf_counter() - t0:.0f} s, "
                  f"failed {summary['num_failed']}, hit rate {summary['prefix_hit_rate']}, "
                  f"TTFT p50/p99 {summary['ttft_ms']['median']:.0f}/"
                  f"{summary['ttft_ms']['p99']:.0f} ms, TPOT p99 "
                  f"{summary['tpot_ms']['p99']:.1f} ms"
                  + (f", short TPOT p99 {summary['short_tpot_ms']['p99']:.1f} ms"
                     if "short_tpot_ms" in summary else "")
                  + (f", transfer {summary['kv_transfer']['mean_ms']:.1f} ms"
                     if "kv_transfer" in summary else ""), file=sys.stderr, flush=True)
    out = {"experiment": args.experiment, "workload": workload.description,
           "rate": args.rate, "kv_blocks_per_replica": args.kv_blocks, "runs": runs}
    text = json.dumps(out, indent=1, default=str)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
