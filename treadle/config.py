"""Engine configuration: one frozen dataclass per area, aggregated by EngineConfig.

Every knob of the engine is a field here with a one-line help text in its metadata;
the command-line flags of `treadle generate`, `treadle serve` and the benchmarks are
generated from these fields (`add_config_arguments`), and `LLM(model=..., **options)`
accepts the same names as keyword arguments (`EngineConfig.from_options`).
This module validates values; it never loads a model or allocates memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(value: int | str, field_name: str) -> int:
    """Parse a byte count such as 4294967296, '4GiB', '512MiB' or '2GB'."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        num_bytes = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{field_name} must be a byte count like 4GiB, 512MiB or 1000000, got {value!r}")
        num_bytes = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if num_bytes < 0:
        raise ValueError(f"{field_name} must be >= 0 bytes, got {value!r}")
    return num_bytes


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how to run it."""

    model: str | None = field(default=None, metadata=_help(
        "Hugging Face checkpoint directory; the built-in demo model when not given"))
    dtype: str = field(default="auto", metadata=_help(
        "float32, bfloat16 or auto (bfloat16 where the CPU supports it, else float32)"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "Longest prompt + output in tokens; the checkpoint's max_position_embeddings when not given"))
    seed: int = field(default=0, metadata=_help(
        "Seed of the engine's random generator for requests without their own seed"))
    num_threads: int | None = field(default=None, metadata=_help(
        "CPU threads for the model's math; torch's default when not given"))
    attention_backend: str = field(default="auto", metadata=_help(
        "native (C kernel built on first use), torch, or auto (native when it builds)"))

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "native", "torch"):
            raise ValueError("attention_backend must be one of auto, native, torch, "
                             f"got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block"))
    kv_cache_memory: int | str = field(default=2 * 1024**3, metadata=_help(
        "Bytes of KV cache, e.g. 4GiB (ignored when num_kv_blocks is given)"))
    num_kv_blocks: int | None = field(default=None, metadata=_help(
        "Exact number of KV-cache blocks; overrides kv_cache_memory"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Reuse the KV blocks of identical prompt prefixes across requests"))
    swap_space: int | str = field(default=1024**3, metadata=_help(
        "Bytes of swap memory for the KV of requests preempted by swap, e.g. 1GiB"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory",
                           parse_size(self.kv_cache_memory, "kv_cache_memory"))
        object.__setattr__(self, "swap_space", parse_size(self.swap_space, "swap_space"))
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling budgets."""

    max_num_batched_tokens: int = field(default=512, metadata=_help(
        "Token budget of one engine step (prefill chunks plus decodes)"))
    max_num_seqs: int = field(default=128, metadata=_help(
        "Most requests that run in one engine step"))
    enable_chunked_prefill: bool = field(default=True, metadata=_help(
        "Split prompts longer than the remaining budget across steps"))
    preemption_mode: str = field(default="auto", metadata=_help(
        "recompute, swap, or auto (the cheaper per victim by measured costs)"))
    preemption_cooldown_steps: int = field(default=8, metadata=_help(
        "Steps after resuming during which a request is not preempted again if avoidable"))
    victim_priority_weight: float = field(default=1000.0, metadata=_help(
        "Victim loss per priority level, in tokens (docs/scheduling.md)"))
    victim_wait_weight: float = field(default=100.0, metadata=_help(
        "Victim loss per second spent in the engine, in tokens (docs/scheduling.md)"))

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError("preemption_mode must be one of auto, recompute, swap, "
                             f"got {self.preemption_mode!r}")
        if self.preemption_cooldown_steps < 0:
            raise ValueError("preemption_cooldown_steps must be >= 0, "
                             f"got {self.preemption_cooldown_steps}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, one section per area."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    _SECTIONS = ("model", "cache", "scheduler")

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (`model=..., block_size=16, ...`).

        An unknown option is a TypeError naming it, as a wrong keyword argument would be.
        """
        per_section: dict[str, dict[str, Any]] = {name: {} for name in cls._SECTIONS}
        owners = {f.name: section for section, section_type in cls.section_types().items()
                  for f in dataclasses.fields(section_type)}
        for key, value in options.items():
            if key not in owners:
                raise TypeError(f"unknown engine option {key!r}; known: {sorted(owners)}")
            per_section[owners[key]][key] = value
        return cls(**{name: cls.section_types()[name](**kwargs)
                      for name, kwargs in per_section.items()})


def _flag_type(annotation: str):
    if "bool" in annotation:
        return None
    if "str" in annotation:
        return str
    if "int" in annotation:
        return int
    if "float" in annotation:
        return float
    return str


def add_config_arguments(parser: argparse.ArgumentParser,
                         skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per config field (underscores become dashes)."""
    for section, section_type in EngineConfig.section_types().items():
        group = parser.add_argument_group(f"{section} options")
        for f in dataclasses.fields(section_type):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if _flag_type(str(f.type)) is None:
                group.add_argument(flag, dest=f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            else:
                group.add_argument(flag, dest=f.name, default=None,
                                   type=_flag_type(str(f.type)), help=help_text)


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config options given on the command line (flags left unset are omitted)."""
    names = {f.name for section_type in EngineConfig.section_types().values()
             for f in dataclasses.fields(section_type)}
    return {name: value for name, value in vars(args).items()
            if name in names and value is not None}
