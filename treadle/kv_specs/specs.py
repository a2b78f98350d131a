"""KV specs: what one layer group's KV cache is, and what it can be combined with.

A spec is declared data, no behaviour beyond arithmetic: its block size, what a slot
stores (`cache_dtype`, one of `CACHE_DTYPES`), its block rules (how many tokens of KV a
request holds at most, whether its prompt steps are capped) and its capabilities, each a
class-level flag with the reason when it is False (`why_not`):

- `supports_swap`: a preempted request's blocks can be copied out and back in; without
  it such requests are preempted by recompute (no swap space is allocated).
- `supports_prefix_caching`: full blocks are registered under their prefix hashes.
- `supports_prefix_transfer`: P/D can move a request's prompt KV as prefix blocks.
- `supports_eviction`: heavy-hitter eviction can run beside this group.
- `supports_speculation`: proposed tokens can be written and rolled back.
- `supports_draft_kv`: a draft model's KV (speculative `draft`, `self`) can ride on this
  group's block ids.
- `supports_sharding`: tensor / pipeline parallel ranks can each hold their share.
- `supports_batch_invariance`: a request's logits can be made independent of the batch,
  prefix hits and chunking (`batch_invariant`, docs/batch_invariance.md).

Which manager handles a spec is core/kv/manager.py's registry; which combinations of
specs and features are refused, and with what message, is treadle/compat.py's, read from
these flags. Adding a spec: one class here (or in its own module), its manager, one
registry line. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from treadle.kv_specs.eviction import EvictionBudget

CAPABILITIES = ("swap", "prefix_caching", "prefix_transfer", "eviction", "speculation",
                "draft_kv", "sharding", "batch_invariance")
"""Every capability a spec declares (`supports_<name>`)."""

ATTENTION_BACKENDS = ("cpu-native", "triton", "torch", "reference")
"""The attention backends (worker/attention) a cache dtype may be read by."""


@dataclass(frozen=True)
class CacheDtype:
    """What a cache slot stores for one token's K or V of one KV head (`--kv-cache-dtype`)."""

    name: str
    quantized: bool
    """Rows of 1-byte values and a float16 scale (worker/kv_quant.py), not the model's
    dtype."""
    backends: tuple[str, ...]
    """The attention backends that read and write it."""
    scale_bytes: int = 0
    """Bytes of the per-row scale after the values."""

    def row_bytes(self, head_dim: int, model_itemsize: int) -> int:
        """Bytes one (token, KV head) row of K or V takes."""
        return head_dim + self.scale_bytes if self.quantized else head_dim * model_itemsize


CACHE_DTYPES = {
    "auto": CacheDtype("auto", False, ATTENTION_BACKENDS),
    "int8": CacheDtype("int8", True, ("cpu-native", "torch", "reference"), scale_bytes=2),
    "fp8_e4m3": CacheDtype("fp8_e4m3", True, ("triton", "torch", "reference"),
                           scale_bytes=2),
}
"""`--kv-cache-dtype` choices: `auto` stores the model's dtype; int8 and fp8_e4m3 are
quantized rows (docs/kv_cache_quantization.md). Triton reads fp8 rows of a uint8 cache,
the C kernels int8 rows."""


