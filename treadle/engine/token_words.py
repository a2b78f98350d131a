"""`bad_words` and DRY's `dry_sequence_breakers` as token ids, made with the served tokenizer
before a request enters the engine.

Owns `TokenWords`, one per front end (the EngineDriver, the server's serving object):
`resolve(params)` returns the parameters with `tokenized` set (treadle/sampling_params.py
TokenizedWords), which the worker's sampler reads; `check(params)` raises the errors
`resolve` would, without the expensive part. The rules:

* bad_words (vLLM's): each word, stripped of leading spaces, is encoded on its own and
  with one leading space; the spaced form is kept when it is a different word of the
  same number of tokens. A word of spaces alone is encoded as it is (vLLM fails on it).
  A word that encodes to no token is refused.
* DRY's sequence breakers (llama.cpp's): a token whose text contains a breaker breaks a
  repetition on its own (an empty tail); a token whose text ends with the start of a
  breaker is a head, and the rest of the breaker, encoded (at most 20 tokens), its tail.
  This scans the decoded vocabulary once per distinct breaker list (kept in a small LRU);
  the vocabulary's text is decoded once, on first use (about half a second for 49152
  ids), so the server calls `resolve` off its event loop.

Pure functions of the tokenizer: no engine, no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from treadle.sampling_params import SamplingParams, TokenizedWords

MAX_BREAKER_TAIL_TOKENS = 20
"""llama.cpp's cap on a breaker's tail (keeps its backwards scan linear)."""
_BREAKER_CACHE = 32
"""Distinct breaker lists whose processed form is kept."""


class TokenWords:
    """bad_words and DRY breakers -> token ids for one tokenizer (None: a model without
    one, where neither can be served). Thread-safe."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._vocab_texts: list[str] | None = None
        self._breakers: OrderedDict[tuple[str, ...], dict] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, params: SamplingParams) -> None:
        """ValueError (starting with the field's name) when `resolve` would fail."""
        if not params.needs_tokenized_words:
            return
        if self.tokenizer is None:
            field = "bad_words" if params.bad_words else "dry_multiplier"
            raise ValueError(f"{field}: this model has no tokenizer, so its words cannot "
                             "be turned into token ids")
        self.bad_words(params.bad_words or [])

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """`params` with `tokenized` set (itself when nothing needs it)."""
        if not params.needs_tokenized_words:
            return params
        self.check(params)
        breakers = self.dry_breakers(params.dry_sequence_breakers) if params.uses_dry else {}
        return replace(params, tokenized=TokenizedWords(
            tuple(self.bad_words(params.bad_words or [])), breakers))

    # ----- bad_words --------------------------------------------------------------------------

    def bad_words(self, words: list[str]) -> list[tuple[int, ...]]:
        """vLLM's token sequences of `words` (see the module docstring)."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            if not word.strip():  # spaces alone: banned as they are (vLLM fails on them)
                plain = self._encode(word)
                if not plain:
                    raise ValueError(f"bad_words: {word!r} has no tokens")
                sequences.append(plain)
                continue
            plain = self._encode(word.lstrip())
            if not plain:
                raise ValueError(f"bad_words: {word!r} has no tokens")
            sequences.append(plain)
            spaced = self._encode(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False)) if text else ()

    # ----- DRY's sequence breakers ----------------------------------------------------------

    def dry_breakers(self, breakers: list[str]) -> dict[int, tuple[tuple[int, ...], ...]]:
        """Head token -> tails, for a list of breaker strings (cached)."""
        key = tuple(breakers)
        with self._lock:
            cached = self._breakers.get(key)
            if cached is not None:
                self._breakers.move_to_end(key)
                return cached
            texts = self._texts()
        heads: dict[int, set[tuple[int, ...]]] = {}
        for breaker in breakers:
            for token_id, tail in self._overlaps(texts, breaker):
                heads.setdefault(token_id, set()).add(tail)
        processed = {t: tuple(sorted(tails)) for t, tails in sorted(heads.items())}
        with self._lock:
            self._breakers[key] = processed
            while len(self._breakers) > _BREAKER_CACHE:
                self._breakers.popitem(last=False)
        return processed

    def _texts(self) -> list[str]:
        """Every token's text, special tokens included (decoded once)."""
        if self._vocab_texts is None:
            ids = [[i] for i in range(len(self.tokenizer))]
            self._vocab_texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
        return self._vocab_texts

    def _overlaps(self, texts: list[str], breaker: str):
        """(token id, tail) for each token that holds `breaker` (tail ()) or ends with a
        proper prefix of it (tail: the rest of the breaker, encoded)."""
        first = breaker[0]
        tails: dict[str, tuple[int, ...]] = {}
        for token_id, text in enumerate(texts):
            if first not in text:
                continue
            if breaker in text:
                yield token_id, ()
                continue
            pos = text.find(first)
            while pos >= 0:
                rest = text[pos:]
                if breaker.startswith(rest):
                    remainder = breaker[len(rest):]
                    if remainder not in tails:
                        tails[remainder] = self._encode(remainder)[:MAX_BREAKER_TAIL_TOKENS]
                    yield token_id, tails[remainder]
                pos = text.find(first, pos + 1)
