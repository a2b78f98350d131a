"""xgrammar against llguidance: grammar compile time and per-step token-mask time.

The measurement behind the choice of grammar engine (docs/structured_outputs.md). For
each library and tokenizer (the demo model's 49152-id byte-level BPE, and SmolLM2's real
one when a tokenizer folder is given), it compiles one JSON schema, then decodes B
requests in lock step (B = 1, 16, 64): every step fills the B rows of one bitmask (the
library's batch call, which releases the GIL and uses its own threads) and accepts each
request's next token. The token sequences are valid documents of the schema, tokenized
by the tokenizer itself, each request at its own offset so rows are at different places
in the grammar. Reported per step: median and p90 of the mask fill, and the accept cost.

    python benchmarks/grammar_backends.py [--smollm2-tokenizer DIR] [--steps 60]

Needs both libraries installed (`pip install xgrammar llguidance`); treadle itself
depends on llguidance only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "score"],
    "additionalProperties": False,
}


def documents(count: int) -> list[str]:
    """`count` different valid documents of SCHEMA (compact JSON, as both engines allow)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    docs = []
    for i in range(count):
        doc = {"name": f"{words[i % 8].title()} {words[(i * 3) % 8].title()} the {i}th",
               "age": 20 + i % 60, "email": f"{words[i % 8]}.{i}@example.com",
               "tags": [words[(i + k) % 8] for k in range(1 + i % 5)],
               "address": {"street": f"{100 + i} {words[(i + 5) % 8].title()} Road",
                           "city": words[(i + 2) % 8].title() + "ville", "zip": f"{10000 + i}"},
               "role": ["admin", "user", "guest"][i % 3], "score": round(0.5 + i * 1.25, 2)}
        docs.append(json.dumps(doc, separators=(",", ":")))
    return docs


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        assert not error, error
        return grammar

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, matchers, bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.data_ptr(), bitmask.shape[1] * 4,
                                              bitmask.shape[0])

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def measure(engine, hf_tokenizer, batch: int, steps: int) -> dict:
    t0 = time.perf_counter()
    compiled = engine.compile(SCHEMA)
    compile_s = time.perf_counter() - t0
    docs = documents(batch)
    sequences = [hf_tokenizer.encode(d, add_special_tokens=False) for d in docs]
    t0 = time.perf_counter()
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    matcher_s = time.perf_counter() - t0
    # Stagger the rows: request i starts i tokens into its document.
    for i, (m, seq) in enumerate(zip(matchers, sequences)):
        for token in seq[:i % max(1, min(len(s) for s in sequences) // 2)]:
            assert engine.accept(m, token)
    cursor = [i % max(1, min(len(s) for s in sequences) // 2) for i in range(batch)]
    bitmask = torch.full((batch, (engine.vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill_times, accept_times = [], []
    for _ in range(steps):
        live = [i for i in range(batch) if cursor[i] < len(sequences[i])]
        if not live:
            break
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        for i in live:
            token = sequences[i][cursor[i]]
            allowed = (int(bitmask[i, token // 32]) >> (token % 32)) & 1
            assert allowed, f"{engine.name}: token {token} of a valid document masked out"
            assert engine.accept(matchers[i], token)
            cursor[i] += 1
        t2 = time.perf_counter()
        fill_times.append(t1 - t0)
        accept_times.append(t2 - t1)
    fill_times.sort()
    return {"library": engine.name, "batch": batch, "compile_ms": compile_s * 1e3,
            "matcher_ms": matcher_s * 1e3 / batch,
            "steps": len(fill_times),
            "fill_ms_median": statistics.median(fill_times) * 1e3,
            "fill_ms_mean": statistics.fmean(fill_times) * 1e3,
            "fill_ms_p90": fill_times[int(0.9 * (len(fill_times) - 1))] * 1e3,
            "accept_ms_median": statistics.median(accept_times) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smollm2-tokenizer", default=None,
                        help="folder with SmolLM2's tokenizer.json (saved from its GGUF)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import PreTrainedTokenizerFast, AutoTokenizer

    from treadle.models.demo import SPECIAL_TOKENS, build_demo_tokenizer
    tokenizers = {"demo": PreTrainedTokenizerFast(
        tokenizer_object=build_demo_tokenizer(), eos_token=SPECIAL_TOKENS[2])}
    if args.smollm2_tokenizer:
        tokenizers["smollm2"] = AutoTokenizer.from_pretrained(args.smollm2_tokenizer)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch threads {torch.get_num_threads()}; 2 library threads; "
          f"{args.steps} steps per row")
    print(f"{'tokenizer':10} {'library':11} {'B':>3} {'compile ms':>10} {'matcher ms':>10} "
          f"{'fill ms p50':>11} "
          f"{'fill ms p90':>11} {'fill ms mean':>12} {'accept ms':>9} {'mean us/row':>11}")
    for tok_name, tok in tokenizers.items():
        t0 = time.perf_counter()
        engines = []
        for cls in (LLGuidance, XGrammar):
            t0 = time.perf_counter()
            engines.append(cls(tok, 49152))
            print(f"{tok_name:10} {cls.name:11} tokenizer setup "
                  f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
        for batch in batches:
            runs: dict[str, list[dict]] = {e.name: [] for e in engines}
            for _ in range(args.repeats):  # alternating, same batch
                for engine in engines:
                    runs[engine.name].append(measure(engine, tok, batch, args.steps))
            for name, results in runs.items():
                r = {k: statistics.median(x[k] for x in results) if k != "library" else name
                     for k in results[0]}
                print(f"{tok_name:10} {r['library']:11} {batch:>3} {r['compile_ms']:>10.1f} "
                      f"{r['matcher_ms']:>10.3f} "
                      f"{r['fill_ms_median']:>11.3f} {r['fill_ms_p90']:>11.3f} "
                      f"{r['fill_ms_mean']:>12.3f} {r['accept_ms_median']:>9.3f} "
                      f"{r['fill_ms_mean'] * 1e3 / batch:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
