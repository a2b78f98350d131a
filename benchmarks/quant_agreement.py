"""Greedy agreement of a GGUF file's quantized weights (--quantization gguf) with the
same file dequantized to bf16 (--quantization none), on the real SmolLM2-135M-Instruct.

The default model ships as Q4_1; this writes it again as Q8_0 and as Q4_0 (from its own
values, as `llama-quantize --allow-requantize` would: the GGUF writer of the tests,
tests/integration/gguf_files.py, with gguf-py's quantizers), then decodes the same chat
prompts greedily for `--max-tokens` new tokens (EOS ignored) both ways. Prints JSON, per
file:
- `agreement`: the fraction of positions whose free-running tokens agree (once two runs
  pick different tokens at a near-tie, the rest of the request differs too), the number
  of requests identical throughout, and each request's first differing position;
- `noise_floor`: the same count for the bf16 run against itself with only the batching
  changed (each prompt alone, so its linears run on the 1-row kernels instead of the
  batch's): how much disagreement rounding alone causes, with no quantization;
- `teacher_forced`: each prompt followed by the bf16 run's tokens, scored by the
  quantized model (prompt_logprobs): the fraction of positions where its own greedy
  choice is the bf16 run's token, so that a near-tie counts once, not for the rest of
  the request. (Scoring runs the tokens as prefill rows, so the kernels are the quantized
  prefill paths, not the decode ones.) `teacher_forced_noise_floor`: the bf16 model
  scoring its own tokens the same way (prefill kernels instead of decode ones).

Run: `python benchmarks/quant_agreement.py [--formats Q8_0,Q4_0,Q4_1] [--max-tokens 64]
[--out DIR]`, or `--file FILE.gguf` for another real file (its own tokenizer and template).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain what a hash table is to a ten-year-old.",
    "Give me a recipe for pancakes.", "What causes the seasons on Earth?",
    "Translate 'good morning, my friend' into Spanish and French.",
    "Write a short story about a robot who learns to paint.",
    "How do vaccines work?", "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between weather and climate?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?", "Name five animals that live in the ocean.",
    "Describe how a bicycle works.", "What are the benefits of regular exercise?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="Q8_0,Q4_0,Q4_1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="results/quant_agreement")
    parser.add_argument("--file", default=None,
                        help="measure this GGUF file (its own tokenizer and chat template) "
                             "instead of SmolLM2 in --formats, e.g. the real Gemma 3 270M "
                             "Q4_K_M, whose Q5_0 and Q6_K projections run as Q8_0 made at load")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from gguf_files import write_tiny_gguf

    from treadle import LLM, SamplingParams
    from treadle.bench.quality import teacher_forced_agreement
    from treadle.models import default_model
    from treadle.models.resolve import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_model(None, dtype="float32")
    shipped = default_model.default_model_gguf()
    report = {}
    prompt_ids = None
    if args.file is not None:
        shipped = Path(args.file)
    for fmt in ([Path(args.file).name] if args.file else args.formats.split(",")):
        path = (shipped if args.file or fmt == "Q4_1"
                else out / f"SmolLM2-135M-Instruct.{fmt}.gguf")
        if not path.is_file():
            write_tiny_gguf(checkpoint, path, "llama", {"": fmt})
        tokens, alone, scoring, self_scored = {}, None, None, None
        for mode in ("gguf", "none"):
            llm = LLM(model=str(path), quantization=mode, dtype="bfloat16",
                      kv_cache_memory="512MiB")
            if prompt_ids is None:  # the real tokenizer and chat template, from the shipped file
                tok = LLM(model=str(shipped), dtype="bfloat16", kv_cache_memory="64MiB").tokenizer
                if getattr(tok, "chat_template", None):
                    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}],
                                                          add_generation_prompt=True,
                                                          return_dict=True)["input_ids"]
                                  for p in PROMPTS]
                else:  # a file whose tokenizer carries no template: the plain prompts
                    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids],
                                SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                               ignore_eos=True), use_tqdm=False)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            if mode == "none":
                alone = [llm.generate([{"prompt_token_ids": list(p)}], SamplingParams(
                    max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0].token_ids for p in prompt_ids]
                self_scored = teacher_forced_agreement(llm, prompt_ids, tokens["none"])
            else:
                scoring = llm
        report[fmt] = {"file": str(path),
                       "agreement": _agreement(tokens["gguf"], tokens["none"]),
                       "noise_floor": _agreement(alone, tokens["none"]),
                       "teacher_forced": teacher_forced_agreement(scoring, prompt_ids, tokens["none"]),
                       "teacher_forced_noise_floor": self_scored}
        del scoring
    print(json.dumps(report, indent=1))


def _agreement(runs, reference) -> dict:
    same = sum(a == b for q, d in zip(runs, reference) for a, b in zip(q, d))
    total = sum(len(d) for d in reference)
    first = [next((i for i, (a, b) in enumerate(zip(q, d)) if a != b), None)
             for q, d in zip(runs, reference)]
    return {"agreeing_tokens": same, "tokens": total, "fraction": round(same / total, 4),
            "identical_requests": sum(f is None for f in first), "first_difference": first}


if __name__ == "__main__":
    main()
