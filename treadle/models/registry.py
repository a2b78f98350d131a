"""Which model class implements a checkpoint's Hugging Face architecture.

Owns the table from HF architecture names (config.json's `architectures`) to treadle
model classes. It only answers lookups: it never reads files or builds models.
"""

from __future__ import annotations

from torch import nn

from treadle.models.gemma3 import Gemma3ForCausalLM
from treadle.models.llama import LlamaForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODEL_CLASSES)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class of the first supported architecture, or ValueError naming what was asked."""
    for arch in architectures or []:
        if arch in _MODEL_CLASSES:
            return _MODEL_CLASSES[arch]
    asked = ", ".join(architectures) if architectures else "(none given in config.json)"
    raise ValueError(f"unsupported model architecture {asked}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")
