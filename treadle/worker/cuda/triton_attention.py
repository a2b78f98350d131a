"""The `triton` attention backend: the Triton kernels of worker/cuda/triton/ behind the backend
interface.

Owns the step's metadata for those kernels (built once per step from the runner's
`AttentionStep`: cumulative query offsets, context lengths and block tables as int32
device tensors, the slots, how many leading rows are single-token rows, the decode
split count) and the per-layer call: rotate, write K/V (`write_kv`), attend
(`paged_attention`: the decode kernel on the single-token rows, the prefill kernel on the
rest). Layout `blocks_first` (worker/kv_cache.py; docs/gpu.md says why). Runs on a GPU, or
on the CPU under TRITON_INTERPRET=1 (tests only: the interpreter is slow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treadle.layers.attention import AttentionLayer, AttentionStep, Rotary
from treadle.worker.attention.base import AttentionBackend, split_rotated


@dataclass
class TritonMetadata:
    backend: "TritonBackend"
    slot_mapping: torch.Tensor
    """[tokens] int64 cache slot of each new token."""
    query_start_loc: torch.Tensor
    """[rows + 1] int32: first token of each row, then the token count."""
    seq_lens: torch.Tensor
    """[rows] int32 context length of each row, its new tokens included."""
    block_tables: torch.Tensor
    """[rows, max_blocks] int32."""
    num_decodes: int
    """Leading rows with one new token (the decode kernel's)."""
    num_splits: int
    """The decode kernel's split-K factor for this step."""
    sliding: "TritonMetadata | None" = None
    """The same over the sliding-window layers' own tables (AttentionStep.sliding)."""


class TritonBackend(AttentionBackend):
    name = "triton"
    kv_layout = "blocks_first"

    def __init__(self, num_kv_heads: int, num_multiprocessors: int) -> None:
        from treadle.worker.cuda import triton as kernels

        self.kernels = kernels
        self.num_kv_heads = num_kv_heads
        self.num_multiprocessors = num_multiprocessors

    def build_metadata(self, step: AttentionStep, device: torch.device) -> TritonMetadata:
        rows = len(step.query_lens)
        starts = np.empty(rows + 1, dtype=np.int32)
        starts[:rows] = step.query_starts
        starts[rows] = step.num_tokens
        context = step.context_lens
        num_decodes = step.num_single_token_rows
        num_splits = 1
        if num_decodes:
            num_splits = self.kernels.choose_num_splits(
                num_decodes, self.num_kv_heads, int(context[:num_decodes].max()),
                self.num_multiprocessors)

        def put(array: np.ndarray, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(
                device, non_blocking=True)

        meta = TritonMetadata(self, put(step.slot_mapping, np.int64), put(starts, np.int32),
                              put(context, np.int32), put(step.block_table, np.int32),
                              num_decodes, num_splits)
        if step.sliding is not None:
            meta.sliding = self.build_metadata(step.sliding, device)
        return meta

    def forward(self, layer: AttentionLayer, qk: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: TritonMetadata,
                rotary: Rotary | None) -> torch.Tensor:
        if layer.logit_softcap is not None:
            raise ValueError("the triton attention backend has no attention logit softcapping "
                             "(attn_logit_softcapping); use --attention-backend torch")
        if layer.sliding_window is not None and meta.sliding is not None:
            meta = meta.sliding
        query, key = split_rotated(layer, qk, rotary)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.kernels.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = query.new_empty(query.shape)
        self.kernels.paged_attention(query, key_cache, value_cache, meta.block_tables,
                                     meta.query_start_loc, meta.seq_lens, layer.scale,
                                     num_decodes=meta.num_decodes,
                                     num_splits=meta.num_splits, out=out,
                                     sliding_window=layer.sliding_window)
        return out.view(query.shape[0], -1)


def build_triton_backend(platform: Any, num_kv_heads: int) -> TritonBackend | None:
    """The backend, or None where it cannot run: triton missing, or a platform where the
    kernels need triton's interpreter (the CPU) not under it."""
    try:
        from treadle.worker.cuda.triton.common import interpreting
    except ImportError:
        return None
    if platform.triton_needs_interpreter and not interpreting():
        return None
    return TritonBackend(num_kv_heads, platform.num_multiprocessors())
