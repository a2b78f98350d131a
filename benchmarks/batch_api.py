"""The Batch API's two figures (docs/batch.md, "Measured"), each system side by side in
the same run, alternating, repeated:

    python benchmarks/batch_api.py throughput [--num-requests 256] [--repeats 2]
    python benchmarks/batch_api.py interference [--batch-lines 2000] [--repeats 2]

`throughput`: the same lines (the `treadle bench throughput` synthetic workload, written
as a batch file of /v1/completions lines with the prompt token ids, max_tokens and
ignore_eos) through `treadle bench throughput` (LLM.generate), `treadle run-batch`
(offline, the serving object) and a batch on `treadle serve` (created -> completed), each
in its own process, with the same engine options (the offline step budget of 1024 for
all three). Output tokens per second per system, and each one's ratio to bench
throughput in the same repeat.

`interference`: one server; an interactive stream of streamed completions at a Poisson
rate, alone, then the same stream (same seed) while a batch of `--batch-lines` lines
runs beside it; median and p99 TTFT of each and their ratio per repeat, and how many batch
lines completed meanwhile. The batch is cancelled after the stream unless
`--wait-batch`, which times it to the end.

Every process is started and stopped by PID; the engine options after `--` go to each.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from treadle.measure import workloads
from treadle.measure.http_load import run_load, summarize
from treadle.measure.launch import launched_server


def model_dir(name: str) -> str:
    from treadle.models.resolve import resolve_model
    from treadle.worker.device import auto_dtype
    return str(resolve_model(name, None, None, "auto", auto=auto_dtype))


def batch_file(workload, path: Path, model: str) -> Path:
    with open(path, "w") as out:
        for i, r in enumerate(workload.requests):
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                  "url": "/v1/completions", "body": {
                                      "model": model, "prompt": r.prompt_token_ids,
                                      "max_tokens": r.max_tokens, "ignore_eos": True,
                                      "temperature": 0}}) + "\n")
    return path


def run_batch_online(base: str, lines: bytes, poll_s: float = 0.1,
                     far_poll_s: float = 1.0) -> dict:
    """Upload, create, wait for the end; seconds from create to completed, tokens.

    Polled as a client would, every `far_poll_s`, and every `poll_s` once 90% of the
    lines are done; the end is taken halfway between the last poll that did not see it
    and the one that did. Twenty polls a second for the whole run measured the polls as
    well (each one is event-loop work beside the engine's thread)."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    upload = client.files.create(file=("in.jsonl", io.BytesIO(lines)), purpose="batch")
    start = before = time.perf_counter()
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        counts = batch.request_counts
        near_end = (counts is not None and counts.total
                    and counts.completed + counts.failed >= 0.9 * counts.total)
        before = time.perf_counter()
        time.sleep(poll_s if near_end else far_poll_s)
        batch = client.batches.retrieve(batch.id)
    seconds = (before + time.perf_counter()) / 2 - start
    answers = [json.loads(x) for x in client.files.content(batch.output_file_id).text.split(
        "\n") if x] if batch.output_file_id else []
    tokens = sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)
    return {"status": batch.status, "seconds": seconds, "output_tokens": tokens,
            "failed": batch.request_counts.failed}


def _bench_throughput(tmp: Path, lines_path: Path, options: list[str], model: str) -> float:
    subprocess.run([sys.executable, "-m", "treadle.cli", "--log-level", "WARNING", "bench",
                    "throughput", "--workload-file", str(tmp / "workload.json"), "--output",
                    str(tmp / "throughput.json"), *options], capture_output=True, text=True,
                   check=True)
    return json.loads((tmp / "throughput.json").read_text())["output_tokens_per_s"]


def _run_batch(tmp: Path, lines_path: Path, options: list[str], model: str) -> float:
    out = subprocess.run([sys.executable, "-m", "treadle.cli", "--log-level", "WARNING",
                          "run-batch", "-i", str(lines_path), "-o", str(tmp / "out.jsonl"),
                          "--no-progress", *options], capture_output=True, text=True,
                         check=True)
    return float(re.search(r"([\d.]+) output tokens/s", out.stderr).group(1))


def _online_batch(tmp: Path, lines_path: Path, options: list[str], model: str) -> float:
    warm = workloads.synthetic(num_requests=2, seed=99, num_long=0, output_len=(4, 4),
                               prompt_len=(64, 64), vocab_size=workloads.model_vocab_size(model))
    with launched_server(options) as (base, _):
        run_batch_online(base, batch_file(warm, tmp / "warm.jsonl", Path(model).name)
                         .read_bytes())
        done = run_batch_online(base, lines_path.read_bytes())
    assert done["status"] == "completed" and not done["failed"], done
    return done["output_tokens"] / done["seconds"]


SYSTEMS = {"bench_throughput": _bench_throughput, "run_batch": _run_batch,
           "online_batch": _online_batch}


