"""Turns a SchedulerOutput into tensors, runs the model once, and samples.

Input preparation is vectorized with numpy over the flat batch (all scheduled tokens of
all requests concatenated, no padding): the only Python loops run once per request,
never once per token. Attention metadata is built here once per step and shared by every
layer. Logits are computed only for the last scheduled token of requests that sample,
plus, for requests that ask for prompt logprobs, every position of their prompt chunk
(in slices, so a long chunk never holds [chunk, vocab] logits at once).
The runner never decides policy: it computes exactly what it is given.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.outputs import (ModelRunnerOutput, PromptLogprobs, ScheduledRequest,
                                  SchedulerOutput)
from treadle.worker.attention import (AttentionMetadata, DecodeGroup, NativeDecode,
                                     NativePrefill, PrefillSpan, gather_rows)
from treadle.worker.kv_cache import copy_blocks
from treadle.worker.sampler import Sampler, group_order, prompt_logprobs

# Decodes are padded to the longest context of their group. A group holds contexts
# within this factor of its shortest one, which bounds padding waste while keeping the
# number of groups (each a few kernel launches per layer) to about log2(longest/shortest).
_DECODE_GROUP_SPREAD = 2.0
_PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions whose logits are computed at once ([rows, vocab] float32)."""


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[int]
    """Indices into SchedulerOutput.scheduled of the requests that sample, logits order."""


