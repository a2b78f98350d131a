"""`CacheConfig`: the KV cache (size, block, dtype, prefix caching, swap, eviction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.config.values import AUTO, parse_size, _help


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block"))
    kv_cache_memory: int | str = field(default="auto", metadata=_help(
        "Bytes of KV cache, e.g. 4GiB, or auto: max_num_seqs x max_model_len tokens of the "
        "model's KV, at most a quarter of the memory available at start (cgroup limits "
        "included; docs/memory.md); ignored when num_kv_blocks is given"))
    num_kv_blocks: int | None = field(default=None, metadata=_help(
        "Exact number of KV-cache blocks; overrides kv_cache_memory"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Reuse the KV blocks of identical prompt prefixes across requests"))
    contiguous_blocks: bool = field(default=True, metadata=_help(
        "Give each request a run of consecutive never-used KV blocks, sized for its prompt "
        "and max_tokens, to grow into (others take it back before any cached block is "
        "evicted): attention reads its context in long runs"))
    swap_space: int | str = field(default="auto", metadata=_help(
        "Bytes of host memory for the KV of requests preempted by swap, e.g. 1GiB, or "
        "auto: half the KV cache, at most an eighth of the memory available at start; "
        "reserved when first used"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "GPU: fraction of the card's memory this engine may use (weights, activations "
        "and KV cache); the KV cache gets what a profiling step leaves (kv_cache_memory "
        "is the CPU's)"))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "What the KV cache stores: auto (the model's dtype), int8 (a scale per token and "
        "KV head) or fp8_e4m3 (emulated on CPU); docs/kv_cache_quantization.md"))
    kv_eviction: str = field(default="none", metadata=_help(
        "none, or h2o: a request keeps its kv_recent_tokens most recent tokens plus the "
        "heavy hitters by accumulated attention, at most kv_budget_tokens in all "
        "(docs/kv_cache_quantization.md)"))
    kv_budget_tokens: int | None = field(default=None, metadata=_help(
        "kv_eviction h2o: the most tokens of KV a request holds"))
    kv_recent_tokens: int | None = field(default=None, metadata=_help(
        "kv_eviction h2o: the most recent tokens always kept (half the budget when not "
        "given)"))

    def __post_init__(self) -> None:
        self._check_eviction()
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be one of auto, int8, fp8_e4m3, "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("kv_cache_memory", "swap_space"):  # a byte count, or "auto"
            value = getattr(self, name)
            if not (isinstance(value, str) and value.strip().lower() == AUTO):
                object.__setattr__(self, name, parse_size(value, name))
            else:
                object.__setattr__(self, name, AUTO)
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def _check_eviction(self) -> None:
        if self.kv_eviction not in ("none", "h2o"):
            raise ValueError(f"kv_eviction must be one of none, h2o, got {self.kv_eviction!r}")
        budget, recent = self.kv_budget_tokens, self.kv_recent_tokens
        if self.kv_eviction == "none":
            for name in ("kv_budget_tokens", "kv_recent_tokens"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is given without kv_eviction h2o")
            return
        if budget is None:
            raise ValueError("kv_eviction h2o needs kv_budget_tokens (the most tokens of "
                             "KV a request holds)")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 4:
            raise ValueError(f"kv_budget_tokens must be an int >= 4, got {budget!r}")
        if recent is None:
            object.__setattr__(self, "kv_recent_tokens", budget // 2)
        elif isinstance(recent, bool) or not isinstance(recent, int) or not \
                1 <= recent <= budget - 2:
            raise ValueError(f"kv_recent_tokens must be an int in [1, kv_budget_tokens - 2 "
                             f"= {budget - 2}], got {recent!r}")


