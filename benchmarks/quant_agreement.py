"""Greedy agreement of a GGUF file's quantized weights (--quantization gguf) with the
same file dequantized to bf16 (--quantization none), on the real SmolLM2-135M-Instruct.

The default model ships as Q4_1; this writes it again as Q8_0 and as Q4_0 (from its own
values, as `llama-quantize --allow-requantize` would: the GGUF writer of the tests,
tests/integration/gguf_files.py, with gguf-py's quantizers), then decodes the same chat
prompts greedily for `--max-tokens` new tokens (EOS ignored) both ways and counts the
positions whose tokens agree. Prints JSON: per file, the fraction of agreeing tokens, the
number of requests identical throughout, and each request's first differing position.

Run: `python benchmarks/quant_agreement.py [--formats Q8_0,Q4_0,Q4_1] [--max-tokens 64]
[--out DIR]`
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
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="Q8_0,Q4_0,Q4_1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="results/quant_agreement")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from gguf_files import write_tiny_gguf

    from treadle import LLM, SamplingParams
    from treadle.models import default_model
    from treadle.models.resolve import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_model(None, dtype="float32")
    shipped = default_model.default_model_gguf()
    report = {}
    prompt_ids = None
    for fmt in args.formats.split(","):
        path = shipped if fmt == "Q4_1" else out / f"SmolLM2-135M-Instruct.{fmt}.gguf"
        if not path.is_file():
            write_tiny_gguf(checkpoint, path, "llama", {"": fmt})
        tokens = {}
        for mode in ("gguf", "none"):
            llm = LLM(model=str(path), quantization=mode, dtype="bfloat16",
                      kv_cache_memory="512MiB")
            if prompt_ids is None:  # the real tokenizer and chat template, from the shipped file
                tok = LLM(model=str(shipped), dtype="bfloat16", kv_cache_memory="64MiB").tokenizer
                prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}],
                                                      add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]
                              for p in PROMPTS]
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids],
                                SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                               ignore_eos=True), use_tqdm=False)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
        same = sum(a == b for q, d in zip(tokens["gguf"], tokens["none"]) for a, b in zip(q, d))
        total = sum(len(d) for d in tokens["none"])
        first = [next((i for i, (a, b) in enumerate(zip(q, d)) if a != b), None)
                 for q, d in zip(tokens["gguf"], tokens["none"])]
        report[fmt] = {"file": str(path), "agreeing_tokens": same, "tokens": total,
                       "agreement": round(same / total, 4),
                       "identical_requests": sum(f is None for f in first),
                       "first_difference": first}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
