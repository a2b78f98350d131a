"""The attention a model calls, and the step geometry it is computed over.

A model calls one `AttentionLayer` per decoder layer with un-rotated queries and keys,
the values, its layer's KV-cache tensor and the step's metadata, and gets the attention
output back. Which code runs is the backend's business (worker/attention/): the runner
builds the metadata once per step from an `AttentionStep` (the step's per-row lengths and
block tables, in the runner's row order), and the metadata carries its backend, which
rotates queries and keys (or fuses that with its write), stores the new keys and values
at their slots, and attends every token to its context.

A layer may carry a sliding window (Mistral, Gemma 3's local layers: a query sees only
the last `sliding_window` positions, itself included) and a logit softcap (Gemma 2/3
configs that set `attn_logit_softcapping`); every backend honours both or refuses them.

This module knows no backend, no cache layout and no device: a model never indexes a
cache tensor, and nothing here imports the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


class Rotary(Protocol):
    """The step's rotary angles (layers.rotary.RotaryInputs)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class AttentionStep:
    """One step's attention geometry on the host, one row per scheduled request.

    Rows are in the runner's order: every row with a single query token first
    (`num_single_token_rows` of them), then the rest; tokens of a row are contiguous in
    the flat batch, rows one after another.
    """

    query_lens: np.ndarray
    """[rows] int64: tokens computed this step per row."""
    query_starts: np.ndarray
    """[rows] int64: first token of each row in the flat batch."""
    num_computed: np.ndarray
    """[rows] int64: tokens in the cache before this step (the position of the row's
    first token)."""
    block_table: np.ndarray
    """[rows, max_blocks] int64: each row's blocks (entries past its context unread)."""
    slot_mapping: np.ndarray
    """[tokens] int64: cache slot (block * block_size + offset) of each new token."""
    num_single_token_rows: int
    block_size: int
    num_cache_blocks: int
    sliding: "AttentionStep | None" = None
    """The same step over the sliding-window layers' tables and cache (core/kv/sliding.py:
    their own block ids, slots and block count), or None when they share the main ones."""

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def context_lens(self) -> np.ndarray:
        return self.num_computed + self.query_lens


class AttentionLayer:
    """The attention of one model layer: its head geometry, and the call into the backend.

    Not a torch module: it has no parameters, and its backend comes with each step's
    metadata."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_index: int = 0, sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, "
                             f"got {sliding_window!r}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"attn_logit_softcapping must be > 0 or None, got {logit_softcap!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        """A query at position p sees keys p - sliding_window + 1 .. p (None: all)."""
        self.logit_softcap = logit_softcap
        """Scores become softcap * tanh(scores / softcap) before the softmax (None: off)."""

    def __call__(self, qk: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: Any, rotary: Rotary | None = None) -> torch.Tensor:
        """qk: [tokens, num_heads + num_kv_heads, head_dim] (queries, then keys) before
        rotation; value: [tokens, num_kv_heads, head_dim]. Returns [tokens, num_heads *
        head_dim].

        When the runner set an `observer` on the metadata (heavy-hitter eviction,
        worker/h2o.py) it sees the queries and the cache after the backend's write."""
        observer = getattr(meta, "observer", None)
        if observer is None:
            return meta.backend.forward(self, qk, value, kv_cache, meta, rotary)
        query = qk[:, :self.num_heads].clone()  # a backend may rotate qk in place
        out = meta.backend.forward(self, qk, value, kv_cache, meta, rotary)
        observer.observe(self, query, kv_cache, rotary)
        return out
