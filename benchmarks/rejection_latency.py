"""How fast a refused request is refused: the tenant bound (429) met by a long text
prompt and by a structured-output request, on a server whose one tenant has its one
request in flight. Before issue 50 the bounds were checked after tokenization and
grammar compilation; now before either (server/admission.py).

    python benchmarks/rejection_latency.py [--code DIR] [--repeats 10]

`--code DIR` runs the server from another checkout (PYTHONPATH=DIR), e.g. the commit
before the change: `git archive 685b37d | tar -x -C /tmp/base`. The demo model (SmolLM2-135M's shape,
random weights, bf16) has the benchmark tokenizer (49152-id BPE); the prompt is 200,000
characters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import httpx


def _hold(base: str, started: threading.Event, stop: threading.Event) -> None:
    with httpx.stream("POST", base + "/v1/completions", timeout=600, json={
            "prompt": "hold", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
            if stop.is_set():
                return


def measure(base: str, repeats: int) -> dict:
    bodies = {
        "long prompt (completions)": ("/v1/completions", {
            "prompt": "the quick brown fox jumps over the lazy dog " * 4500,
            "max_tokens": 4}),
        "json_schema (chat)": ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a person"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
                "type": "object", "properties": {"name": {"type": "string"},
                                                 "age": {"type": "integer"}},
                "required": ["name", "age"]}}}}),
    }
    out = {}
    for name, (path, body) in bodies.items():
        times, codes = [], set()
        for _ in range(repeats):
            start = time.perf_counter()
            r = httpx.post(base + path, json=body, timeout=120)
            times.append(time.perf_counter() - start)
            codes.add(r.status_code)
        out[name] = {"codes": sorted(codes), "median_ms": 1000 * statistics.median(times),
                     "max_ms": 1000 * max(times)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", default=None, help="checkout to run the server from")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.code:
        os.environ["PYTHONPATH"] = str(Path(args.code).resolve())
    from treadle.measure.launch import launched_server

    with launched_server(["--model", "demo", "--dtype", "bfloat16",
                          "--tenant-max-concurrent-requests", "1"]) as (base, _):
        started, stop = threading.Event(), threading.Event()
        holder = threading.Thread(target=_hold, args=(base, started, stop), daemon=True)
        holder.start()
        started.wait(120)
        try:
            for name, figures in measure(base, args.repeats).items():
                print(f"{name}: HTTP {figures['codes']}, median {figures['median_ms']:.1f} ms, "
                      f"max {figures['max_ms']:.1f} ms")
        finally:
            stop.set()


if __name__ == "__main__":
    main()
