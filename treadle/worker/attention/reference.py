"""The `reference` attention backend: the plainest correct paged attention, in torch.

One request at a time: its context's keys and values gathered slot by slot through its
block table, scores in float32 with an explicit causal mask, grouped-query heads by
repetition, softmax, weighted sum. No fusion, no padding tricks, no kernels: this is the
oracle every other backend is tested against (tests/integration/test_attention_backends.py),
and a backend that runs on any device torch supports. Slow by design.
Layout `heads_first` (worker/kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.worker.attention.base import (AttentionBackend, AttentionLayer, AttentionStep,
                                           Rotary, split_rotated)


@dataclass
class ReferenceMetadata:
    backend: "ReferenceBackend"
    slot_mapping: torch.Tensor
    rows: list[tuple[int, int, int, torch.Tensor]]
    """Per row: first token in the flat batch, new tokens, context length, and the cache
    slot of every context position [context] (int64)."""


class ReferenceBackend(AttentionBackend):
    name = "reference"
    kv_layout = "heads_first"

    def build_metadata(self, step: AttentionStep, device: torch.device) -> ReferenceMetadata:
        bs = step.block_size
        rows = []
        for i in range(len(step.query_lens)):
            ctx = int(step.context_lens[i])
            positions = np.arange(ctx)
            slots = step.block_table[i, positions // bs] * bs + positions % bs
            rows.append((int(step.query_starts[i]), int(step.query_lens[i]), ctx,
                         torch.from_numpy(slots).to(device)))
        return ReferenceMetadata(self, torch.from_numpy(step.slot_mapping).to(device), rows)

    def forward(self, layer: AttentionLayer, qk: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: ReferenceMetadata,
                rotary: Rotary | None) -> torch.Tensor:
        query, key = split_rotated(layer, qk, rotary)
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
        flat[0][:, meta.slot_mapping] = key.transpose(0, 1)
        flat[1][:, meta.slot_mapping] = value.transpose(0, 1)
        group = layer.num_heads // num_kv_heads
        out = query.new_zeros(query.shape[0], layer.num_heads * head_dim)
        for first, num_new, ctx, slots in meta.rows:
            k = flat[0][:, slots].float().repeat_interleave(group, dim=0)  # [heads, ctx, d]
            v = flat[1][:, slots].float().repeat_interleave(group, dim=0)
            q = query[first:first + num_new].float().transpose(0, 1)  # [heads, new, d]
            scores = q @ k.transpose(1, 2) * layer.scale  # [heads, new, ctx]
            q_pos = torch.arange(ctx - num_new, ctx, device=q.device)
            allowed = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v  # [heads, new, d]
            out[first:first + num_new] = o.transpose(0, 1).reshape(num_new, -1).to(out.dtype)
        return out
