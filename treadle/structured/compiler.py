"""StructuredSpec -> a token-level grammar for one tokenizer (llguidance), compiled once.

Owns the grammar library's tokenizer (built once from the model's Hugging Face
tokenizer, about 0.3 s for 49152 ids), the translation of each spec kind into an
llguidance grammar (JSON schema with fixed separators, regex, choice as a Lark
alternation, Lark or EBNF/GBNF text), its validation (an error names the construct: the
unsupported keyword, the regex position, the grammar line), and a bounded LRU cache of
compiled grammars keyed by the spec: a request then costs a copy of a pristine matcher
(~0.01 ms, against ~0.7 ms to build one). Compiling is blocking work; `compile_async`
runs it in a worker thread so the event loop never waits on it.

Why llguidance and not xgrammar: docs/structured_outputs.md (measured). It does not
sample, and knows nothing of requests beyond the spec.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from treadle.structured.spec import StructuredOutputError, StructuredSpec

DEFAULT_CACHE_SIZE = 256
COMPILE_TIMEOUT_S = 5.0
"""Longest a request's grammar may take to compile before it is refused (compile_async)."""
DRY_RUN_TOKENS = 4
"""Tokens a new grammar is walked at compile time to catch parser-limit overflows
(GrammarCompiler._dry_run)."""
"""Distinct compiled grammars kept (each holds its lexer and parser tables)."""


@dataclass
class CompiledGrammar:
    """A validated grammar and a pristine matcher to copy per request."""

    spec: StructuredSpec
    grammar: str
    matcher: object  # llguidance.LLMatcher, never advanced: only deep-copied


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, ll_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        """`ll_tokenizer`: an llguidance.LLTokenizer (see `from_hf_tokenizer`)."""
        import llguidance
        self._ll = llguidance
        self.tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._cache: OrderedDict[tuple, CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0
        """Grammars compiled (cache misses), for tests and metrics."""

    @classmethod
    def from_hf_tokenizer(cls, hf_tokenizer, vocab_size: int,
                          eos_token_ids: Sequence[int] | int | None = None,
                          cache_size: int = DEFAULT_CACHE_SIZE) -> "GrammarCompiler":
        """From a transformers fast tokenizer. `vocab_size` is the model's (its logits'
        width, which may exceed the tokenizer's); ids past the tokenizer are never
        allowed. `eos_token_ids`: the ids that end generation (the tokenizer's EOS when
        not given); the grammar allows them once the output is complete."""
        import llguidance.hf
        if eos_token_ids is None:
            eos_token_ids = [hf_tokenizer.eos_token_id]
        elif isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        eos = [e for e in eos_token_ids if e is not None]
        if not eos:
            raise ValueError("structured outputs need an end-of-sequence token id")
        ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                    eos_token=eos)
        return cls(ll_tokenizer, vocab_size, eos, cache_size)

    # ----- compiling ---------------------------------------------------------------------

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); StructuredOutputError naming the
        spec's field and the construct when it does not compile."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._build(spec)  # outside the lock: two threads may race; both agree
            with self._lock:
                self._cache[key] = hit
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                self.num_compiled += 1
        if isinstance(hit, StructuredOutputError):
            raise StructuredOutputError(spec.field, hit.detail)
        return hit

    async def compile_async(self, spec: StructuredSpec,
                            timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """`compile` in a worker thread (llguidance drops the GIL while it builds and
        walks the grammar, measured in docs/structured_outputs.md). A compile that takes
        longer than `timeout_s` is a StructuredOutputError naming the budget; it finishes
        in its thread and is cached, so asking again answers at once."""
        with self._lock:
            hit = self._cache.get(spec.key)
        if isinstance(hit, CompiledGrammar):
            return hit
        task = asyncio.ensure_future(asyncio.to_thread(self.compile, spec))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            task.add_done_callback(lambda t: t.exception())  # its error, if any, is cached
            raise StructuredOutputError(spec.field, (
                f"compiling the grammar took longer than {timeout_s:g} s (the compile "
                "budget): simplify it")) from None

    def new_request(self, spec: StructuredSpec):
        """A fresh per-request matcher (treadle.structured.matcher.StructuredRequest)."""
        from treadle.structured.matcher import StructuredRequest
        compiled = self.compile(spec)
        return StructuredRequest(compiled.matcher.deep_copy(), self.vocab_size,
                                 self.eos_token_ids, spec)

    def _grammar_text(self, spec: StructuredSpec) -> str:
        ll = self._ll
        matcher = ll.LLMatcher
        separators = ((",", ":") if spec.compact_json else (", ", ": "))
        options = {"whitespace_flexible": False, "item_separator": separators[0],
                   "key_separator": separators[1]}
        if spec.kind == "json":
            return matcher.grammar_from_json_schema(spec.value, defaults=options)
        if spec.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices))
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            lark = any_to_lark(spec.value)
        except Exception as exc:  # the converter raises its own and plain errors
            raise StructuredOutputError(spec.field, f"the EBNF grammar does not parse: {exc}") \
                from None
        return matcher.grammar_from_lark(lark)

    def _build(self, spec: StructuredSpec) -> CompiledGrammar | StructuredOutputError:
        ll = self._ll
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                "choice": "choice list", "grammar": "grammar"}[spec.kind]
        try:
            grammar = self._grammar_text(spec)
        except StructuredOutputError as exc:
            return exc
        except ValueError as exc:
            return StructuredOutputError(spec.field, f"the {what} is not supported: {exc}")
        is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            return StructuredOutputError(spec.field, f"the {what} is not supported: "
                                         f"{one_line(messages[0])}")
        matcher = ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return StructuredOutputError(spec.field, f"the {what} is not supported: "
                                         f"{one_line(matcher.get_error())}")
        failure = self._dry_run(matcher)
        if failure is not None:
            return StructuredOutputError(spec.field, f"the {what} is too large for the grammar "
                                         f"engine ({parser_limit(failure)})"
                                         f"{_largest_construct(spec)}")
        return CompiledGrammar(spec, grammar, matcher)

    def _dry_run(self, matcher) -> str | None:
        """Walk a copy of a fresh matcher DRY_RUN_TOKENS tokens along one path (the lowest
        allowed id that is not end-of-sequence, each step) and return the parser's error if
        it fails on the way. A grammar whose first parser row holds every alternative
        (hundreds of optional properties, thousands of alternatives) overflows llguidance's
        row limit on the first token it consumes: caught here, it is a 400 at admission
        instead of a request that fails once it runs."""
        import numpy as np

        probe = matcher.deep_copy()
        words = (self.vocab_size + 31) // 32
        row = np.zeros(words, dtype=np.int32)
        eos = set(self.eos_token_ids)
        for _ in range(DRY_RUN_TOKENS):
            if probe.is_stopped():
                break
            probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if probe.is_error():
                break
            token = _lowest_allowed(row, eos)
            if token is None:
                break
            probe.consume_token(token)
            if probe.is_error():
                break
        return probe.get_error() if probe.is_error() else None


