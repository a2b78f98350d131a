"""The KV cache's configuration, computed once: which layer groups there are, under which
spec, with how many blocks each, and how many swap blocks.

The engine core derives it from the workers' report (WorkerInfo: the layers' sliding
windows, the blocks the KV memory holds) and the engine's config (`kv_cache_config`), and
hands the same object to every worker (`Executor.initialize_cache(kv_config)`), which
allocates its tensors from it and derives nothing again; the scheduler's KV manager is
built from it too. Feature combinations that only the model's layers reveal (a
sliding-window model under H2O, with a draft model, ...) are checked here, by
treadle/compat.py, the moment the specs are known. No torch here.

How a model's memory splits between full and sliding layers (`layer_groups`): memory is
counted in layer-blocks, num_blocks * num_layers of them. The sliding pool gets what the
most requests the scheduler runs at once can hold (each its window plus two partial
blocks, and together one step's worth of new tokens), and never more than it would
without a window; the full layers get the rest (docs/gemma3.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from treadle.compat import check_kv_specs
from treadle.kv_specs.eviction import EvictionBudget
from treadle.kv_specs.specs import KVSpec, SlidingWindowSpec, primary_spec

if TYPE_CHECKING:
    from treadle.config import EngineConfig


@dataclass(frozen=True)
class LayerGroups:
    """How a model's KV memory splits between its full and its sliding layers."""

    window: int
    num_full_layers: int
    num_sliding_layers: int
    num_full_blocks: int
    """Blocks of the full group (the request-level capacity: every token of a context
    holds one slot there). Without full layers it is bookkeeping only (no tensors)."""
    num_sliding_blocks: int


def layer_groups(layer_windows: Sequence[int | None], num_blocks: int, block_size: int,
                 max_num_seqs: int, max_step_tokens: int,
                 max_model_len: int) -> LayerGroups | None:
    """The two groups' block counts for the memory of `num_blocks` whole-model blocks, or
    None when no layer slides (or the window covers the whole context)."""
    windows = {w for w in layer_windows if w is not None}
    if not windows:
        return None
    if len(windows) > 1:
        raise ValueError(f"layers with different sliding windows {sorted(windows)} are not "
                         "supported (one sliding group)")
    window = windows.pop()
    if window >= max_model_len:
        return None  # the window never cuts anything: plain full attention
    num_layers = len(layer_windows)
    num_sliding = sum(w is not None for w in layer_windows)
    num_full = num_layers - num_sliding
    per_request = -(-(window - 1) // block_size) + 2
    need = max_num_seqs * per_request + -(-max_step_tokens // block_size)
    num_sliding_blocks = min(num_blocks, need)
    if num_full:
        num_full_blocks = (num_blocks * num_layers - num_sliding_blocks * num_sliding) // num_full
    else:  # bookkeeping only: room for every request's whole context, within reason
        contexts = max_num_seqs * -(-max_model_len // block_size)
        num_full_blocks = max(num_blocks, min(contexts, 16 * num_blocks))
    return LayerGroups(window, num_full, num_sliding, num_full_blocks, num_sliding_blocks)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, one block pool and one block table per request."""

    spec: KVSpec
    num_blocks: int
    layers: tuple[int, ...]
    """Whole-model indices of the layers whose KV lives here (none: bookkeeping only, as
    the full group of a model whose every layer slides)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Every layer group of the engine's KV cache (the first: the request-level one)."""

    groups: tuple[KVCacheGroup, ...]
    num_swap_blocks: int
    """Blocks of the swap space (0 when a group cannot be swapped)."""
    num_memory_blocks: int
    """Whole-model blocks the KV memory holds, before any split between groups."""

    @property
    def primary(self) -> KVCacheGroup:
        """The group whose table spans a request's whole context: its block count is the
        engine's context capacity."""
        return self.groups[0]

    @property
    def num_blocks(self) -> int:
        return self.primary.num_blocks

    @property
    def block_size(self) -> int:
        return self.primary.spec.block_size

    @property
    def specs(self) -> tuple[KVSpec, ...]:
        return tuple(g.spec for g in self.groups)

    @property
    def eviction(self) -> EvictionBudget | None:
        """The H2O budget of every request, or None."""
        return self.primary.spec.eviction

    @property
    def sliding(self) -> KVCacheGroup | None:
        """The sliding-window group, or None."""
        return next((g for g in self.groups if isinstance(g.spec, SlidingWindowSpec)), None)

    @property
    def layer_groups(self) -> LayerGroups | None:
        """The split as the scheduler takes it (None: one group)."""
        sliding = self.sliding
        if sliding is None:
            return None
        return LayerGroups(sliding.spec.window, len(self.primary.layers), len(sliding.layers),
                           self.primary.num_blocks, sliding.num_blocks)

    def num_blocks_of_layer(self, layer: int) -> int:
        """Blocks of the KV tensor of whole-model layer `layer` (a layer no group names is
        full attention)."""
        return next((g.num_blocks for g in self.groups if layer in g.layers),
                    self.primary.num_blocks)


def kv_cache_config(config: "EngineConfig", layer_windows: Sequence[int | None],
                    max_model_len: int, num_blocks: int,
                    num_swap_blocks: int) -> KVCacheConfig:
    """The KV config for the memory of `num_blocks` whole-model blocks (and
    `num_swap_blocks` of swap) of a model whose layers have these sliding windows (None:
    full attention); raises ValueError when its specs cannot be combined with the
    configured features (treadle/compat.py)."""
    cache, sched = config.cache, config.scheduler
    primary = primary_spec(cache)
    every_layer = tuple(range(len(layer_windows)))
    split = layer_groups(layer_windows, num_blocks, cache.block_size, sched.max_num_seqs,
                         sched.max_step_tokens, max_model_len)
    if split is None:
        groups = (KVCacheGroup(primary, num_blocks, every_layer),)
    else:
        sliding = SlidingWindowSpec(cache.block_size, cache.kv_cache_dtype, window=split.window)
        groups = (KVCacheGroup(primary, split.num_full_blocks,
                               tuple(i for i in every_layer if layer_windows[i] is None)),
                  KVCacheGroup(sliding, split.num_sliding_blocks,
                               tuple(i for i in every_layer if layer_windows[i] is not None)))
    check_kv_specs(config, [g.spec for g in groups])
    if not all(g.spec.supports_swap for g in groups):
        num_swap_blocks = 0  # such requests are preempted by recompute
    return KVCacheConfig(groups, num_swap_blocks, num_blocks)
