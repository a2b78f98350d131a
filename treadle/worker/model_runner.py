"""Turns a step message into tensors, runs the model once, and samples.

Owns the step's rows: it applies the message to its persistent batch
(worker/input_batch.py), orders the scheduled requests itself (single-token rows first,
which the decode kernels read as one contiguous block; then multi-token rows: prompt
chunks, recomputes, and tokens followed by proposed ones), and builds the flat batch with
numpy (all scheduled tokens of all requests concatenated, no padding; Python loops run
once per request, never once per token). The attention backend turns the step's
geometry into its metadata once per step, shared by every layer. Logits are computed only
for the rows that sample: a request's last scheduled token, or with proposed tokens each
of them and the token before (the proposals are verified against what the model samples
there: the longest agreeing prefix is kept, then one token of the model's own), plus,
for requests that ask for prompt logprobs, every position of their prompt chunk (in
slices, so a long chunk never holds [chunk, vocab] logits at once).

With pipeline parallelism every stage applies every message (its layers need the same
metadata); the first stage embeds and sends its activations to the next, a later stage
receives them first, and only the last computes logits. With tensor parallelism the
logits are gathered to the stage's first rank, the output rank, which alone samples and
answers (worker/parallel_state.py); the other ranks return None.

The runner never decides policy: it computes exactly what it is given.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.outputs import (ModelRunnerOutput, PromptLogprobs, ScheduledRequest,
                                  SchedulerOutput, StepTimings, TokenLogprobs)
from treadle.worker.attention import AttentionBackend, AttentionStep
from treadle.worker.grammar import GrammarState
from treadle.worker.input_batch import CachedRequestState, InputBatch
from treadle.worker.kv_cache import copy_blocks
from treadle.worker.parallel_state import ParallelContext
from treadle.worker.sampler import Sampler, group_order, prompt_logprobs

_PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions whose logits are computed at once ([rows, vocab] float32)."""


@dataclass
class _Row:
    """One scheduled request in the runner's order."""

    scheduled: ScheduledRequest
    state: CachedRequestState
    first_token: int
    """Its first token in the flat batch."""


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    rows: list[_Row]
    logits_indices: np.ndarray
    """Flat-batch tokens whose logits are sampled, one per sampling position."""
    sample_rows: list[tuple[int, int]]
    """Per entry of logits_indices: (row, index among that row's sampling positions)."""


