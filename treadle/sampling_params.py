"""SamplingParams: how one request's tokens are chosen and when it stops.

Owns validation: every bad value is a ValueError whose message starts with the field's
name and states the allowed range (the server turns it into a 400 naming the parameter).
It knows nothing about models, tokenizers or batches; the one check that needs the
vocabulary (`token_id_error`) takes its size as an argument. The two string lists that
act on token ids (`bad_words`, `dry_sequence_breakers`) are turned into ids by the front
end (treadle/engine/token_words.py) and carried in `tokenized`; the worker reads those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from treadle.structured.spec import StructuredSpec

_MAX_SEED = 2**63 - 1
_GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (1 / T would overflow float32 logits)."""
MAX_LOGPROBS = 20
"""Most alternatives per token that `logprobs` and `prompt_logprobs` may ask for."""
ALL_LOGPROBS = -1
"""prompt_logprobs: the whole vocabulary's log-probabilities, as an array (offline)."""
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_N = 128
MAX_BAD_WORDS = 128
MAX_DRY_BREAKERS = 64
MAX_DRY_BREAKER_CHARS = 40
"""llama.cpp's bound on a sequence breaker's length (it truncates; treadle refuses)."""
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")
"""llama.cpp's default `dry_sequence_breakers`."""
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class TokenizedWords:
    """`bad_words` and `dry_sequence_breakers` as the served tokenizer writes them (made by
    treadle/engine/token_words.py before the request enters the engine)."""

    bad_words: tuple[tuple[int, ...], ...] = ()
    """Each banned word as token ids, with and without a leading space (vLLM's)."""
    dry_breakers: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Head token -> the token tails that complete a breaker after it (llama.cpp's
    processed breakers); an empty tail: the head token alone breaks a repetition."""


@dataclass
class SamplingParams:
    """Per-request sampling controls (names and meanings follow vLLM and the OpenAI API).

    Order of application to the model's raw logits, as in vLLM: logit_bias,
    allowed_token_ids, bad_words, min_tokens masking, penalties (repetition, frequency,
    presence), DRY -> temperature -> top_k -> top_p -> min_p -> XTC -> sample. Logprobs
    always come from the raw logits, before any of these.
    """

    max_tokens: int = 16
    """Most tokens to generate; 0 (only with prompt_logprobs) scores the prompt and
    generates nothing."""
    temperature: float = 1.0
    """0 (or anything below 1e-5, as in vLLM) means greedy; higher flattens the
    distribution."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability adds up to top_p."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token; 0 keeps all."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or output: logit / p if positive, logit * p otherwise (1: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that appears in the output so far."""
    frequency_penalty: float = 0.0
    """Times each token's count in the output so far, subtracted from its logit."""
    seed: int | None = None
    """Seed of this request's own random generator (reproducible sampling). With n > 1,
    sample i uses seed + i (mod 2**63)."""
    min_tokens: int = 0
    """EOS, stop_token_ids and stop strings cannot end generation before this many tokens."""
    stop: list[str] | str | None = None
    """Strings that end generation; the text ends before the match (see
    include_stop_str_in_output). Stored as a list."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (the token is kept in token_ids)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    logprobs: int | None = None
    """Return the chosen token's logprob and this many most likely alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token, its logprob and this many alternatives (0..20); -1
    (offline only, vLLM's convention for "all"): every position's log-probabilities over
    the whole vocabulary, as one float16 array (RequestOutput.prompt_logprob_array)."""
    n: int = 1
    """Number of independent samples of the prompt (they share the prompt's KV blocks)."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling ({token_id: bias})."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    structured_outputs: StructuredSpec | None = None
    """A grammar the output must match (treadle.structured): JSON schema, regex, choice
    or EBNF/Lark; the sampler masks every token the grammar does not allow."""
    speculative: bool = True
    """Let the engine speculate on this request's tokens when it has a proposer
    (`speculative_config`); false opts this request out (its outputs are the same either
    way: verification is exact). Requests with XTC are never speculated on."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (vLLM's); None: any."""
    bad_words: list[str] | None = None
    """Words that are never generated (vLLM's): each word's tokens, with and without a
    leading space; the last token of a word is banned whenever the output so far ends
    with the word's other tokens."""
    spaces_between_special_tokens: bool = True
    """With skip_special_tokens=False: false joins two consecutive special (added) tokens
    without the separator a tokenizer's decoder may put between them (vLLM's)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this many prompt tokens (vLLM's); None: the whole prompt."""
    cache_salt: str | None = None
    """Salts this request's prefix-cache hashes (vLLM's): only requests with the same
    salt (and tenant) share cached prompt blocks."""
    dry_multiplier: float = 0.0
    """DRY (llama.cpp's "don't repeat yourself"): a token that would extend a repetition
    of n >= dry_allowed_length tokens of the history loses
    dry_multiplier * dry_base ** (n - dry_allowed_length) from its logit; 0: off."""
    dry_base: float = 1.75
    """DRY's growth of the penalty per repeated token beyond dry_allowed_length."""
    dry_allowed_length: int = 2
    """DRY: repetitions up to this many tokens are not penalized."""
    dry_penalty_last_n: int | None = None
    """DRY looks at the last this many tokens of prompt + output (None: all; 0: off)."""
    dry_sequence_breakers: list[str] = field(
        default_factory=lambda: list(DEFAULT_DRY_BREAKERS))
    """Strings a DRY repetition never extends across (llama.cpp's default)."""
    xtc_probability: float = 0.0
    """XTC (llama.cpp's "exclude top choices"): at each token, with this probability,
    every token at least xtc_threshold likely except the least likely of them is removed
    (when two or more are); 0: off."""
    xtc_threshold: float = 0.1
    """XTC: the probability from which a token counts as a top choice (above 0.5: off)."""
    tokenized: TokenizedWords | None = field(default=None, repr=False, compare=False)
    """bad_words and dry_sequence_breakers as token ids (engine/token_words.py)."""

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=0)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs, to score "
                             "a prompt), got 0")
        _check_number("temperature", self.temperature, low=0.0, high=100.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=100.0,
                      low_open=True)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=_MAX_SEED)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        self.stop = _check_stop(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None and self.prompt_logprobs != ALL_LOGPROBS:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_N)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if (self.structured_outputs is not None
                and not isinstance(self.structured_outputs, StructuredSpec)):
            raise ValueError("structured_outputs must be a treadle.structured.StructuredSpec, "
                             f"got {type(self.structured_outputs).__name__}")
        self._check_extensions()

    def _check_extensions(self) -> None:
        """vLLM's extension fields, DRY and XTC."""
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_ids("allowed_token_ids", self.allowed_token_ids)
        self.bad_words = _check_strings("bad_words", self.bad_words, MAX_BAD_WORDS)
        if not isinstance(self.spaces_between_special_tokens, bool):
            raise ValueError("spaces_between_special_tokens must be a bool, got "
                             f"{self.spaces_between_special_tokens!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not
                                            1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} "
                             f"characters, got {self.cache_salt!r}")
        _check_number("dry_multiplier", self.dry_multiplier, low=0.0, high=100.0)
        _check_number("dry_base", self.dry_base, low=1.0, high=100.0)
        _check_int("dry_allowed_length", self.dry_allowed_length, low=0, high=1_000_000)
        if self.dry_penalty_last_n is not None:
            _check_int("dry_penalty_last_n", self.dry_penalty_last_n, low=0)
        breakers = _check_strings("dry_sequence_breakers", self.dry_sequence_breakers,
                                  MAX_DRY_BREAKERS, MAX_DRY_BREAKER_CHARS)
        if not breakers:
            raise ValueError("dry_sequence_breakers must hold 1 to "
                             f"{MAX_DRY_BREAKERS} strings, got none")
        self.dry_sequence_breakers = breakers
        _check_number("xtc_probability", self.xtc_probability, low=0.0, high=1.0)
        _check_number("xtc_threshold", self.xtc_threshold, low=0.0, high=1.0)
        if self.xtc_probability > 0 and self.is_greedy:
            raise ValueError("xtc_probability must be 0 with greedy sampling (temperature "
                             f"0), got {self.xtc_probability}: XTC removes the most likely "
                             "token, which is the one greedy sampling takes")
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            raise ValueError("allowed_token_ids cannot be combined with structured outputs "
                             "(a grammar, or a tool choice it enforces): the two masks could "
                             "leave no token to sample")
        if self.tokenized is not None and not isinstance(self.tokenized, TokenizedWords):
            raise ValueError("tokenized must be a TokenizedWords, got "
                             f"{type(self.tokenized).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def uses_dry(self) -> bool:
        """Whether the DRY penalty applies (a multiplier and a history to look at)."""
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def uses_xtc(self) -> bool:
        """Whether XTC can remove tokens (llama.cpp: a threshold above 0.5 never does)."""
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    @property
    def allows_speculation(self) -> bool:
        """Whether the engine may speculate on this request: XTC draws a second random
        number per token, which verification of proposed tokens does not reproduce."""
        return self.speculative and not self.uses_xtc

    @property
    def needs_tokenized_words(self) -> bool:
        """Whether bad_words or DRY's breakers still need the tokenizer."""
        return self.tokenized is None and bool(self.bad_words or self.uses_dry)

    def token_id_error(self, vocab_size: int) -> str | None:
        """Why this request's token ids do not fit a vocabulary of `vocab_size`, or None."""
        bad = next((t for t in self.logit_bias or () if t >= vocab_size), None)
        if bad is not None:
            return (f"logit_bias has token id {bad}, outside the vocabulary "
                    f"[0, {vocab_size})")
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            return (f"stop_token_ids has token id {bad}, outside the vocabulary "
                    f"[0, {vocab_size})")
        bad = next((t for t in self.allowed_token_ids or () if t >= vocab_size), None)
        if bad is not None:
            return (f"allowed_token_ids has token id {bad}, outside the vocabulary "
                    f"[0, {vocab_size})")
        return None

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an n > 1 request: n=1, seed + index."""
        seed = None if self.seed is None else (self.seed + index) % (_MAX_SEED + 1)
        return replace(self, n=1, seed=seed, stop=list(self.stop),
                       stop_token_ids=list(self.stop_token_ids))


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_number(name: str, value: object, low: float, high: float,
                  low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_ids(name: str, ids: object) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{name} must be a non-empty list of token ids, got {ids!r}")
    for token_id in ids:
        _check_int(name, token_id, low=0)
    return list(ids)


def _check_strings(name: str, values: object, max_count: int,
                   max_chars: int | None = None) -> list[str] | None:
    if values is None:
        return None
    if not isinstance(values, (list, tuple)) or len(values) > max_count:
        raise ValueError(f"{name} must be a list of at most {max_count} strings, "
                         f"got {values!r}")
    for value in values:
        if not isinstance(value, str) or not value or (max_chars and len(value) > max_chars):
            limit = f"1 to {max_chars} characters" if max_chars else "non-empty"
            raise ValueError(f"{name} must hold strings of {limit}, got {value!r}")
    return list(values)


def _check_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain non-empty strings, got {s!r}")
    return list(stops)


def _check_logit_bias(logit_bias: object) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                         f"got {len(logit_bias)}")
    checked = {}
    for key, bias in logit_bias.items():
        token_id = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        if (not isinstance(bias, (int, float)) or isinstance(bias, bool)
                or not math.isfinite(bias) or not -100.0 <= bias <= 100.0):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} "
                             f"for token {token_id}")
        checked[token_id] = float(bias)
    return checked
