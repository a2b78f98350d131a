"""EngineLimits: the fixed sizes a request must fit, read from an engine in one place.

Owns the read-only figures the layers above check a request against before handing it
to the engine (the server's 400s, the offline API's per-prompt errors, the OpenAPI
schema's bounds): the vocabulary, the context length and the whole KV cache. Filled
once from an EngineCore by `from_core`, the one function that knows where the core
keeps them. It decides nothing and holds no engine reference.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    max_model_len: int
    """Most prompt + output tokens of one request (the context)."""
    num_kv_tokens: int
    """Token slots of the whole KV cache (blocks x block_size): prompt + output of one
    request (each of its n samples) must fit in it."""
    block_size: int
    """Tokens per KV block."""

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + max_tokens one request may ask for: the context, or less when the
        whole KV cache is smaller."""
        return min(self.max_model_len, self.num_kv_tokens)

    @classmethod
    def from_core(cls, core) -> "EngineLimits":
        """The limits of an EngineCore (the only place that reads the core's fields)."""
        block_size = core.config.cache.block_size
        return cls(vocab_size=int(core.vocab_size), max_model_len=int(core.max_model_len),
                   num_kv_tokens=int(core.num_kv_blocks) * block_size, block_size=block_size)
