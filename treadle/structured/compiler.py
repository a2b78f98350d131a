"""StructuredSpec -> a token-level grammar for one tokenizer (llguidance), compiled once.

Owns the grammar library's tokenizer (built once from the model's Hugging Face
tokenizer, about 0.3 s for 49152 ids), the translation of each spec kind into an
llguidance grammar (JSON schema with fixed separators, regex, choice as a Lark
alternation, Lark or EBNF/GBNF text), its validation (an error names the construct: the
unsupported keyword, the regex position, the grammar line), and a bounded LRU cache of
compiled grammars keyed by the spec: a request then costs a copy of a pristine matcher
(~0.01 ms, against ~0.7 ms to build one). Compiling is blocking work (40-130 ms for the
largest grammars accepted); `compile_async` runs it in a worker thread so the event loop
never waits on it, and that thread runs at the idle scheduling class (SCHED_IDLE, or nice
19 where that is refused) so that it only takes a core the engine's threads leave idle:
llguidance releases the GIL while it compiles, so the contention it caused was for the
cores, and a compile at normal priority stretched every other stream's step (measured in
docs/structured_outputs.md).

Why llguidance and not xgrammar: docs/structured_outputs.md (measured). It does not
sample, and knows nothing of requests beyond the spec.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from treadle.structured.spec import StructuredOutputError, StructuredSpec
from treadle.thread_priority import idle_thread_pool

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
"""Distinct compiled grammars kept (each holds its lexer and parser tables)."""
COMPILE_BUDGET_S = 5.0
"""CPU seconds a grammar's compile may take before it is refused (its thread's CPU time:
a compile at the idle class waits for cores on a busy server, and that wait is not the
grammar's size)."""
COMPILE_WAIT_S = 120.0
"""Longest a request waits for its grammar's compile at admission (compile_async): a
compile starved that long by a saturated machine is refused too."""
DRY_RUN_TOKENS = 4
"""Tokens a new grammar is walked at compile time to catch parser-limit overflows
(GrammarCompiler._dry_run)."""


_SHARED: dict[tuple, "GrammarCompiler"] = {}
_SHARED_LOCK = threading.Lock()


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
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.budget_s = COMPILE_BUDGET_S
        """CPU seconds a compile may take (COMPILE_BUDGET_S)."""
        self.compile_cpus: Callable[[], set[int] | None] = lambda: None
        """Where `compile_async` runs a compile, asked at each one (None: anywhere the
        process may run). The server answers the CPU of the thread that steps the
        engine (server/grammars.py)."""

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

    @classmethod
    def shared(cls, model_dir, hf_tokenizer, vocab_size: int,
               eos_token_ids: Sequence[int] | int | None) -> "GrammarCompiler":
        """The process's one compiler for the model in `model_dir`, built on first use from
        `hf_tokenizer` (the tokenizer, or a function loading it: called only then). The
        server and an in-process worker share it, so a grammar the server compiled at
        admission is a cache hit when the worker first sees the request, instead of a
        second compile beside the forward pass."""
        eos = tuple([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids or ())
        key = (str(model_dir), vocab_size, eos)
        with _SHARED_LOCK:  # held while building (~0.3 s): a second caller waits for it
            compiler = _SHARED.get(key)
            if compiler is None:
                if callable(hf_tokenizer) and not hasattr(hf_tokenizer, "encode"):
                    hf_tokenizer = hf_tokenizer()
                if hf_tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer files")
                compiler = cls.from_hf_tokenizer(hf_tokenizer, vocab_size, list(eos) or None)
                _SHARED[key] = compiler
            return compiler

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
            start, cpu_start = time.monotonic(), time.thread_time()
            hit = self._build(spec)  # outside the lock: two threads may race; both agree
            cpu_s = time.thread_time() - cpu_start
            if cpu_s > self.budget_s and isinstance(hit, CompiledGrammar):
                hit = StructuredOutputError(spec.field, (
                    f"compiling the grammar took {cpu_s:.1f} s of CPU, over the budget of "
                    f"{self.budget_s:g} s: simplify it"))
            end = time.monotonic()
            # benchmarks/grammar_stall.py reads this line's span (monotonic clock)
            logger.debug("grammar compiled for %s in %.1f ms on %s (monotonic %.6f to %.6f)",
                         spec.field, 1e3 * (end - start), threading.current_thread().name,
                         start, end)
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
                            wait_s: float = COMPILE_WAIT_S) -> CompiledGrammar:
        """`compile` on a compile thread at the idle scheduling class (llguidance drops the
        GIL while it builds and walks the grammar, measured in docs/structured_outputs.md).
        A compile over its CPU budget is a StructuredOutputError naming the budget (and so
        is asking again: the refusal is cached); one not done within `wait_s` of wall time
        is refused too, finishes in its thread and is cached for the next ask."""
        with self._lock:
            hit = self._cache.get(spec.key)
        if isinstance(hit, CompiledGrammar):
            return hit
        task = asyncio.get_running_loop().run_in_executor(
            self._compile_executor(), self._compile_on, spec, self.compile_cpus())
        try:
            return await asyncio.wait_for(asyncio.shield(task), wait_s)
        except asyncio.TimeoutError:
            task.add_done_callback(lambda t: t.exception())  # its error, if any, is cached
            raise StructuredOutputError(spec.field, (
                f"compiling the grammar did not finish within {wait_s:g} s (the server is "
                "saturated, or the grammar is too large): try again later, or simplify "
                "it")) from None

    def _compile_on(self, spec: StructuredSpec, cpus: set[int] | None) -> CompiledGrammar:
        """`compile`, with the calling thread held to `cpus` meanwhile. Held to the CPU of
        the engine's step thread, an idle-class compile runs only while that thread is
        off its core (waiting for the GIL, or for its outputs to be taken), never on the
        core of an OpenMP worker, whose wake-ups between a step's parallel regions would
        otherwise each have to preempt it (measured in docs/structured_outputs.md: the
        other streams' p90 token gap 2.4x its quiet value unheld, 1.2-1.3x held)."""
        if not cpus:
            return self.compile(spec)
        allowed = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, ValueError):  # a CPU this process may not use: anywhere, then
            return self.compile(spec)
        try:
            return self.compile(spec)
        finally:
            os.sched_setaffinity(0, allowed)

    def _compile_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The compile threads (two: one slow grammar does not queue the others behind
        it), at the idle scheduling class."""
        with self._lock:
            if self._executor is None:
                self._executor = idle_thread_pool(2, "treadle-grammar")
            return self._executor

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
        # The matcher's construction validates the grammar as well (its error is the
        # validator's message): one compile, not a validation and then a compile.
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
