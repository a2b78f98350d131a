"""The `reference` attention backend: the plainest correct paged attention, in torch.

One request at a time: its context's keys and values gathered slot by slot through its
block table, scores in float32 with an explicit causal mask, grouped-query heads by
repetition, softmax, weighted sum. No fusion, no padding tricks, no kernels: this is the
oracle every other backend is tested against (tests/integration/test_attention_backends.py),
and a backend that runs on any device torch supports. Slow by design.
Layout `heads_first` (worker/kv_cache.py). With a quantized cache (int8, fp8_e4m3) new
K/V are quantized by worker/kv_quant.py and the context dequantized to float32 before the
same math: the reference of the quantized kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.worker import kv_quant
from treadle.layers.attention import AttentionLayer, AttentionStep, Rotary
from treadle.worker.attention.base import AttentionBackend, split_rotated


@dataclass
class ReferenceMetadata:
    backend: "ReferenceBackend"
    slot_mapping: torch.Tensor
    rows: list[tuple[int, int, int, torch.Tensor]]
    """Per row: first token in the flat batch, new tokens, context length, and the cache
    slot of every context position [context] (int64)."""
    sliding: "ReferenceMetadata | None" = None
    """The same over the sliding-window layers' own tables (AttentionStep.sliding)."""


class ReferenceBackend(AttentionBackend):
    name = "reference"
    kv_layout = "heads_first"

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.kv_cache_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)
        self.quantized = kv_quant.is_quantized(kv_cache_dtype)

    def build_metadata(self, step: AttentionStep, device: torch.device) -> ReferenceMetadata:
        meta = self._rows(step, device)
        if step.sliding is not None:
            meta.sliding = self._rows(step.sliding, device)
        return meta

    def _rows(self, step: AttentionStep, device: torch.device) -> ReferenceMetadata:
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
        if layer.sliding_window is not None and meta.sliding is not None:
            meta = meta.sliding
        query, key = split_rotated(layer, qk, rotary)
        num_kv_heads, num_blocks, block_size, row = kv_cache.shape[1:]
        head_dim = layer.head_dim
        flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, row)
        if self.quantized:
            key = kv_quant.quantize(key, self.kv_cache_dtype)
            value = kv_quant.quantize(value, self.kv_cache_dtype)
        flat[0][:, meta.slot_mapping] = key.transpose(0, 1)
        flat[1][:, meta.slot_mapping] = value.transpose(0, 1)
        group = layer.num_heads // num_kv_heads
        out = query.new_zeros(query.shape[0], layer.num_heads * head_dim)
        window = layer.sliding_window
        for first, num_new, ctx, slots in meta.rows:
            # Keys before the first query's window are never read (their blocks may have
            # been freed and reused: core/kv/sliding.py).
            lo = 0 if window is None else max(0, ctx - num_new - window + 1)
            k, v = flat[0][:, slots[lo:]], flat[1][:, slots[lo:]]
            if self.quantized:
                k = kv_quant.dequantize(k, self.kv_cache_dtype)
                v = kv_quant.dequantize(v, self.kv_cache_dtype)
            k = k.float().repeat_interleave(group, dim=0)  # [heads, ctx', d]
            v = v.float().repeat_interleave(group, dim=0)
            q = query[first:first + num_new].float().transpose(0, 1)  # [heads, new, d]
            scores = q @ k.transpose(1, 2) * layer.scale  # [heads, new, ctx']
            if layer.logit_softcap is not None:
                scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
            q_pos = torch.arange(ctx - num_new, ctx, device=q.device)
            k_pos = torch.arange(lo, ctx, device=q.device)[None, :]
            allowed = k_pos <= q_pos[:, None]
            if window is not None:
                allowed &= k_pos > q_pos[:, None] - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v  # [heads, new, d]
            out[first:first + num_new] = o.transpose(0, 1).reshape(num_new, -1).to(out.dtype)
        return out
