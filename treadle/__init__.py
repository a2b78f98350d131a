"""treadle: an LLM inference and serving engine with continuous batching and
out-of-order scheduling.

Public API: LLM, SamplingParams, LoRARequest, EngineConfig (imported lazily so that `core/` and the
command line start without loading torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "LoRARequest", "EngineConfig", "RequestOutput",
           "CompletionOutput"]

if TYPE_CHECKING:  # pragma: no cover
    from treadle.config import EngineConfig
    from treadle.engine.llm import LLM, CompletionOutput, RequestOutput
    from treadle.lora import LoRARequest
    from treadle.sampling_params import SamplingParams

_LAZY = {
    "LLM": "treadle.engine.llm",
    "RequestOutput": "treadle.engine.llm",
    "CompletionOutput": "treadle.engine.llm",
    "SamplingParams": "treadle.sampling_params",
    "LoRARequest": "treadle.lora",
    "EngineConfig": "treadle.config",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)