@dataclass
class RunnerTimings:
    """Seconds spent per phase, summed over steps (benchmarks report them)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0


class ModelRunner:
    """Executes one step of the model over the paged KV cache."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 block_size: int, seed: int, kernels=None,
                 swap_caches: list[torch.Tensor] | None = None) -> None:
        """`kernels` (worker.native.NativeKernels) runs decode attention and sampling when given;
        `swap_caches` hold swapped-out blocks (same layout as kv_caches)."""
        self.model = model
        self.kernels = kernels
        self.swap_caches = swap_caches
        self.num_swap_bytes_out = 0
        self.num_swap_bytes_in = 0
        self.kv_caches = kv_caches
        self.block_size = block_size
        _, self.num_kv_heads, self.num_cache_blocks = kv_caches[0].shape[:3]
        self.head_dim = kv_caches[0].shape[-1]
        self.native_prefill = (kernels is not None
                               and kernels.supports_prefill(kv_caches[0].dtype, self.head_dim))
        self.sampler = Sampler(seed, kernels)
        self.eos_token_id: int | None = None
        """The model's end-of-sequence id, masked until a request's min_tokens."""
        self.timings = RunnerTimings()

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedInputs:
        scheduled = scheduler_output.scheduled
        bs = self.block_size
        q_lens = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64,
                             count=len(scheduled))
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64,
                             count=len(scheduled))
        num_tokens = int(q_lens.sum())
        ctx_lens = starts + q_lens
        cu_q = np.cumsum(q_lens)
        row_offsets = cu_q - q_lens

        input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled),
                                dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(row_offsets - starts,
                                                                        q_lens)
        blocks_needed = (ctx_lens + bs - 1) // bs
        block_table = np.zeros((len(scheduled), int(blocks_needed.max())), dtype=np.int64)
        for i, s in enumerate(scheduled):
            block_table[i, :blocks_needed[i]] = s.block_ids[:blocks_needed[i]]
        token_req = np.repeat(np.arange(len(scheduled)), q_lens)
        slot_mapping = block_table[token_req, positions // bs] * bs + positions % bs

        meta = AttentionMetadata(num_tokens=num_tokens,
                                 slot_mapping=torch.from_numpy(slot_mapping))
        decode_rows = np.flatnonzero(q_lens == 1)
        num_decodes = decode_rows.size
        if num_decodes and self.kernels is not None and decode_rows[-1] == num_decodes - 1:
            # The scheduler puts single-token rows first: the kernel reads them in place.
            meta.native_decode = NativeDecode(
                self.kernels, num_decodes,
                torch.from_numpy(np.ascontiguousarray(block_table[:num_decodes])),
                torch.from_numpy(ctx_lens[:num_decodes].copy()))
        elif num_decodes:
            meta.decode_groups = self._decode_groups(decode_rows, row_offsets, ctx_lens,
                                                     block_table)
        prefills = np.flatnonzero(q_lens > 1)
        if prefills.size and self.native_prefill:
            spans = torch.from_numpy(np.stack(
                [row_offsets[prefills], q_lens[prefills], starts[prefills]], axis=1))
            meta.native_prefill = NativePrefill(
                self.kernels, spans, torch.from_numpy(np.ascontiguousarray(block_table[prefills])),
                self.kernels.prefill_workspace(spans, self.num_kv_heads, self.head_dim))
        else:
            for i in prefills:
                meta.prefill_spans.append(self._prefill_span(
                    int(row_offsets[i]), int(starts[i]), int(q_lens[i]), block_table[i]))

        sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
        logits_indices = torch.from_numpy(cu_q[sample_rows] - 1)
        return PreparedInputs(torch.from_numpy(input_ids), torch.from_numpy(positions), meta,
                              logits_indices, sample_rows)

    def _decode_groups(self, rows: np.ndarray, row_offsets: np.ndarray, ctx_lens: np.ndarray,
                       block_table: np.ndarray) -> list[DecodeGroup]:
        bs = self.block_size
        rows = rows[np.argsort(ctx_lens[rows], kind="stable")]
        groups, first = [], 0
        for j in range(1, len(rows) + 1):
            if j == len(rows) or ctx_lens[rows[j]] > _DECODE_GROUP_SPREAD * ctx_lens[rows[first]]:
                groups.append(rows[first:j])
                first = j
        result = []
        for group in groups:
            ctx = ctx_lens[group]
            num_blocks = int((ctx.max() + bs - 1) // bs)
            span = np.arange(num_blocks * bs)
            bias = np.where(span[None, :] < ctx[:, None], 0.0, -np.inf).astype(np.float32)
            result.append(DecodeGroup(
                token_indices=torch.from_numpy(row_offsets[group]),
                gather_ids=torch.from_numpy(self._gather_rows(block_table[group, :num_blocks])),
                num_blocks=num_blocks,
                mask_bias=torch.from_numpy(bias).view(1, len(group), 1, -1)))
        return result

    def _prefill_span(self, row: int, start: int, num_new: int,
                      block_row: np.ndarray) -> PrefillSpan:
        bs = self.block_size
        num_blocks = (start + num_new + bs - 1) // bs
        query_pos = np.arange(start, start + num_new)
        key_pos = np.arange(num_blocks * bs)
        allowed = key_pos[None, :] <= query_pos[:, None]
        bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)
        return PrefillSpan(start=row, end=row + num_new,
                           gather_ids=torch.from_numpy(self._gather_rows(block_row[:num_blocks])),
                           mask_bias=torch.from_numpy(bias), allowed=torch.from_numpy(allowed))

    def _gather_rows(self, block_table: np.ndarray) -> np.ndarray:
        return gather_rows(block_table, self.num_kv_heads, self.num_cache_blocks)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.drop(scheduler_output.finished_request_ids)
        # Swap-outs first: a block freed by a swap-out may be the target of a swap-in.
        if scheduler_output.swap_out:
            self.num_swap_bytes_out += copy_blocks(self.kv_caches, self.swap_caches,
                                                   scheduler_output.swap_out)
        if scheduler_output.swap_in:
            self.num_swap_bytes_in += copy_blocks(self.swap_caches, self.kv_caches,
                                                  scheduler_output.swap_in)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput(sampled_token_ids={})
        t0 = time.perf_counter()
        inputs = self.prepare(scheduler_output)
        t1 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            inputs.attn_metadata)
        scheduled = scheduler_output.scheduled
        sampling = [scheduled[i] for i in inputs.sample_rows]
        # Logits rows in the sampler's group order: it then works in place, copying none.
        order = group_order([s.sampling_params for s in sampling])
        sampling = [sampling[i] for i in order]
        logits = self.model.compute_logits(
            hidden.index_select(0, inputs.logits_indices[order]))
        t2 = time.perf_counter()
        sampled = self.sampler.sample(
            logits, [s.request_id for s in sampling], [s.sampling_params for s in sampling],
            [s.prompt_token_ids for s in sampling], [s.output_token_ids for s in sampling],
            self.eos_token_id)
        prompt_lps = self._prompt_logprobs(scheduled, hidden)
        t3 = time.perf_counter()
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += t3 - t2
        return ModelRunnerOutput(
            sampled_token_ids={s.request_id: t for s, t in zip(sampling, sampled.token_ids)},
            logprobs={s.request_id: e for s, e in zip(sampling, sampled.logprobs)
                      if e is not None},
            prompt_logprobs=prompt_lps)

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor
                         ) -> dict[str, PromptLogprobs]:
        """Prompt logprobs of the prompt positions computed this step, for the requests
        that ask: position j's logits score prompt token j + 1."""
        result = {}
        row = 0
        for s in scheduled:
            num_top = s.sampling_params.prompt_logprobs
            start = s.num_computed_tokens
            end = min(start + len(s.token_ids), len(s.prompt_token_ids) - 1)
            if num_top is not None and end > start:
                entries = []
                for a in range(start, end, _PROMPT_LOGPROBS_ROWS):
                    b = min(end, a + _PROMPT_LOGPROBS_ROWS)
                    logits = self.model.compute_logits(hidden[row + a - start:row + b - start])
                    entries += prompt_logprobs(logits, s.prompt_token_ids[a + 1:b + 1], num_top)
                result[s.request_id] = PromptLogprobs(start + 1, entries)
            row += len(s.token_ids)
        return result
