"""The attention-backend interface: KV layout, per-step metadata, the K/V write, attention.

A model calls `layers.attention.AttentionLayer` with the step's metadata; the runner
builds that metadata once per step with `AttentionBackend.build_metadata` from a
`layers.attention.AttentionStep`, and the metadata carries its backend, whose `forward`
the layer calls. A backend owns its cache layout (`kv_layout`, one of
`kv_cache.KV_LAYOUTS`), so a model never indexes a cache tensor. `reference` (pure
torch, one request at a time) is the oracle every other backend is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from treadle.layers.attention import AttentionLayer, AttentionStep, Rotary


class AttentionBackend(ABC):
    """One way of computing paged attention."""

    name: str
    kv_layout: str
    """The cache layout it reads and writes (worker.kv_cache.KV_LAYOUTS)."""

    @abstractmethod
    def build_metadata(self, step: AttentionStep, device: torch.device) -> Any:
        """Everything every layer needs for this step (made once, shared by all layers);
        it has a `backend` attribute pointing back here."""

    @abstractmethod
    def forward(self, layer: AttentionLayer, qk: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any, rotary: Rotary | None) -> torch.Tensor:
        """Rotate, store the new K/V at their slots, attend; see AttentionLayer.__call__."""


def split_rotated(layer: AttentionLayer, qk: torch.Tensor, rotary: Rotary | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [tokens, heads, dim] and keys [tokens, kv_heads, dim], rotated together (one
    set of kernels for both)."""
    if rotary is not None:
        qk = rotary.apply(qk)
    return qk[:, :layer.num_heads], qk[:, layer.num_heads:]
