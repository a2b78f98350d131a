"""Served smoke matrix: each model file with each engine setup below serves 4, then 16
streams of 512-token prompts (64 tokens each, sent at once, streamed, through the load
generator of `treadle bench latency`), and every request must be answered.

`python benchmarks/served_smoke.py --models FILE.gguf[,FILE.gguf...] [--setups NAME,...]`

Why: a served Gemma 3 died at 16 streams (a short prompt arriving beside other requests'
decodes, under a sliding window: worker/cpu/gemma_stack.py read the wrong tables) while
every offline run and one-stream figure was fine: requests that arrive apart build steps
that requests submitted together never do. This runs that shape of load on the setups
most likely to meet it (speculation's multi-token rows, an int8 cache, overlapped steps,
a policy that reorders, heavy-hitter eviction). Prints one line per point and exits 1 if
any request failed. About 30 s per setup for SmolLM2-135M on 2 cores (the engine starts
each time).
Measured 2026-12-07 on the real SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M files:
every request answered (docs/benchmarks.md, "The same Xeon, a third session").
"""

from __future__ import annotations

import argparse
import sys

from treadle.bench.latency import served_point
from treadle.measure.http_load import served_model
from treadle.measure.launch import launched_server

SETUPS = {
    "default": [],
    "ngram": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
    "int8-kv": ["--kv-cache-dtype", "int8"],
    "overlap": ["--overlap-steps"],
    "priority": ["--scheduling-policy", "priority"],
    "h2o": ["--kv-eviction", "h2o", "--kv-budget-tokens", "256"],
}
STREAMS = (4, 16)


def run(model: str, setup: str) -> list[str]:
    """One server of `model` with SETUPS[setup]: a line per point ('failed' on failure)."""
    args = ["--model", model, "--max-num-seqs", str(max(STREAMS)), "--max-queue-delay", "0",
            *SETUPS[setup]]
    lines = []
    with launched_server(args, startup_timeout=900) as (base, _):
        vocab = served_model(base).get("vocab_size") or 49152
        for streams in STREAMS:
            try:
                figures = served_point(base, streams, 512, 64, vocab, seed=100 + streams)
                lines.append(f"{model} {setup} {streams} streams: "
                             f"{figures['output_tok_s']:.1f} output tok/s")
            except RuntimeError as exc:
                lines.append(f"{model} {setup} {streams} streams: failed: {exc}")
                break  # a server that failed its requests is not measured further
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True,
                        help="GGUF files (or model ids), comma-separated")
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"comma-separated, of {', '.join(SETUPS)}")
    args = parser.parse_args()
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"--setups: unknown {unknown}; known: {', '.join(SETUPS)}")
    failed = 0
    for model in args.models.split(","):
        for setup in setups:
            for line in run(model, setup):
                print(line, flush=True)
                failed += "failed:" in line
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
