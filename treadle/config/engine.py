"""`EngineConfig`: every area's config in one object, built from keyword options and
TREADLE_* environment variables; feature combinations are checked by treadle/compat.py."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from treadle.config.values import _flag_type, SPECULATIVE_OPTION, ENV_PREFIX
from treadle.compat import check_config
from treadle.config.kv_events import KVEventsConfig
from treadle.config.model import ModelConfig
from treadle.config.cache import CacheConfig
from treadle.config.scheduler import SchedulerConfig
from treadle.config.parallel import ParallelConfig
from treadle.config.lora_spec import LoRAConfig, SpeculativeConfig


def _from_env(f: dataclasses.Field, text: str) -> Any:
    kind = _flag_type(str(f.type))
    if kind is None:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()} must be true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()} must be a {kind.__name__}, "
                         f"got {text!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, one section per area."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Given whole, as the one option `speculative_config` (a dict or JSON string)."""
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    """KV-cache events in vLLM's format (treadle/config/kv_events.py)."""

    _SECTIONS = ("model", "cache", "scheduler", "parallel", "lora", "kv_events")

    def __post_init__(self) -> None:
        check_config(self)  # feature combinations (treadle/compat.py)

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "parallel": ParallelConfig, "lora": LoRAConfig, "kv_events": KVEventsConfig}

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (`model=..., block_size=16, ...`); options not
        given come from TREADLE_<NAME> environment variables when set (ENV_PREFIX).

        An unknown option is a TypeError naming it, as a wrong keyword argument would be.
        `speculative_config` (a SpeculativeConfig, dict or JSON string) is the
        speculative section whole.
        """
        options = dict(options)
        speculative = options.pop(SPECULATIVE_OPTION, None)
        if speculative is None:
            speculative = os.environ.get(ENV_PREFIX + SPECULATIVE_OPTION.upper())
        per_section: dict[str, dict[str, Any]] = {name: {} for name in cls._SECTIONS}
        fields = {f.name: (section, f) for section, section_type in cls.section_types().items()
                  for f in dataclasses.fields(section_type)}
        for key, value in options.items():
            if key not in fields:
                raise TypeError(f"unknown engine option {key!r}; known: {sorted(fields)}")
            per_section[fields[key][0]][key] = value
        for name, (section, f) in fields.items():
            text = os.environ.get(ENV_PREFIX + name.upper())
            if name not in options and text is not None:
                per_section[section][name] = _from_env(f, text)
        return cls(**{name: cls.section_types()[name](**kwargs)
                      for name, kwargs in per_section.items()},
                   speculative=SpeculativeConfig.parse(speculative))