@dataclass(frozen=True)
class KVSpec:
    """A layer group's KV: full attention over the whole context (the base spec)."""

    block_size: int
    cache_dtype: str = "auto"

    kind: ClassVar[str] = "full attention"
    supports_swap: ClassVar[bool] = True
    supports_prefix_caching: ClassVar[bool] = True
    supports_prefix_transfer: ClassVar[bool] = True
    supports_eviction: ClassVar[bool] = True
    supports_speculation: ClassVar[bool] = True
    supports_draft_kv: ClassVar[bool] = True
    supports_sharding: ClassVar[bool] = True
    supports_batch_invariance: ClassVar[bool] = True
    chunks_prompts: ClassVar[bool] = False
    """Its requests' steps are capped whatever the scheduler's settings (a prompt longer
    than a step's budget runs in chunks even without chunked prefill)."""
    why_not: ClassVar[dict[str, str]] = {}
    """capability -> why this spec lacks it (the second half of compat's message)."""

    def __post_init__(self) -> None:
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(CACHE_DTYPES)}, "
                             f"got {self.cache_dtype!r}")

    @property
    def name(self) -> str:
        """How an error message names it."""
        return self.kind

    @property
    def eviction(self) -> EvictionBudget | None:
        """The eviction budget every request of the group runs under (None: none)."""
        return None

    def supports(self, capability: str) -> bool:
        return getattr(self, f"supports_{capability}")

    def max_tokens_held(self, num_tokens: int) -> int:
        """Tokens of KV a request of `num_tokens` (prompt + max_tokens) holds at most in
        this group's table: its whole context."""
        return num_tokens

    def max_blocks_held(self, num_tokens: int) -> int:
        """Blocks of the above (the can-never-fit check compares it with the pool)."""
        return -(-self.max_tokens_held(num_tokens) // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVSpec):
    """Every layer sees the whole context: a request holds a block per `block_size` tokens."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVSpec):
    """Layers that see only the last `window` positions: blocks that fall out of the window
    are freed (core/kv/sliding.py)."""

    window: int = 0

    kind: ClassVar[str] = "a sliding-window layer group"
    supports_swap: ClassVar[bool] = False
    supports_prefix_transfer: ClassVar[bool] = False
    supports_eviction: ClassVar[bool] = False
    supports_draft_kv: ClassVar[bool] = False
    supports_batch_invariance: ClassVar[bool] = False
    why_not: ClassVar[dict[str, str]] = {
        "swap": "there is no swap plan for its second block table: such requests are "
                "preempted by recompute",
        "batch_invariance": "not tested yet: the mode would run every row of its layers on "
                            "the C decode kernel's window bound, but no test has checked a "
                            "sliding group's logits against the batch",
        "prefix_transfer": "P/D moves one block table's KV and a sliding-window model has a "
                           "second one (Gemma 3, Mistral's sliding_window): serve such a "
                           "model with --replicas instead",
        "eviction": "heavy-hitter eviction compacts one block table, and the sliding layers "
                    "free their blocks by position",
        "draft_kv": "the draft's KV rides on the full-attention layers' block ids, which "
                    "the sliding layers do not share",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    @property
    def name(self) -> str:
        return f"{self.kind} (window {self.window})"


@dataclass(frozen=True)
class H2OSpec(KVSpec):
    """Full attention under heavy-hitter eviction (`--kv-eviction h2o`): a request keeps
    at most `budget.budget_tokens` tokens of KV (kv_specs/eviction.py)."""

    budget: EvictionBudget | None = None

    kind: ClassVar[str] = "kv_eviction h2o"
    supports_prefix_transfer: ClassVar[bool] = False
    supports_speculation: ClassVar[bool] = False
    supports_sharding: ClassVar[bool] = False
    supports_batch_invariance: ClassVar[bool] = False
    chunks_prompts: ClassVar[bool] = True
    why_not: ClassVar[dict[str, str]] = {
        "batch_invariance": "the attention scores that choose the evicted tokens are "
                            "summed by torch's matmuls over each step's chunk, so which "
                            "tokens a request keeps depends on how its prompt was chunked",
        "prefix_transfer": "the decode engine would receive KV without its attention scores",
        "speculation": "rejected proposals would leave scores of tokens that are not the "
                       "request's",
        "sharding": "each rank would see the attention of its own heads or layers only, and "
                    "ranks must evict the same tokens",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is None:
            raise ValueError("H2OSpec needs its eviction budget")

    @property
    def eviction(self) -> EvictionBudget:
        return self.budget

    def max_tokens_held(self, num_tokens: int) -> int:
        """At most its budget, or one step's more (the step before its compaction)."""
        return min(num_tokens, self.budget.budget_tokens + self.budget.max_step_tokens)


def primary_spec(cache) -> KVSpec:
    """The spec of the request-level (full-attention) group a CacheConfig asks for."""
    budget = EvictionBudget.from_cache_config(cache)
    if budget is None:
        return FullAttentionSpec(cache.block_size, cache.kv_cache_dtype)
    return H2OSpec(cache.block_size, cache.kv_cache_dtype, budget=budget)
