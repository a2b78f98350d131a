"""EngineLimits: the fixed sizes a request must fit, and the one rule that checks them.

Owns the read-only figures a request is checked against (the vocabulary, the context
length, the whole KV cache under its spec's block rules, the step budget when prompts
cannot be chunked) and `length_error`, the rule itself: the engine core's admission check
(EngineCore.admission_error) and the layers above it (the server's 400s, the offline
API's per-prompt errors, the OpenAPI schema's bounds) all ask it, so they cannot
disagree. Filled once from an EngineCore by `from_core`, the one function that knows
where the core keeps them. It decides nothing else and holds no engine reference; it is
plain data (it crosses to Ray replicas as it is).
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.kv_specs.specs import FullAttentionSpec, KVSpec, primary_spec


@dataclass(frozen=True)
class LimitError:
    """Why a request of this size can never run."""

    field: str
    """The request field at fault: prompt or max_tokens."""
    limit: str
    """Which limit: context, kv_cache or step."""
    message: str
    """Starts with `field: ` (the server's 400 names it)."""


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    max_model_len: int
    """Most prompt + output tokens of one request (the context)."""
    num_kv_tokens: int
    """Token slots of the whole KV cache (blocks x block_size) of the request-level
    layer group."""
    block_size: int
    """Tokens per KV block."""
    kv_spec: KVSpec | None = None
    """The request-level group's spec: how many tokens of KV a request holds at most
    (all of them; H2O: its budget and one step)."""
    max_prompt_tokens: int | None = None
    """Most prompt tokens when a prompt cannot be split across steps (chunked prefill
    off): max_num_batched_tokens; None: any."""

    def __post_init__(self) -> None:
        if self.kv_spec is None:
            object.__setattr__(self, "kv_spec", FullAttentionSpec(self.block_size))

    @property
    def num_kv_blocks(self) -> int:
        return self.num_kv_tokens // self.block_size

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + max_tokens one request may ask for: the context, or less when the
        whole KV cache cannot hold what a request of that size keeps."""
        if self.kv_spec.max_blocks_held(self.max_model_len) <= self.num_kv_blocks:
            return self.max_model_len
        return min(self.max_model_len, self.num_kv_tokens)

    def length_error(self, num_prompt: int, max_tokens: int) -> LimitError | None:
        """Why a request of `num_prompt` prompt tokens and `max_tokens` output tokens (per
        sample) can never run, or None if it can."""
        total = num_prompt + max_tokens
        sizes = f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total}"
        if total > self.max_model_len:
            name = "prompt" if num_prompt >= self.max_model_len else "max_tokens"
            return LimitError(name, "context", f"{name}: {sizes} exceeds the model's context "
                                               f"length of {self.max_model_len} tokens")
        blocks = self.kv_spec.max_blocks_held(total)
        if blocks > self.num_kv_blocks:
            name = ("prompt" if self.kv_spec.max_blocks_held(num_prompt + 1) > self.num_kv_blocks
                    else "max_tokens")
            held = self.kv_spec.max_tokens_held(total)
            kept = (f", of which a request keeps at most {held} ({self.kv_spec.name})"
                    if held < total else "")
            return LimitError(name, "kv_cache", (
                f"{name}: {sizes} tokens{kept}, needs {blocks} KV blocks, more than the whole "
                f"KV cache of {self.num_kv_blocks} blocks ({self.num_kv_tokens} tokens)"))
        if self.max_prompt_tokens is not None and num_prompt > self.max_prompt_tokens:
            return LimitError("prompt", "step", (
                f"prompt: prompt ({num_prompt} tokens) exceeds max_num_batched_tokens "
                f"({self.max_prompt_tokens}) and chunked prefill is disabled"))
        return None

    @classmethod
    def from_config(cls, config, vocab_size: int, max_model_len: int,
                    num_kv_blocks: int) -> "EngineLimits":
        """The limits of an engine of this EngineConfig whose request-level KV group has
        `num_kv_blocks` blocks."""
        cache, sched = config.cache, config.scheduler
        spec = primary_spec(cache)
        chunked = sched.enable_chunked_prefill or spec.chunks_prompts
        return cls(vocab_size=int(vocab_size), max_model_len=int(max_model_len),
                   num_kv_tokens=int(num_kv_blocks) * cache.block_size,
                   block_size=cache.block_size, kv_spec=spec,
                   max_prompt_tokens=None if chunked else sched.max_num_batched_tokens)

    @classmethod
    def from_core(cls, core) -> "EngineLimits":
        """The limits of an EngineCore (the only place that reads the core's fields)."""
        return cls.from_config(core.config, core.vocab_size, core.max_model_len,
                               core.num_kv_blocks)
