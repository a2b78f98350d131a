"""A checkpoint's tokenizer (transformers), or None when it has none.

Used by the front ends (LLM, AsyncEngine) and by the worker's grammar state. It never
tokenizes on its own: callers do.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in _TOKENIZER_FILES)


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files.

    Without one, the engine still runs on token ids (as vLLM's skip_tokenizer_init);
    string prompts are then refused and output text is empty.
    """
    if not has_tokenizer(model_dir):
        logger.warning("no tokenizer files in %s: prompts must be token ids", model_dir)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))
