"""`overlap_steps` against the serial loop, offline, each in a process of its own.

`python benchmarks/overlap_steps.py [--model M] [--requests 1,4,16] [--prompt-len 128]
[--output-len 128] [--repeats 4] [--output FILE.json] [engine options as key=value]`

For each number of requests, N requests of the same lengths decode together through
`LLM.generate` (greedy, after a warm-up call), once with the serial loop and once with
`overlap_steps`, each in a fresh process (two engines in one process share the cores
with each other's OpenMP teams, which is what a step-overhead figure cannot have), the
order alternating between repeats. Per run: the decode step time (the mean gap between a
request's tokens after its first, the median over requests) and the run's output tok/s.
Printed: per configuration the median over repeats and the paired ratio. Measures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from step_overhead import engine_options, workload_parser

CONFIGS = {"serial": False, "overlap": True}


def one_run(model: str | None, requests: int, prompt_len: int, output_len: int,
            options: dict, seed: int) -> dict:
    """In this process: one engine, a warm-up, then the measured call."""
    import random
    import time

    from treadle import LLM, SamplingParams

    llm = LLM(model=model, **options)
    vocab = llm.limits.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": [11] * 64}] * 2,
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    batch = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]}
             for _ in range(requests)]
    t0 = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    gaps = [(o.metrics.finished_time - o.metrics.first_token_time)
            / max(1, len(o.outputs[0].token_ids) - 1) for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.engine.shutdown()
    return {"step_ms": 1e3 * statistics.median(gaps), "output_tok_s": tokens / wall,
            "wall_s": wall}


def main() -> None:
    parser = workload_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--output", default=None, help="JSON file for the runs")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args()
    options = engine_options(args.options)
    if args.one is not None:
        requests, overlap, seed = json.loads(args.one)
        print(json.dumps(one_run(args.model, requests, args.prompt_len, args.output_len,
                                 {**options, "overlap_steps": overlap}, seed)))
        return
    runs = []
    for n in [int(x) for x in args.requests.split(",")]:
        for repeat in range(args.repeats):
            names = list(CONFIGS) if repeat % 2 == 0 else list(CONFIGS)[::-1]
            for name in names:
                child = [sys.executable, __file__, "--one",
                         json.dumps([n, CONFIGS[name], repeat]),
                         "--prompt-len", str(args.prompt_len),
                         "--output-len", str(args.output_len), *args.options]
                if args.model:
                    child += ["--model", args.model]
                done = subprocess.run(child, capture_output=True, text=True, check=True)
                run = {"requests": n, "config": name, "repeat": repeat,
                       **json.loads(done.stdout.strip().splitlines()[-1])}
                runs.append(run)
                print(f"{n:>3} requests, {name:>7}, repeat {repeat}: "
                      f"{run['step_ms']:7.2f} ms a decode step, "
                      f"{run['output_tok_s']:7.1f} output tok/s", flush=True)
    print("\nrequests  serial ms/step  overlap ms/step  overlap / serial (paired median)")
    for n in sorted({r["requests"] for r in runs}):
        of = {c: [r for r in runs if r["requests"] == n and r["config"] == c] for c in CONFIGS}
        ratios = [o["step_ms"] / s["step_ms"] for s, o in zip(of["serial"], of["overlap"])]
        print(f"{n:>8}  {statistics.median(r['step_ms'] for r in of['serial']):14.2f}  "
              f"{statistics.median(r['step_ms'] for r in of['overlap']):15.2f}  "
              f"{statistics.median(ratios):.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
