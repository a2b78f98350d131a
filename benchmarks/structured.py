"""Per-step cost of structured outputs at 1, 16 and 64 constrained requests.

Measures treadle.structured as the sampler will call it, on the demo model's 49152-id
tokenizer (and SmolLM2's with --tokenizer DIR): per step, BitmaskFiller.fill of every
constrained row (llguidance's threads, GIL released), apply_bitmask_ on those rows'
float32 logits, and accept() of each sampled token; and whether the fill hides behind
a forward pass: a stand-in forward (the LM-head matmul of SmolLM2-135M's shape,
[rows, 576] x [576, 49152], repeated to ~the length of a real step) timed alone and with
BitmaskFiller.submit running during it. Rows follow valid JSON documents of one schema,
each at its own offset.

    python benchmarks/structured.py [--tokenizer DIR] [--steps 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "tags", "address", "role"], "additionalProperties": False}


def _document(i: int) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return json.dumps({"name": f"{words[i % 8].title()} number {i}", "age": 20 + i % 60,
                       "tags": [words[(i + k) % 8] for k in range(1 + i % 4)],
                       "address": {"city": words[(i + 2) % 8].title() + "ville",
                                   "zip": f"{10000 + i}"},
                       "role": ["admin", "user", "guest"][i % 3]})


def measure(compiler, tokenizer, rows: int, steps: int, forward_repeats: int) -> dict:
    from treadle.structured import from_response_format
    from treadle.structured.matcher import BitmaskFiller, allocate_bitmask, apply_bitmask_
    spec = from_response_format({"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}})
    sequences = [tokenizer.encode(_document(i), add_special_tokens=False) for i in range(rows)]
    requests = [compiler.new_request(spec) for _ in range(rows)]
    for i, (request, seq) in enumerate(zip(requests, sequences)):
        assert request.accept(seq[:i % 10])
    cursor = [i % 10 for i in range(rows)]
    vocab = compiler.vocab_size
    bitmask = allocate_bitmask(rows, vocab)
    filler = BitmaskFiller()
    hidden = torch.randn(rows, 576)
    head = torch.randn(576, vocab) * 0.02
    fill, apply, accept, alone, overlapped = [], [], [], [], []
    try:
        for _ in range(steps):
            if any(cursor[i] >= len(sequences[i]) for i in range(rows)):
                break
            t0 = time.perf_counter()
            filler.fill(requests, bitmask)
            t1 = time.perf_counter()
            logits = hidden @ head
            t2 = time.perf_counter()
            apply_bitmask_(logits, bitmask)
            t3 = time.perf_counter()
            for i, request in enumerate(requests):
                assert request.accept(sequences[i][cursor[i]])
                cursor[i] += 1
            t4 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t3 - t2)
            accept.append(t4 - t3)
            # the same step's fill hidden behind a forward pass, against the forward alone
            t0 = time.perf_counter()
            for _ in range(forward_repeats):
                hidden @ head
            alone.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            future = filler.submit(requests, bitmask)
            for _ in range(forward_repeats):
                hidden @ head
            future.result()
            overlapped.append(time.perf_counter() - t0)
    finally:
        filler.close()
    med = statistics.median
    return {"rows": rows, "steps": len(fill), "fill_ms": med(fill) * 1e3,
            "fill_ms_mean": statistics.fmean(fill) * 1e3, "apply_ms": med(apply) * 1e3,
            "accept_ms": med(accept) * 1e3, "forward_ms": med(alone) * 1e3,
            "forward_with_fill_ms": med(overlapped) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder (e.g. SmolLM2's) besides the demo one")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--forward-repeats", type=int, default=4,
                        help="LM-head matmuls per stand-in forward pass")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 keeps a loaded machine from stalling "
                             "OpenMP barriers)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from treadle.models.demo import SPECIAL_TOKENS, build_demo_tokenizer
    from treadle.structured.compiler import GrammarCompiler
    tokenizers = {"demo": PreTrainedTokenizerFast(tokenizer_object=build_demo_tokenizer(),
                                                  eos_token=SPECIAL_TOKENS[2])}
    if args.tokenizer:
        tokenizers["other"] = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"torch threads {torch.get_num_threads()}")
    print(f"{'tokenizer':9} {'rows':>4} {'fill ms':>8} {'fill mean':>9} {'apply ms':>8} "
          f"{'accept ms':>9} {'forward ms':>10} {'fwd+fill ms':>11}")
    for name, tok in tokenizers.items():
        compiler = GrammarCompiler.from_hf_tokenizer(tok, 49152)
        for rows in (1, 16, 64):
            r = measure(compiler, tok, rows, args.steps, args.forward_repeats)
            print(f"{name:9} {rows:>4} {r['fill_ms']:>8.3f} {r['fill_ms_mean']:>9.3f} "
                  f"{r['apply_ms']:>8.3f} {r['accept_ms']:>9.3f} {r['forward_ms']:>10.2f} "
                  f"{r['forward_with_fill_ms']:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
