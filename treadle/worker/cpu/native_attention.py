"""The `cpu-native` attention backend: the C kernels of worker/kernels on the CPU.

Owns the step metadata for the kernels and the order of the calls: rotary embedding
fused with the K/V write (`rope_kv`, bf16), decode attention over every single-token row
and every token of the short multi-token rows (speculative verification) in one call
(`paged_decode.c`: no grouping, no padding), and causal prefill attention over every
longer row in one call (`paged_prefill.c`, bf16, head_dim 64/128, and 256 on the builds
without AVX-512 BF16) where torch's attention does not run on AMX tiles
(`prefill_kernel_runs`). Where the prefill kernel or rope_kv does not apply (another
dtype or head size, or AMX), that part runs the `torch` backend's code, with the same
results up to rounding; the decode kernel covers float32 and bf16 (the backend is not
offered otherwise).

Sliding-window layers (Gemma 3's local layers, Mistral; docs/gemma3.md): their decode rows
(the same single-token and short rows) run the decode kernel with its window bound, over
the sliding KV group's block tables when the step has one (AttentionStep.sliding: the
kernel never reads a table entry before a row's window, where that group keeps stale ids
of freed blocks), their K/V written at that group's slots; those rows' tables are made
once per step, by the first sliding layer. Their prefill rows take the prefill kernel
with its window bound over the same tables where the build has it (the widening builds:
AVX-512F and AVX2), else the torch backend's windowed views. Layers with a logit softcap
(neither kernel has one) run the torch backend's code whole.
Layout `heads_first`, the one the kernels read. With `kv_cache_dtype=int8` the same
calls read and write int8 rows (worker/kv_quant.py): rope_kv quantizes as it stores, the
decode and prefill kernels dequantize in registers (prefill: while packing its tiles);
the torch fallbacks (and the soft-capped layers, and the sliding layers' prefill rows)
quantize and dequantize with kv_quant.

Batch-invariant (`batch_invariant=True`, docs/batch_invariance.md): every query token of
the step, decode or prefill, new or after a prefix-cache hit, is a row of the decode
kernel with the context its position sees, and long contexts are cut into ranges of
`DECODE_SPLIT_TOKENS` whatever the batch: one algorithm and one order of the sums over
keys for every row, set by the row's context length alone. The prefill kernel (tiles
that depend on how the prompt is chunked) and the torch paths are not used; the
soft-capped layers that need them are refused at start (treadle/compat.py). Sliding
layers would not need them here (every row is then a decode-kernel row, with its
window), but the sliding KV group is still refused at start (kv_specs/specs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from treadle.worker import kv_quant
from treadle.layers.attention import AttentionLayer, AttentionStep, Rotary
from treadle.worker.attention.base import AttentionBackend, split_rotated
from treadle.worker.attention.torch_backend import (LayerViews, PrefillSpan,
                                                    attend_decode_groups,
                                                    attend_prefill_spans, layer_views,
                                                    prefill_span, write_kv)
from treadle.worker.cpu.native_linear import onednn_uses_amx


SHORT_ROW_TOKENS = 8
"""Multi-token rows of at most this many tokens (a request verifying proposed tokens, a
short chunk) go to the decode kernel, one query token per kernel row, instead of the
prefill kernel: the prefill kernel packs the row's whole context into tiles in every
layer, which a few queries do not repay (docs/speculative.md, "Verification rows": 5
queries over 800 cached tokens took 65 us per layer as decode rows against 96 us in the
prefill kernel; the decode rows read the context once per query, and lose past ~9)."""

DECODE_SPLIT_TOKENS = 256
"""Batch-invariant: the length of the ranges a longer context is cut into (parallel over
threads, merged in order). Fixed, so that a row's sums do not depend on the step; 256
keeps a lone long decode on more than one thread (1,000 tokens: 4 ranges per KV head)
while a range is long enough that the merge costs little. The prefill rows the decode
kernel takes in this mode cost ~1.3x the prefill kernel's time (one layer, a 512-token
prompt, one thread: 5.0 against 3.9 ms; 2,048 tokens: 73 against 53 ms)."""


def prefill_kernel_runs(kernels: Any, dtype: torch.dtype, head_dim: int,
                        window: int | None = None) -> bool:
    """Whether prefill rows take `paged_prefill`: where the build has it for this dtype,
    head size and window (NativeKernels.supports_prefill), unless torch's attention runs
    on AMX tiles here (onednn_uses_amx; ONEDNN_MAX_CPU_ISA below AMX gives the kernel
    back). The kernel was chosen on a Zen 4, without AMX; on a Xeon with AMX torch's
    SDPA took 0.38-0.55x its time per layer call (512-token chunks, 1 thread), and the
    engine prefilled 5-8% faster at 512 tokens and 26-31% at 2,048 (chunks over a longer
    context) with it (docs/benchmarks.md, "The Xeon with AMX again"). Where the kernel
    itself computes on AMX tiles (`prefill_on_amx`), it is the faster one again."""
    if not kernels.supports_prefill(dtype, head_dim, window):
        return False
    return not onednn_uses_amx() or prefill_on_amx(kernels, head_dim, window)


def prefill_on_amx(kernels: Any, head_dim: int, window: int | None = None) -> bool:
    """Whether `paged_prefill` computes on AMX tiles here: the kernel has that path for
    this head size (no window) and AMX is not held off (onednn_uses_amx: the one switch,
    ONEDNN_MAX_CPU_ISA, for every AMX path, ours and oneDNN's)."""
    return window is None and onednn_uses_amx() and kernels.supports_amx_prefill(head_dim)


@dataclass
class NativeDecode:
    """The decode kernel's query tokens: every single-token row, then each token of every
    short multi-token row (a kernel row of its own, with the context its causal position
    sees and its row's block table)."""

    num_rows: int
    block_table: torch.Tensor
    """[num_rows, max_blocks] int64 block tables (padding past each context is not read)."""
    ctx_lens: torch.Tensor
    """[num_rows] int64 context length of each query token, itself included."""
    token_index: torch.Tensor | None = None
    """[num_rows] int64 flat-batch token of each kernel row, or None when they are tokens
    [0, num_rows) (no gather)."""


@dataclass
class NativePrefill:
    """All multi-token rows of a step for the C kernel (worker/cpu/kernels/paged_prefill.c)."""

    spans: torch.Tensor
    """[num_spans, 3] int64: first row in the flat batch, new tokens, positions before."""
    block_tables: torch.Tensor
    """[num_spans, max_blocks] int64."""
    workspace: torch.Tensor
    """Packed K/V buffer, made once per step and reused by every layer."""


@dataclass
class CpuNativeMetadata:
    backend: "CpuNativeBackend"
    slot_mapping: torch.Tensor
    native_decode: NativeDecode | None = None
    native_prefill: NativePrefill | None = None
    prefill_spans: list[PrefillSpan] = field(default_factory=list)
    """Multi-token rows for the torch path, when the prefill kernel does not apply."""
    step: AttentionStep | None = None
    decode_rows: tuple[int, np.ndarray] = (0, np.zeros(0, np.int64))
    """The step's rows in `native_decode`: its single-token rows, and the short
    multi-token rows (indices)."""
    prefill_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """The other multi-token rows (the prefill kernel's, or the torch path's)."""
    torch_views: dict[int | None, LayerViews] = field(default_factory=dict)
    """The torch path's views for soft-capped layers, by window (made on first use: a
    model without such layers never builds them)."""
    window_prefills: dict[int, list[PrefillSpan]] = field(default_factory=dict)
    """The torch path's windowed spans of `prefill_rows` for sliding-window layers, by
    window (made on first use)."""
    _sliding: tuple[NativeDecode | None, torch.Tensor] | None = None
    _window_prefill: NativePrefill | None = None

    def views(self, window: int | None) -> LayerViews:
        if window not in self.torch_views:
            self.torch_views[window] = layer_views(self.step, self.backend.num_kv_heads,
                                                   torch.device("cpu"), window)
        return self.torch_views[window]

    def window_prefill(self, window: int) -> list[PrefillSpan]:
        """The prefill rows' spans for layers with `window` (over the sliding group's
        tables when the step has them: `layer_views`)."""
        if window not in self.window_prefills:
            self.window_prefills[window] = layer_views(
                self.step, self.backend.num_kv_heads, torch.device("cpu"), window,
                self.prefill_rows).prefill_spans if self.prefill_rows.size else []
        return self.window_prefills[window]

    def window_native_prefill(self) -> NativePrefill:
        """`native_prefill` over the sliding group's tables when the step has them (the
        same spans and workspace), for the prefill kernel's windowed calls."""
        sliding, npf = self.step.sliding, self.native_prefill
        if sliding is None:
            return npf
        if self._window_prefill is None:
            self._window_prefill = NativePrefill(npf.spans, torch.from_numpy(
                np.ascontiguousarray(sliding.block_table[self.prefill_rows])), npf.workspace)
        return self._window_prefill

    def sliding(self) -> tuple[NativeDecode | None, torch.Tensor]:
        """The sliding-window layers' decode rows and K/V slots: over the sliding group's
        tables and slots when the step has them (AttentionStep.sliding, as the torch
        path's `layer_views` picks them), else the step's own. Made once per step."""
        if self._sliding is None:
            sliding = self.step.sliding
            if sliding is None:
                self._sliding = self.native_decode, self.slot_mapping
            else:
                nd = _decode_rows(sliding, *self.decode_rows) if self.native_decode else None
                self._sliding = nd, torch.from_numpy(sliding.slot_mapping)
        return self._sliding


class CpuNativeBackend(AttentionBackend):
    """The C decode and prefill kernels, with the torch path for what they do not cover."""

    name = "cpu-native"
    kv_layout = "heads_first"

    def __init__(self, kernels: Any, layer_ops: Any, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 batch_invariant: bool = False) -> None:
        """`kernels`: worker.cpu.native.NativeKernels (decode, prefill); `layer_ops`:
        worker.cpu.native_linear.NativeLayerOps or None (rope_kv, bf16 only);
        batch_invariant: every query token on the decode kernel (see the top)."""
        if not kernels.supports(dtype):
            raise ValueError(f"the C attention kernels do not support {dtype}")
        self.kernels = kernels
        self.layer_ops = layer_ops
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.native_prefill = prefill_kernel_runs(kernels, dtype, head_dim)
        self.prefill_amx = self.native_prefill and prefill_on_amx(kernels, head_dim)
        self.native_window_prefill = (self.native_prefill
                                      and prefill_kernel_runs(kernels, dtype, head_dim, window=1))
        """Whether sliding-window layers' prefill rows take the prefill kernel too."""
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"the C attention kernels do not read kv_cache_dtype="
                             f"{kv_cache_dtype!r} (auto or int8)")
        self.kv_cache_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)
        self.batch_invariant = batch_invariant
        self.decode_split = DECODE_SPLIT_TOKENS if batch_invariant else None
        """The decode kernel's context ranges (None: as the batch suits)."""

    def build_metadata(self, step: AttentionStep, device: torch.device) -> CpuNativeMetadata:
        meta = CpuNativeMetadata(self, torch.from_numpy(step.slot_mapping), step=step)
        num_decodes = step.num_single_token_rows
        multi = np.arange(num_decodes, len(step.query_lens))
        longest = np.inf if self.batch_invariant else SHORT_ROW_TOKENS
        short = multi[step.query_lens[multi] <= longest]
        multi = multi[step.query_lens[multi] > longest]
        meta.decode_rows, meta.prefill_rows = (num_decodes, short), multi
        if num_decodes or short.size:
            meta.native_decode = _decode_rows(step, num_decodes, short)
        if multi.size and self.native_prefill:
            spans = torch.from_numpy(np.ascontiguousarray(np.stack(
                [step.query_starts[multi], step.query_lens[multi], step.num_computed[multi]],
                axis=1)))
            meta.native_prefill = NativePrefill(
                spans, torch.from_numpy(np.ascontiguousarray(step.block_table[multi])),
                self.kernels.prefill_workspace(spans, self.num_kv_heads, self.head_dim))
        else:
            meta.prefill_spans = [prefill_span(step, int(i), self.num_kv_heads, device)
                                  for i in multi]
        return meta

    def forward(self, layer: AttentionLayer, qk: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: CpuNativeMetadata,
                rotary: Rotary | None) -> torch.Tensor:
        views = None
        slots, nd, window = meta.slot_mapping, meta.native_decode, layer.sliding_window
        if layer.logit_softcap is not None:
            # The C kernels have no softcap: these layers take the torch path whole (with
            # its window, reading only the blocks inside each row's).
            if self.batch_invariant:
                raise ValueError("batch_invariant: soft-capped layers run the torch "
                                 "attention path (refused at start)")
            views = meta.views(window)
            if views.slot_mapping is not None:
                slots = views.slot_mapping
        elif window is not None:
            # The decode rows on the kernel with its window bound, over the sliding
            # group's tables; the prefill rows on the prefill kernel with it too where
            # this build has one, else on the torch path's windowed views.
            nd, slots = meta.sliding()
        query = None
        if rotary is not None and self.layer_ops is not None:
            # Rotated queries back, keys rotated and stored with the values; or None.
            query = self.layer_ops.rope_kv(qk, value, rotary.cos, rotary.sin, kv_cache, slots)
        if query is None:
            query, key = split_rotated(layer, qk, rotary)
            write_kv(kv_cache, key, value, slots, self.kv_cache_dtype)
        num_heads, head_dim = layer.num_heads, layer.head_dim
        out = query.new_empty(query.shape[0], num_heads * head_dim)
        if views is not None:
            attend_decode_groups(query, kv_cache, views.decode_groups, out, layer.scale,
                                 layer.logit_softcap, self.kv_cache_dtype)
            attend_prefill_spans(query, kv_cache, views.prefill_spans, out, layer.scale,
                                 layer.logit_softcap, self.kv_cache_dtype)
            return out
        if nd is not None:
            rows, index = nd.num_rows, nd.token_index
            if index is None:  # the kernel rows are tokens [0, rows): in place
                rows_query, rows_out = query[:rows], out[:rows].view(rows, num_heads, head_dim)
            else:
                rows_query = query.index_select(0, index)
                rows_out = query.new_empty(rows, num_heads, head_dim)
            self.kernels.paged_decode(rows_query.contiguous(), kv_cache[0], kv_cache[1],
                                      nd.block_table, nd.ctx_lens, rows_out, layer.scale,
                                      self.decode_split, window)
            if index is not None:
                out.index_copy_(0, index, rows_out.view(rows, -1))
        if window is not None:
            if meta.native_prefill is not None and self.native_window_prefill:
                npf = meta.window_native_prefill()
                self.kernels.paged_prefill(query, kv_cache[0], kv_cache[1], npf.spans,
                                           npf.block_tables, out, npf.workspace, layer.scale,
                                           window)
            else:
                attend_prefill_spans(query, kv_cache, meta.window_prefill(window), out,
                                     layer.scale, kind=self.kv_cache_dtype)
            return out
        npf = meta.native_prefill
        if npf is not None:
            self.kernels.paged_prefill(query, kv_cache[0], kv_cache[1], npf.spans,
                                       npf.block_tables, out, npf.workspace, layer.scale,
                                       amx=self.prefill_amx)
        attend_prefill_spans(query, kv_cache, meta.prefill_spans, out, layer.scale,
                             kind=self.kv_cache_dtype)
        return out


def _decode_rows(step: AttentionStep, num_single: int, short: np.ndarray) -> NativeDecode:
    """The decode kernel's rows: the step's single-token rows, then each token of the
    short multi-token rows `short` with the causal context of its position."""
    lens = step.query_lens[short]
    table = step.block_table[:num_single]
    ctx = step.context_lens[:num_single]
    index = None
    if short.size:
        table = np.concatenate([table, np.repeat(step.block_table[short], lens, axis=0)])
        offsets = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        first = np.repeat(step.query_starts[short], lens) + offsets
        ctx = np.concatenate([ctx, np.repeat(step.num_computed[short], lens) + offsets + 1])
        tokens = np.concatenate([np.arange(num_single), first])
        if not np.array_equal(tokens, np.arange(tokens.size)):
            index = torch.from_numpy(tokens.astype(np.int64))
    return NativeDecode(int(ctx.shape[0]), torch.from_numpy(np.ascontiguousarray(table)),
                        torch.from_numpy(np.ascontiguousarray(ctx, dtype=np.int64)), index)
