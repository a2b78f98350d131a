"""Throughput of the engine-core workload with a share of JSON-schema-constrained requests
mixed in, against none (issue 21's measurement), offline, alternating repeats.

    python benchmarks/structured_mix.py --model DEMO_OR_SMOLLM2_DIR --share 0.1 --repeats 2

Every request keeps its forced length (ignore_eos); a constrained request follows a
schema whose one string field takes any length, so the grammar does not end it early
(a request the grammar ends anyway is counted with the tokens it made). Prints, per
repeat and as medians, output tokens/s of both runs and their ratio; --output writes the
JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from treadle import LLM, SamplingParams
from treadle.measure.workloads import synthetic
from treadle.structured import from_structured_outputs

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def run(llm: LLM, workload, share: float) -> dict:
    spec = from_structured_outputs({"json": SCHEMA}) if share else None
    every = round(1 / share) if share else 0
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0,
                             structured_outputs=spec if every and i % every == 0 else None)
              for i, r in enumerate(workload.requests)]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    constrained = sum(1 for p in params if p.structured_outputs is not None)
    return {"share": share, "constrained_requests": constrained, "output_tokens": tokens,
            "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "errors": sum(1 for o in outputs if o.error)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output")
    args = parser.parse_args()
    if not 0 < args.share <= 1:
        parser.error(f"--share must be in (0, 1], got {args.share}")
    llm = LLM(model=args.model, dtype=args.dtype)
    workload = synthetic(num_requests=args.num_requests, vocab_size=llm.engine.info.vocab_size)
    llm.generate([{"prompt_token_ids": list(range(3, 67))}] * 2,
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    results = []
    for k in range(args.repeats):
        pair = {"none": run(llm, workload, 0.0), "mixed": run(llm, workload, args.share)}
        pair["ratio"] = pair["mixed"]["output_tokens_per_s"] / pair["none"]["output_tokens_per_s"]
        results.append(pair)
        print(f"repeat {k + 1}: none {pair['none']['output_tokens_per_s']:.1f} tok/s, "
              f"{args.share:.0%} constrained {pair['mixed']['output_tokens_per_s']:.1f} tok/s "
              f"({pair['mixed']['constrained_requests']} requests) -> {pair['ratio']:.3f}")
    print(f"median ratio {statistics.median(r['ratio'] for r in results):.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
