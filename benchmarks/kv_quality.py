"""What a quantized KV cache costs in quality, on a real model (docs/kv_cache_quantization.md).

For each quantized `kv_cache_dtype`, against the unquantized (model dtype) cache on the
same attention backend (int8: cpu-native, the C kernels; fp8_e4m3: torch, emulated):
  - perplexity of a fixed text (benchmarks/data/treadle_essay.txt + river_essay.txt,
    >= 4,000 tokens) in windows, each token scored once (treadle.bench.quality);
  - greedy agreement over 128 new tokens for 64 chat prompts
    (benchmarks/data/chat_prompts.txt, the model's chat template);
  - mean KL(unquantized || quantized) of the next-token distributions along the
    unquantized greedy continuations (64 x 128 positions): both engines score the same
    token sequences; the full logits are read off the worker's `compute_logits` (this
    script reaches into the engine, so it lives in benchmarks/, not treadle/bench).

    python benchmarks/kv_quality.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --output kv_quality.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from treadle import LLM, SamplingParams
from treadle.bench.quality import (greedy_agreement, perplexity, treadle_logprobs, windows)

DATA = Path(__file__).resolve().parent / "data"
TEXTS = [DATA / "treadle_essay.txt", DATA / "river_essay.txt"]
PROMPTS = DATA / "chat_prompts.txt"
PAIRS = {"int8": ("cpu-native", "cpu-native"), "fp8_e4m3": ("torch", "torch"),
         "auto": ("cpu-native", "torch")}
"""Format -> the backends of its unquantized and its own run. `auto` is the noise floor:
the unquantized cache on two backends (C kernels, torch), whose roundings differ."""


class LogitTap:
    """Records the full logits the worker computes (uni executor: same process)."""

    def __init__(self, llm: LLM) -> None:
        model = llm.engine.executor.worker.model
        self.calls: list[torch.Tensor] = []
        self.on = False
        inner = model.compute_logits

        def tapped(hidden):
            logits = inner(hidden)
            if self.on and logits is not None:
                self.calls.append(logits.float().clone())
            return logits

        model.compute_logits = tapped

    def score(self, llm: LLM, token_ids: list[int]) -> torch.Tensor:
        """Log-softmaxed logits [len - 1, vocab] at positions 0..len-2 (each predicting
        the next token), from one prompt-logprob pass over token_ids."""
        self.calls, self.on = [], True
        try:
            params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
            llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
        finally:
            self.on = False
        rows = torch.cat(self.calls[1:])  # the first call: the sampled (last) position
        assert rows.shape[0] == len(token_ids) - 1, (rows.shape, len(token_ids))
        return torch.log_softmax(rows.double(), dim=-1)


def text_tokens(model: str | None, dtype: str) -> tuple[str, list[int], str]:
    """The fixed text, its token ids under the model's tokenizer, and the model's folder
    (the default model's when `model` is None)."""
    text = "\n\n".join(p.read_text() for p in TEXTS)
    probe = LLM(model=model, dtype=dtype, num_kv_blocks=16)
    token_ids = probe.tokenizer.encode(text, add_special_tokens=False)
    model_dir = str(probe.engine.model_dir)
    probe.engine.shutdown()
    return text, token_ids, model_dir


def make_llm(model: str, kind: str, backend: str, args) -> LLM:
    return LLM(model=model, dtype=args.dtype, kv_cache_dtype=kind, attention_backend=backend,
               kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
               max_num_batched_tokens=max(4096, args.window), max_num_seqs=64,
               distributed_executor_backend="uni")


def chat_prompts(llm: LLM) -> list[list[int]]:
    lines = [x for x in PROMPTS.read_text().splitlines() if x.strip()]
    texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": x}],
                                               tokenize=False, add_generation_prompt=True)
             for x in lines]
    return [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def compare(model: str, kind: str, args, token_ids: list[int]) -> dict:
    backends = PAIRS[kind]
    base, quant = make_llm(model, "auto", backends[0], args), make_llm(model, kind, backends[1], args)
    name = kind if kind != "auto" else "auto@" + backends[1]
    result = {"backends": backends, "kv_bytes_per_token": {
        "auto": base.engine.kv_bytes_per_token, name: quant.engine.kv_bytes_per_token}}
    t = time.perf_counter()
    ppl = {n: perplexity(treadle_logprobs(llm, token_ids, args.window, args.stride))
           for n, llm in (("auto", base), (name, quant))}
    result["perplexity"] = {**ppl, "relative_delta": ppl[name] / ppl["auto"] - 1}
    prompts = chat_prompts(base)[:args.num_prompts]
    ref = generate(base, prompts, args.new_tokens)
    got = generate(quant, prompts, args.new_tokens)
    agree = [greedy_agreement(a, b) for a, b in zip(ref, got)]
    firsts = [a["first_divergence"] for a in agree]
    result["greedy"] = {
        "num_prompts": len(prompts), "new_tokens": args.new_tokens,
        "mean_fraction_equal": float(np.mean([a["fraction_equal"] for a in agree])),
        "identical_prompts": sum(f is None for f in firsts),
        "median_first_divergence": float(np.median(
            [args.new_tokens if f is None else f for f in firsts]))}
    taps = {"auto": LogitTap(base), name: LogitTap(quant)}
    kls = []
    for prompt, cont in zip(prompts, ref):
        seq = prompt + cont
        p = taps["auto"].score(base, seq)[len(prompt) - 1:]
        q = taps[name].score(quant, seq)[len(prompt) - 1:]
        kls.append((p.exp() * (p - q)).sum(-1))  # KL(P || Q) per position, nats
    kl = torch.cat(kls)
    result["kl"] = {"mean": float(kl.mean()), "p99": float(kl.quantile(0.99)),
                    "num_positions": int(kl.numel())}
    result["seconds"] = time.perf_counter() - t
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kinds", default="int8,fp8_e4m3,auto",
                    help="formats to compare (auto: the noise floor of two backends)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--stride", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--output", default="kv_quality.json")
    args = ap.parse_args()
    text, token_ids, _ = text_tokens(args.model, args.dtype)
    out = {"model": args.model, "dtype": args.dtype, "num_tokens": len(token_ids),
           "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
           "window": args.window, "stride": args.stride,
           "num_windows": len(windows(len(token_ids), args.window, args.stride)),
           "results": {}}
    for kind in args.kinds.split(","):
        out["results"][kind] = compare(args.model, kind, args, token_ids)
        print(kind, json.dumps(out["results"][kind], indent=1), flush=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print("wrote", args.output)


if __name__ == "__main__":
    main()