def throughput(args, engine: list[str]) -> dict:
    model = model_dir(args.model)
    work = workloads.synthetic(num_requests=args.num_requests, seed=args.seed,
                               vocab_size=workloads.model_vocab_size(model),
                               max_model_len=workloads.model_context_len(model),
                               output_len=tuple(args.output_len),
                               num_long=min(args.num_long, args.num_requests))
    tmp = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    workloads.save_workload(work, tmp / "workload.json")
    lines_path = batch_file(work, tmp / "batch.jsonl", Path(model).name)
    options = ["--model", model, "--max-num-batched-tokens", "1024", *engine]
    names = list(SYSTEMS)
    rows = []
    for repeat in range(args.repeats):
        row = {}
        for name in names[repeat % 3:] + names[:repeat % 3]:  # the order rotates
            row[name] = SYSTEMS[name](tmp, lines_path, options, model)
            print(f"repeat {repeat}: {name} {row[name]:.1f} out tok/s", flush=True)
        rows.append(row)
    ratios = {k: statistics.median(r[k] / r["bench_throughput"] for r in rows)
              for k in ("run_batch", "online_batch")}
    return {"rows": rows, "median_ratio_to_bench_throughput": ratios,
            "num_requests": args.num_requests, "engine": options}


async def _stream(base: str, model: str, work, rate: float, seed: int):
    results, duration = await run_load(base, work, model, rate=rate, seed=seed, progress=False)
    return summarize(results, duration)


def interference(args, engine: list[str]) -> dict:
    import openai

    model = model_dir(args.model)
    vocab = workloads.model_vocab_size(model)
    stream = workloads.synthetic(num_requests=args.stream_requests, seed=args.seed,
                                 prompt_len=(32, 256), output_len=(16, 64), num_long=0,
                                 vocab_size=vocab)
    lines = workloads.synthetic(num_requests=args.batch_lines, seed=args.seed + 1,
                                prompt_len=(32, 256), output_len=(64, 256), num_long=0,
                                vocab_size=vocab)
    tmp = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    name = Path(model).name
    raw = batch_file(lines, tmp / "batch.jsonl", name).read_bytes()
    rows = []
    with launched_server(["--model", model, *engine]) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        asyncio.run(_stream(base, name, stream, float("inf"), args.seed))  # warm-up
        for repeat in range(args.repeats):
            alone = asyncio.run(_stream(base, name, stream, args.rate, args.seed))
            upload = client.files.create(file=("b.jsonl", io.BytesIO(raw)), purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                          completion_window="24h")
            while client.batches.retrieve(batch.id).status == "validating":
                time.sleep(0.05)
            time.sleep(args.settle_s)  # the batch fills the engine first
            before = client.batches.retrieve(batch.id).request_counts.completed
            beside = asyncio.run(_stream(base, name, stream, args.rate, args.seed))
            during = client.batches.retrieve(batch.id).request_counts.completed - before
            row = {"alone_ttft_ms": alone["ttft_ms"], "beside_ttft_ms": beside["ttft_ms"],
                   "p99_ratio": beside["ttft_ms"]["p99"] / alone["ttft_ms"]["p99"],
                   "median_ratio": beside["ttft_ms"]["median"] / alone["ttft_ms"]["median"],
                   "batch_lines_done_during_stream": during,
                   "stream_s": beside["duration_s"]}
            if args.wait_batch:
                start = time.perf_counter()
                while client.batches.retrieve(batch.id).status != "completed":
                    time.sleep(0.5)
                row["batch_rest_s"] = time.perf_counter() - start
            else:
                client.batches.cancel(batch.id)
                while client.batches.retrieve(batch.id).status != "cancelled":
                    time.sleep(0.1)
            print(f"repeat {repeat}: p99 TTFT alone {alone['ttft_ms']['p99']:.0f} ms, beside "
                  f"{beside['ttft_ms']['p99']:.0f} ms ({row['p99_ratio']:.2f}x); batch lines "
                  f"done meanwhile {during}", flush=True)
            rows.append(row)
    return {"rows": rows, "median_p99_ratio": statistics.median(r["p99_ratio"] for r in rows),
            "batch_lines": args.batch_lines, "stream_requests": args.stream_requests,
            "rate": args.rate, "engine": engine}


def main() -> int:
    argv = sys.argv[1:]
    engine = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["throughput", "interference"])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=256, help="throughput: lines")
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 256],
                        help="throughput: output tokens per line, uniform in [lo, hi]")
    parser.add_argument("--num-long", type=int, default=4,
                        help="throughput: lines with 1024 output tokens (bench throughput's "
                             "synthetic workload has 4)")
    parser.add_argument("--batch-lines", type=int, default=2000, help="interference")
    parser.add_argument("--stream-requests", type=int, default=200, help="interference")
    parser.add_argument("--rate", type=float, default=2.0,
                        help="interference: the stream's requests per second")
    parser.add_argument("--settle-s", type=float, default=2.0,
                        help="interference: seconds the batch runs before the stream")
    parser.add_argument("--wait-batch", action="store_true",
                        help="interference: let each batch finish, timed")
    parser.add_argument("--output", default=None, help="where to write the JSON result")
    args = parser.parse_args(argv)
    result = (throughput if args.what == "throughput" else interference)(args, engine)
    print(json.dumps(result, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
