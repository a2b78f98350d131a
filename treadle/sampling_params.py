"""SamplingParams: how one request's tokens are chosen and when it stops.

Owns validation: every bad value is a ValueError naming the field and its allowed range.
It knows nothing about models, tokenizers or batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    """Per-request sampling controls (names and meanings follow vLLM and the OpenAI API)."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to top_p."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Seed of this request's own random generator (reproducible sampling)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (the token is kept in the output)."""
    n: int = 1
    """Number of samples per prompt (only 1 is supported so far)."""

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, low=0.0, high=100.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=_MAX_SEED)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[]", token_id, low=0)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("n", self.n, low=1, high=1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
