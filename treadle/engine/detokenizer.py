"""Incremental detokenization and stop strings, one generated sequence at a time.

Owns turning a growing list of token ids into text deltas that concatenate to exactly the
full decode, and finding stop strings in that text. `IncrementalDetokenizer` decodes a
short window of tokens each step (the offsets method of TGI and vLLM) and holds text back
while it ends in an incomplete UTF-8 character (U+FFFD), so a character split across
tokens (CJK, emoji, byte-fallback tokens) is released whole. `StopStringMatcher` finds
stop strings even when they span tokens and holds back any tail of the text that could
still become one. Neither touches the engine: they see token ids and text only.

What "the full decode" is: `tokenizer.decode(prompt + output)` minus the prompt's text,
decoded without clean-up of tokenization spaces. For byte-level BPE tokenizers (GPT-2,
Llama 3, SmolLM, the demo model) that is exactly `tokenizer.decode(output)`; for
SentencePiece-style tokenizers it keeps the leading space of the first generated word,
which decoding the output alone would strip.
"""

from __future__ import annotations

from typing import Callable, Sequence

_PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded with the first output tokens (leading spaces, merges)."""
_REPLACEMENT = "\ufffd"


def make_decode(tokenizer, skip_special_tokens: bool,
                spaces_between_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
    """A fast `ids -> text` for this tokenizer: the Rust tokenizer directly when there is
    one (no Python-side clean-up), else `tokenizer.decode` without clean-up. With special
    tokens kept and `spaces_between_special_tokens` false, two consecutive added tokens
    are joined without whatever separator the decoder puts between them (vLLM's
    semantics: its fast detokenizer emits the second one's raw text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        def decode(ids):
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    else:
        def decode(ids):
            return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)
    if skip_special_tokens or spaces_between_special_tokens:
        return decode
    added = frozenset(getattr(tokenizer, "added_tokens_decoder", None) or ())
    if not added:
        return decode
    return lambda ids: _decode_joining_added(decode, list(ids), added)


def _decode_joining_added(decode, ids: list[int], added: frozenset) -> str:
    """decode(ids) with no separator between consecutive added tokens: the ids are cut
    between every such pair and the pieces decoded on their own."""
    cuts = [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
    if not cuts:
        return decode(ids)
    bounds = [0, *cuts, len(ids)]
    return "".join(decode(ids[a:b]) for a, b in zip(bounds, bounds[1:]))


class IncrementalDetokenizer:
    """Text deltas of one sequence of generated tokens."""

    def __init__(self, decode: Callable[[Sequence[int]], str],
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt cut inside a character: decode the output on its own
        self._tokens: list[int] = context
        self._prefix_offset = 0
        """Start of the window decoded each step (context for the tokens after it)."""
        self._read_offset = len(context)
        """Tokens before this one have been released as text."""
        self._prefix_text = decode(context) if context else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now complete (possibly "")."""
        if not token_ids:
            return ""
        self._tokens.extend(token_ids)
        text = self._decode(self._tokens[self._prefix_offset:])
        if text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text):
            return ""  # an incomplete character at the end (or nothing visible yet)
        return self._advance(text)

    def flush(self) -> str:
        """The text still held back, as the full decode shows it (the sequence ended)."""
        if self._read_offset == len(self._tokens):
            return ""
        text = self._decode(self._tokens[self._prefix_offset:])
        if len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        return delta


class StopStringMatcher:
    """Stop strings over a growing text; releases only text that cannot start a match."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool) -> None:
        self.stops = list(stops)
        self.include = include_stop_str_in_output
        self.text = ""
        """Everything fed so far (cut at the end of the output once a stop matched)."""
        self.num_released = 0
        self.matched: str | None = None

    def feed(self, delta: str, check: bool = True) -> str:
        """Add text; return the text released by it. With check=False (min_tokens not yet
        reached) no stop string can match, but text is still held back."""
        if self.matched is not None or not delta:
            return ""
        start = len(self.text)
        self.text += delta
        if check and self.stops:
            self._match(start)
        if self.matched is not None:
            end = len(self.text)
        else:
            end = len(self.text) - (0 if self.include else self._held_back())
        released = self.text[self.num_released:end]
        self.num_released = max(self.num_released, end)
        return released

    def flush(self) -> str:
        """Release what was held back (the sequence ended without a match)."""
        released = self.text[self.num_released:]
        self.num_released = len(self.text)
        return released

    def _match(self, new_start: int) -> None:
        """The earliest stop string that ends in the new text, if any."""
        best = None
        for stop in self.stops:
            i = self.text.find(stop, max(0, new_start - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            self.matched = stop
            self.text = self.text[:i + len(stop) if self.include else i]

    def _held_back(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop."""
        text = self.text
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
