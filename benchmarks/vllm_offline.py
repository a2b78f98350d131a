"""vLLM's offline throughput on a treadle workload file: the `offline` runner of
`treadle bench compare` for vLLM (see benchmarks/compare_cpu.yaml).

Runs in vLLM's own virtual environment (it imports vllm, never treadle):

    $VLLM_PY benchmarks/vllm_offline.py --model DIR --workload W.json --output R.json

It does what `treadle bench throughput` does for treadle: build the engine (outside the
clock), warm it up on two short requests, then `LLM.generate` every request of the
workload at once, from its prompt token ids, greedy, ignoring EOS, each with its own
`max_tokens`; the clock covers that one call. It writes the measured wall time, token
counts and rates as JSON. Nothing here is a target.
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON from save_workload")
    parser.add_argument("--output", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workload) as f:
        workload = json.load(f)
    requests = workload["requests"]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    load_s = time.perf_counter() - t0
    llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 67)))] * 2,
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    result = {
        "system": "vllm",
        "vllm_version": vllm.__version__,
        "machine": platform.machine(),
        "dtype": args.dtype,
        "num_requests": len(outputs),
        "num_errors": sum(1 for o in outputs if not o.finished),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r["max_tokens"] for r in requests),
        "load_s": load_s,
        "wall_s": wall_s,
        "requests_per_s": len(outputs) / wall_s,
        "output_tokens_per_s": output_tokens / wall_s,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / wall_s,
    }
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
