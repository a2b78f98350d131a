"""`LoRAConfig` and `SpeculativeConfig`: adapters beside the base model, and
speculative decoding's method and its keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from treadle.config.values import _help


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters beside the base model (docs/lora.md)."""

    enable_lora: bool = field(default=False, metadata=_help(
        "Serve LoRA adapters (PEFT format) beside the base model"))
    max_loras: int = field(default=1, metadata=_help(
        "Adapters resident at once (the worker's slots): at most this many distinct "
        "adapters run in one step"))
    max_lora_rank: int = field(default=16, metadata=_help(
        "Highest adapter rank accepted; an adapter above it is refused when loaded"))
    max_cpu_loras: int | None = field(default=None, metadata=_help(
        "Adapters kept in host memory, least recently used evicted (>= max_loras; "
        "max_loras when not given)"))

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


SPEC_METHODS = ("ngram", "draft", "self")
_SPEC_METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft": ("model",),
                     "self": ("draft_layers",)}
"""The keys only one method takes."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens and how many. Given as one JSON object
    (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`,
    `LLM(speculative_config={...})`) whose keys are these fields; docs/speculative.md."""

    method: str | None = field(default=None, metadata=_help(
        "ngram (prompt lookup), draft (a smaller checkpoint, key model) or self (the "
        "model's own first draft_layers layers); not given: no speculation"))
    num_speculative_tokens: int = field(default=4, metadata=_help(
        "Most tokens proposed per request per step (the adaptive policy may run fewer)"))
    prompt_lookup_min: int | None = field(default=None, metadata=_help(
        "ngram: shortest suffix of the request's tokens matched against its earlier "
        "tokens (default 2)"))
    prompt_lookup_max: int | None = field(default=None, metadata=_help(
        "ngram: longest suffix matched; the longest match wins (default 4)"))
    model: str | None = field(default=None, metadata=_help(
        "draft: checkpoint directory of the draft model (same tokenizer as the target)"))
    draft_layers: int | None = field(default=None, metadata=_help(
        "self: the target's first layers that, with its final norm and LM head, draft"))
    adaptive: bool = field(default=True, metadata=_help(
        "Choose each request's number of proposed tokens per step from its measured "
        "acceptance and the measured step-cost model; false: always the most that fit"))
    acceptance_prior: float = field(default=0.5, metadata=_help(
        "Acceptance rate assumed before any proposal is verified; after that, a new "
        "request starts from the engine's recent acceptance over all requests"))

    def __post_init__(self) -> None:
        if self.method is None:
            given = [f.name for f in dataclasses.fields(self)
                     if f.name != "method" and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"speculative_config: {given[0]} given without a method; "
                                 f"method must be one of {', '.join(SPEC_METHODS)}")
            return
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(SPEC_METHODS)}, got {self.method!r}")
        for other, keys in _SPEC_METHOD_KEYS.items():
            for key in keys:
                if other != self.method and getattr(self, key) is not None:
                    raise ValueError(f"speculative_config: {key} is a key of method "
                                     f"{other}, not of {self.method}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an "
                             f"integer in [1, 16], got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, "
                             f"got {self.adaptive!r}")
        prior = self.acceptance_prior
        if (not isinstance(prior, (int, float)) or isinstance(prior, bool)
                or not 0.0 < prior < 1.0):
            raise ValueError(f"speculative_config: acceptance_prior must be in (0, 1), "
                             f"got {prior!r}")
        if self.method == "ngram":
            lo = 2 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(4, lo) if self.prompt_lookup_max is None else self.prompt_lookup_max
            for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                    raise ValueError(f"speculative_config: {key} must be an integer in "
                                     f"[1, 64], got {value!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.method == "draft":
            if not self.model or not isinstance(self.model, str):
                raise ValueError("speculative_config: method draft needs model, the draft "
                                 "checkpoint's directory")
        else:
            layers = self.draft_layers
            if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
                raise ValueError(f"speculative_config: method self needs draft_layers, an "
                                 f"integer >= 1, got {layers!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def writes_kv_ahead(self) -> bool:
        """Whether its proposer runs a model that writes KV past the request's computed
        tokens (draft, self): the scheduler then holds slots for the proposals."""
        return self.method in ("draft", "self")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig":
        """From a dict or a JSON object string (None or '': speculation off). An unknown
        key is a ValueError naming it."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, str):
            if not value.strip():
                return cls()
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)

    def keys_help(self) -> str:
        return "; ".join(f"{f.name}: {f.metadata['help']}" for f in dataclasses.fields(self))


