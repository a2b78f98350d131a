"""Which bf16 prefill attention is closer to float32: the C kernel (on its vector loops or,
where the CPU has them, on AMX tiles) or torch's SDPA?

The cpu-native backend runs prefill rows on its C kernel (`paged_prefill.c`) or on the
torch backend's spans (`scaled_dot_product_attention`); all compute in bf16 with their
own roundings. This script measures each against a float32 run of the same model
(the float32 engine is the reference; its prefills take torch's spans in float32):
  - mean and p99 KL(float32 || bf16) of the next-token distributions along float32's
    greedy continuations of the chat prompts (benchmarks/data/chat_prompts.txt), the
    prompt and continuation scored as one prefill (prompt logprobs): every scored position
    went through the prefill path under test;
  - teacher-forced top-1 agreement with float32 on the same positions;
  - agreement of the first generated token, and of the whole free-running greedy
    continuation (a near-tie flips the rest of a request, so this one is noisy);
  - perplexity of the fixed text (benchmarks/data/*_essay.txt) in windows.

    python benchmarks/prefill_attention_quality.py --output prefill_quality.json

(`--model` defaults to the built-in default model.) It reaches into the engine (the
backend's `native_prefill` switch and the worker's logits), so it lives in benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from kv_quality import LogitTap, chat_prompts, generate, text_tokens  # this folder is on sys.path
from treadle import LLM
from treadle.bench.quality import (greedy_agreement, perplexity, teacher_forced_agreement,
                                   treadle_logprobs)


def make_llm(model: str | None, dtype: str, native_prefill: bool | None,
             amx: bool = False) -> LLM:
    llm = LLM(model=model, dtype=dtype, attention_backend="cpu-native",
              enable_prefix_caching=False, max_num_batched_tokens=4096, max_num_seqs=64,
              kv_cache_memory="512MiB", distributed_executor_backend="uni")
    if native_prefill is not None:
        attention = llm.engine.executor.worker.attention
        if native_prefill and not attention.kernels.supports_prefill(torch.bfloat16,
                                                                     attention.head_dim):
            raise SystemExit("this build has no C prefill kernel for the model's head size")
        attention.native_prefill = native_prefill
        attention.prefill_amx = amx
        attention.native_window_prefill = native_prefill and attention.native_window_prefill
    return llm


def measure(name: str, llm: LLM, ref: dict, args) -> dict:
    t = time.perf_counter()
    tap = LogitTap(llm)
    kls = []
    for prompt, cont, p in zip(ref["prompts"], ref["continuations"], ref["scores"]):
        q = tap.score(llm, prompt + cont)[len(prompt) - 1:]
        kls.append((p.exp() * (p - q)).sum(-1))
    kl = torch.cat(kls)
    got = generate(llm, ref["prompts"], args.new_tokens)
    agree = [greedy_agreement(a, b) for a, b in zip(ref["continuations"], got)]
    firsts = [a["first_divergence"] != 0 for a in agree]
    result = {
        "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
        "kl_positions": int(kl.numel()),
        "teacher_forced_top1": teacher_forced_agreement(llm, ref["prompts"],
                                                        ref["continuations"]),
        "first_token_equal": f"{sum(firsts)}/{len(firsts)}",
        "greedy_mean_fraction_equal": float(np.mean([a["fraction_equal"] for a in agree])),
        "perplexity": perplexity(treadle_logprobs(llm, ref["text_ids"], args.window,
                                                  args.stride)),
        "seconds": round(time.perf_counter() - t, 1)}
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the built-in default model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--output", default="prefill_quality.json")
    args = ap.parse_args()
    _, text_ids, _ = text_tokens(args.model, "float32")
    reference = make_llm(args.model, "float32", None)
    prompts = chat_prompts(reference)[:args.num_prompts]
    continuations = generate(reference, prompts, args.new_tokens)
    tap = LogitTap(reference)
    ref = {"prompts": prompts, "continuations": continuations, "text_ids": text_ids,
           "scores": [tap.score(reference, p + c)[len(p) - 1:]
                      for p, c in zip(prompts, continuations)]}
    out = {"model": args.model or "default", "num_prompts": len(prompts),
           "new_tokens": args.new_tokens, "text_tokens": len(text_ids),
           "float32_perplexity": perplexity(treadle_logprobs(reference, text_ids,
                                                             args.window, args.stride)),
           "bf16": {}}
    reference.engine.shutdown()
    print("float32 perplexity", out["float32_perplexity"], flush=True)
    for name, native, amx in (("c_kernel", True, False), ("c_kernel_amx", True, True),
                              ("torch_sdpa", False, False)):
        llm = make_llm(args.model, "bfloat16", native, amx)
        attention = llm.engine.executor.worker.attention
        if amx and not attention.kernels.supports_amx_prefill(attention.head_dim):
            print("no AMX compute path here: c_kernel_amx left out", flush=True)
            llm.engine.shutdown()
            continue
        out["bf16"][name] = measure(name, llm, ref, args)
        llm.engine.shutdown()
    Path(args.output).write_text(json.dumps(out, indent=1))
    print("wrote", args.output)


if __name__ == "__main__":
    main()