def _lowest_allowed(row, excluded: set[int]) -> int | None:
    """The lowest token id a bitmask row (numpy int32 words) allows, outside `excluded`."""
    import numpy as np

    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    for token in np.flatnonzero(bits):
        if int(token) not in excluded:
            return int(token)
    return None


def _largest_construct(spec: StructuredSpec) -> str:
    """For a JSON schema, where its largest object or enum is (the construct the parser's
    limits usually trip on), as a clause for the error message; '' otherwise."""
    if spec.kind != "json":
        return ""
    largest = {"properties": (0, ""), "enum": (0, "")}

    def walk(node, path: str) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > largest["properties"][0]:
                largest["properties"] = (len(props), path or "the root")
            values = node.get("enum")
            if isinstance(values, list) and len(values) > largest["enum"][0]:
                largest["enum"] = (len(values), path or "the root")
            for key, child in node.items():
                walk(child, f"{path}.{key}" if path else key)
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")

    walk(json.loads(spec.value), "")
    props, enum = largest["properties"], largest["enum"]
    if props[0] >= enum[0] and props[0] > 1:
        return f": its largest object ({props[1]}) has {props[0]} properties"
    if enum[0] > 1:
        return f": its largest enum ({enum[1]}) has {enum[0]} values"
    return ""


def parser_limit(message: str) -> str:
    """The limit an llguidance parser error names ("Parser Error: Current row has 2003
    items; max is 2000"), without its advice and the parser state it dumps."""
    text = one_line(message.split("<state>", 1)[0], 300)
    return text.split("; consider", 1)[0].rstrip(" ;")


def one_line(message: str, limit: int = 600) -> str:
    """An llguidance error message on one line (it draws carets under the source)."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + "..."
