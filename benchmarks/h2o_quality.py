"""What heavy-hitter (H2O) eviction costs in quality, on a real model: perplexity of a
fixed text against the KV budget (docs/kv_cache_quantization.md, "H2O eviction").

The text (benchmarks/data/treadle_essay.txt + river_essay.txt, the same as
kv_quality.py's) is scored as one sequence of N tokens, each token by the model's
prompt logprobs with the cache it has at that point: the whole context without
eviction, else the kept tokens under `--kv-eviction h2o` with a budget of B = 25, 50
and 75% of N (the H2O paper's curve). Two splits of each budget: half recent tokens,
half heavy hitters (the paper's choice), and 7/8 recent (mostly a sliding window), to
show what the heavy hitters add.

    python benchmarks/h2o_quality.py --output h2o_quality.json   # the default SmolLM2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from treadle import LLM
from kv_quality import text_tokens  # the same text (this script's folder is on sys.path)
from treadle.bench.quality import perplexity, treadle_logprobs



def score(model: str | None, token_ids: list[int], args, **eviction) -> dict:
    llm = LLM(model=model, dtype=args.dtype, attention_backend=args.attention_backend,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
              max_num_batched_tokens=2048, distributed_executor_backend="uni", **eviction)
    t = time.perf_counter()
    n = len(token_ids)
    logprobs = treadle_logprobs(llm, token_ids, window=n, stride=n - 1)  # one window
    stats = llm.engine.scheduler.stats
    result = {"perplexity": perplexity(logprobs), "seconds": time.perf_counter() - t,
              "steps": stats.num_steps, "compactions": stats.num_kv_compactions,
              "evicted_tokens": stats.num_evicted_tokens, **eviction}
    llm.engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    ap.add_argument("--budgets", default="0.25,0.5,0.75",
                    help="KV budgets as fractions of the text's tokens")
    ap.add_argument("--recent-fractions", default="0.5,0.875",
                    help="kv_recent_tokens as fractions of each budget")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="cpu-native")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--output", default="h2o_quality.json")
    args = ap.parse_args()
    text, token_ids, model = text_tokens(args.model, args.dtype)
    model = args.model or model
    n = len(token_ids)
    full = score(model, token_ids, args)
    print("full cache", json.dumps(full), flush=True)
    out = {"model": model, "dtype": args.dtype, "num_tokens": n,
           "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "full": full,
           "h2o": []}
    for fraction in (float(x) for x in args.budgets.split(",")):
        budget = int(fraction * n)
        for recent_fraction in (float(x) for x in args.recent_fractions.split(",")):
            recent = max(1, min(budget - 2, int(recent_fraction * budget)))
            result = score(model, token_ids, args, kv_eviction="h2o",
                           kv_budget_tokens=budget, kv_recent_tokens=recent)
            result.update(budget_fraction=fraction, recent_fraction=recent_fraction,
                          relative_delta=result["perplexity"] / full["perplexity"] - 1)
            out["h2o"].append(result)
            print(json.dumps(result), flush=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print("wrote", args.output)


if __name__ == "__main__":
    main()