class ModelRunner:
    """Executes one step of the model over the paged KV cache."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 attention: AttentionBackend, block_size: int, num_cache_blocks: int,
                 max_model_len: int, sampler: Sampler, device: torch.device,
                 swap_caches: list[torch.Tensor] | None = None, block_dim: int = 2,
                 eos_token_id: int | None = None,
                 parallel: ParallelContext | None = None,
                 grammar: GrammarState | None = None) -> None:
        """`swap_caches` hold swapped-out blocks (same layout as kv_caches); `grammar` the
        structured-output state (the output rank's)."""
        self.model = model
        self.parallel = parallel or ParallelContext()
        self.grammar = grammar
        self.kv_caches = kv_caches
        self.swap_caches = swap_caches
        self.attention = attention
        self.block_size = block_size
        self.num_cache_blocks = num_cache_blocks
        self.block_dim = block_dim
        self.device = device
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        """The model's end-of-sequence id, masked until a request's min_tokens."""
        self.batch = InputBatch(-(-max_model_len // block_size))

    # ----- preparing the inputs ------------------------------------------------------------

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedInputs:
        states = self.batch.update(scheduler_output)
        pairs = list(zip(scheduler_output.scheduled, states))
        # Single-token rows first: the decode kernels read them as one block of rows.
        pairs.sort(key=lambda p: p[0].num_scheduled_tokens > 1)
        num_rows = len(pairs)
        q_lens = np.fromiter((s.num_scheduled_tokens for s, _ in pairs), dtype=np.int64,
                             count=num_rows)
        starts = np.fromiter((s.num_computed_tokens for s, _ in pairs), dtype=np.int64,
                             count=num_rows)
        num_tokens = int(q_lens.sum())
        cu_q = np.cumsum(q_lens)
        row_offsets = cu_q - q_lens
        input_ids = np.fromiter(
            itertools.chain.from_iterable(self._row_tokens(s, st) for s, st in pairs),
            dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(row_offsets - starts,
                                                                        q_lens)
        bs = self.block_size
        blocks_needed = (starts + q_lens + bs - 1) // bs
        table_rows = np.fromiter((st.row for _, st in pairs), dtype=np.int64, count=num_rows)
        block_table = self.batch.block_table[table_rows, :int(blocks_needed.max())]
        token_rows = np.repeat(np.arange(num_rows), q_lens)
        slot_mapping = block_table[token_rows, positions // bs] * bs + positions % bs

        step = AttentionStep(q_lens, row_offsets, starts, block_table, slot_mapping,
                             int(np.count_nonzero(q_lens == 1)), bs, self.num_cache_blocks)
        meta = self.attention.build_metadata(step, self.device)

        rows = [_Row(s, st, int(off)) for (s, st), off in zip(pairs, row_offsets)]
        logits_indices, sample_rows = [], []
        for i, row in enumerate(rows):
            s = row.scheduled
            if not s.sample:
                continue
            num_positions = len(s.spec_token_ids) + 1
            last = row.first_token + s.num_scheduled_tokens - 1
            for j in range(num_positions):
                logits_indices.append(last - num_positions + 1 + j)
                sample_rows.append((i, j))
        to_device = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        return PreparedInputs(to_device(input_ids), to_device(positions), meta, rows,
                              np.asarray(logits_indices, dtype=np.int64), sample_rows)

    @staticmethod
    def _row_tokens(scheduled: ScheduledRequest, state: CachedRequestState) -> list[int]:
        """The tokens a row computes: known tokens from its position, then any proposed."""
        start = scheduled.num_computed_tokens
        num_known = scheduled.num_scheduled_tokens - len(scheduled.spec_token_ids)
        tokens = state.token_ids(start, start + num_known)
        return tokens + scheduled.spec_token_ids if scheduled.spec_token_ids else tokens

    # ----- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.sampler.drop(scheduler_output.finished_request_ids)
        if self.grammar is not None:
            self.grammar.drop(scheduler_output.finished_request_ids)
        timings = StepTimings()
        # Swap-outs first: a block freed by a swap-out may be the target of a swap-in.
        t_swap = time.perf_counter()
        if scheduler_output.swap_out:
            timings.swap_bytes_out = copy_blocks(self.kv_caches, self.swap_caches,
                                                 scheduler_output.swap_out, self.block_dim)
        if scheduler_output.swap_in:
            timings.swap_bytes_in = copy_blocks(self.swap_caches, self.kv_caches,
                                                scheduler_output.swap_in, self.block_dim)
        timings.swap_s = time.perf_counter() - t_swap
        par = self.parallel
        if not scheduler_output.scheduled:
            self.batch.update(scheduler_output)
            return (ModelRunnerOutput(sampled_token_ids={}, timings=timings)
                    if par.is_output_rank else None)
        t0 = time.perf_counter()
        inputs = self.prepare(scheduler_output)
        rows, sample_rows = inputs.rows, inputs.sample_rows
        # Logits rows in the sampler's group order: it then works in place, copying none.
        order = group_order([rows[i].state.sampling_params for i, _ in sample_rows])
        sample_rows = [sample_rows[k] for k in order]
        if par.is_output_rank and self.grammar is not None:
            self.grammar.start(self._grammar_positions(rows, sample_rows))  # fills meanwhile
        t1 = time.perf_counter()
        received = None
        if not par.is_first_stage:
            received = par.recv_prev_stage((inputs.positions.shape[0], self.model.hidden_size),
                                           self.model.dtype)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            inputs.attn_metadata, received)
        if not par.is_last_stage:
            par.send_next_stage(hidden)
            return None
        indices = torch.from_numpy(inputs.logits_indices[order]).to(hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, indices))
        t2 = time.perf_counter()
        prompt_lps = self._prompt_logprobs(rows, hidden)
        if not par.is_output_rank:
            return None
        output = self._sample(logits, rows, sample_rows)
        output.prompt_logprobs = prompt_lps
        t3 = time.perf_counter()
        timings.prepare_s, timings.forward_s, timings.sample_s = t1 - t0, t2 - t1, t3 - t2
        timings.comm_s = par.take_comm_seconds()
        output.timings = timings
        return output

    @staticmethod
    def _grammar_positions(rows: list[_Row], sample_rows: list[tuple[int, int]]) -> list:
        """The sampling positions of constrained requests, for GrammarState.start: a
        request's first position before those after its proposed tokens."""
        positions = []
        for logits_row, (i, j) in enumerate(sample_rows):
            state = rows[i].state
            spec = state.sampling_params.structured_outputs
            if spec is not None:
                positions.append((logits_row, state.request_id, spec, state.output_token_ids,
                                  rows[i].scheduled.spec_token_ids[:j]))
        positions.sort(key=lambda p: len(p[4]))
        return positions

    def _sample(self, logits: torch.Tensor, rows: list[_Row],
                sample_rows: list[tuple[int, int]]) -> ModelRunnerOutput:
        """Sample every sampling position, then per request keep its proposed tokens up to
        the first one the model disagrees with, and the model's token after them."""
        states = [rows[i].state for i, _ in sample_rows]
        spec = [rows[i].scheduled.spec_token_ids for i, _ in sample_rows]
        # Position j of a request with proposals sees them up to j as generated tokens.
        outputs = [st.output_token_ids + sp[:j] if j else st.output_token_ids
                   for st, sp, (_, j) in zip(states, spec, sample_rows)]
        masks = self.grammar.masks() if self.grammar is not None else None
        sampled = self.sampler.sample(
            logits, [st.request_id for st in states], [st.sampling_params for st in states],
            [st.prompt_token_ids for st in states], outputs, self.eos_token_id, masks)
        drawn: dict[int, dict[int, tuple[int, TokenLogprobs | None]]] = {}
        for (i, j), token, entry in zip(sample_rows, sampled.token_ids, sampled.logprobs):
            drawn.setdefault(i, {})[j] = (token, entry)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for i, by_position in drawn.items():
            row = rows[i]
            proposals = row.scheduled.spec_token_ids
            kept = []
            for j in range(len(proposals) + 1):
                token, entry = by_position[j]
                kept.append((token, entry))
                if j == len(proposals) or token != proposals[j]:
                    break
            rid = row.state.request_id
            tokens[rid] = [t for t, _ in kept]
            if kept[0][1] is not None:
                logprobs[rid] = [e for _, e in kept]
        return ModelRunnerOutput(sampled_token_ids=tokens, logprobs=logprobs)

    def _prompt_logprobs(self, rows: list[_Row], hidden: torch.Tensor
                         ) -> dict[str, PromptLogprobs]:
        """Prompt logprobs of the prompt positions computed this step, for the requests
        that ask: position j's logits score prompt token j + 1."""
        result = {}
        for row in rows:
            state, s = row.state, row.scheduled
            num_top = state.sampling_params.prompt_logprobs
            start = s.num_computed_tokens
            prompt = state.prompt_token_ids
            end = min(start + s.num_scheduled_tokens, len(prompt) - 1)
            if num_top is None or end <= start:
                continue
            entries = []
            first = row.first_token
            for a in range(start, end, _PROMPT_LOGPROBS_ROWS):
                b = min(end, a + _PROMPT_LOGPROBS_ROWS)
                logits = self.model.compute_logits(hidden[first + a - start:first + b - start])
                if logits is not None:  # None on a rank that only lent its vocabulary shard
                    entries += prompt_logprobs(logits, prompt[a + 1:b + 1], num_top)
            result[state.request_id] = PromptLogprobs(start + 1, entries)
        return result
