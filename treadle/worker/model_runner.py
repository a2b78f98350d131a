"""Turns a step message into tensors, runs the model once, and samples.

Owns the step's rows: it applies the message to its persistent batch
(worker/input_batch.py), orders the scheduled requests itself (single-token rows first,
which the decode kernels read as one contiguous block; then multi-token rows: prompt
chunks, recomputes, and tokens followed by proposed ones), and builds the flat batch with
numpy (all scheduled tokens of all requests concatenated, no padding; Python loops run
once per request, never once per token). With LoRA, rows of one adapter are kept together
within each of the two groups, and the step's adapter segments (token ranges) go to the
LoRA manager (worker/lora/) before the forward pass. The attention backend turns the step's
geometry into its metadata once per step, shared by every layer. Logits are computed only
for the rows that sample: a request's last scheduled token, or with proposed tokens each
of them and the token before (the proposals are verified by exact rejection sampling,
worker/spec/rejection.py: the accepted ones are kept, then one token of the model's own),
plus,
for requests that ask for prompt logprobs, every position of their prompt chunk (in
slices, so a long chunk never holds [chunk, vocab] logits at once).

With pipeline parallelism every stage applies every message (its layers need the same
metadata); the first stage embeds and sends its activations to the next, a later stage
receives them first, and only the last computes logits. With tensor parallelism the
logits are gathered to the stage's first rank, the output rank, which alone samples and
answers (worker/parallel_state.py); the other ranks return None.

On a GPU, a step of decodes only replays a CUDA graph of the forward pass captured at its
padded batch size (worker/cuda/decode_graphs.py) instead of building the attention metadata
and calling the model; every other step runs eagerly, and so does a step with a row that
has a LoRA adapter (the graphs hold no adapter terms).

With speculative decoding the output rank also holds the proposer (worker/spec): after
verification it proposes, for each request the step message asks it to, the tokens its
next step verifies (`ModelRunnerOutput.spec_token_ids`).
The proposer runs after the forward pass, outside the LoRA manager's step: a `self`
proposer drafts with the base layers (no adapter terms), a `draft` model has no adapters,
and verification runs the target with each row's adapter, so speculation with adapters
stays lossless (docs/lora.md).

The runner never decides policy: it computes exactly what it is given.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable
from dataclasses import dataclass

import numpy as np
import torch

from treadle.sampling_params import ALL_LOGPROBS
from treadle.core.outputs import (ModelRunnerOutput, PromptLogprobs, ScheduledRequest,
                                  SchedulerOutput, StepTimings)
from treadle.layers.attention import AttentionStep
from treadle.layers.parallel import ParallelContext
from treadle.worker import greedy_decode
from treadle.worker.attention.base import AttentionBackend
from treadle.worker.grammar import GrammarState
from treadle.worker.input_batch import CachedRequestState, InputBatch
from treadle.worker.kv_cache import copy_blocks
from treadle.worker.platform import no_wait, run_copies_now
from treadle.worker.sampler import (Sampler, group_order, prompt_logprobs,
                                    takes_plain_argmax)
from treadle.worker.spec.base import ProposalBatch, ProposalRequest, Proposer
from treadle.worker.spec.rejection import RejectionSampler, SampleRow

logger = logging.getLogger(__name__)

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
    input_ids: torch.Tensor | None
    """On the device; None when a decode graph runs the step (it copies the host arrays)."""
    positions: torch.Tensor | None
    attn_metadata: object
    step: AttentionStep
    host_input_ids: np.ndarray
    host_positions: np.ndarray
    rows: list[_Row]
    logits_indices: np.ndarray
    """Flat-batch tokens whose logits are sampled, one per sampling position."""
    sample_rows: list[tuple[int, int]]
    """Per entry of logits_indices: (row, index among that row's sampling positions)."""
    lora_segments: list = None
    """(LoRARequest, first token, end token) per run of rows with one adapter."""


def _lora_key(lora) -> int:
    return 0 if lora is None else lora.lora_int_id


def _lora_segments(rows: list[_Row]) -> list:
    """(LoRARequest, first token, end token) per run of consecutive rows with one adapter."""
    segments = []
    for row in rows:
        lora = row.state.lora_request
        if lora is None:
            continue
        end = row.first_token + row.scheduled.num_scheduled_tokens
        if segments and segments[-1][0].lora_int_id == lora.lora_int_id \
                and segments[-1][2] == row.first_token:
            segments[-1] = (segments[-1][0], segments[-1][1], end)
        else:
            segments.append((lora, row.first_token, end))
    return segments


class ModelRunner:
    """Executes one step of the model over the paged KV cache."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 attention: AttentionBackend, block_size: int, num_cache_blocks: int,
                 max_model_len: int, sampler: Sampler, device: torch.device,
                 swap_caches: list[torch.Tensor] | None = None, block_dim: int = 2,
                 eos_token_id: int | None = None,
                 parallel: ParallelContext | None = None,
                 grammar: GrammarState | None = None,
                 start_copies: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
                 proposer: Proposer | None = None, lora=None, h2o=None,
                 num_sliding_cache_blocks: int | None = None) -> None:
        """`swap_caches` hold swapped-out blocks (same layout as kv_caches); `grammar` the
        structured-output state and `proposer` speculative decoding's (the output rank's);
        `start_copies` runs the step's swap copies and returns the wait before compute
        (Platform.start_copies; by default they run at once); `lora`: the worker's
        LoRAManager, None without LoRA; `h2o`: heavy-hitter eviction's HeavyHitterTracker
        (worker/h2o.py), None without eviction; `num_sliding_cache_blocks`: blocks of
        the sliding-window layers' caches when they have their own pool (the KV config's
        sliding group, core/kv/config.py), else None."""
        self.h2o = h2o
        self.model = model
        self.lora = lora
        self.proposer_failed = False
        """The proposer raised once: no proposals from then on (`_propose`)."""
        self.start_copies = start_copies or run_copies_now
        self.parallel = parallel or ParallelContext()
        self.grammar = grammar
        self.kv_caches = kv_caches
        self.swap_caches = swap_caches
        self.attention = attention
        self.block_size = block_size
        self.num_cache_blocks = num_cache_blocks
        self.num_sliding_cache_blocks = (num_cache_blocks if num_sliding_cache_blocks is None
                                         else num_sliding_cache_blocks)
        """Blocks of the sliding-window layers' caches."""
        self.block_dim = block_dim
        self.device = device
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        """The model's end-of-sequence id, masked until a request's min_tokens."""
        self.batch = InputBatch(-(-max_model_len // block_size))
        self.decode_graphs: Any = None
        """Captured decode steps (worker/cuda/decode_graphs.py DecodeGraphs: the GPU's,
        unless enforce_eager), or None."""
        self.proposer = proposer
        self.rejection = RejectionSampler(sampler, eos_token_id)
        self.greedy_decode = True
        """Steps of plain greedy decodes take the short path (worker/greedy_decode.py);
        False sends every step the general way (tests compare the two)."""

    # ----- preparing the inputs ------------------------------------------------------------

    def prepare(self, scheduler_output: SchedulerOutput,
                states: list[CachedRequestState] | None = None) -> PreparedInputs:
        """The step's inputs; `states`: the persistent batch already updated with this
        message (InputBatch.update, once per message), else it is updated here."""
        if states is None:
            states = self.batch.update(scheduler_output)
        pairs = list(zip(scheduler_output.scheduled, states))
        # Single-token rows first: the decode kernels read them as one block of rows.
        if self.lora is None:
            pairs.sort(key=lambda p: p[0].num_scheduled_tokens > 1)
        else:  # and within each group, each adapter's rows together
            pairs.sort(key=lambda p: (p[0].num_scheduled_tokens > 1,
                                      _lora_key(p[1].lora_request)))
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
        cache_positions = positions
        if self.h2o is not None:  # evicted tokens keep their positions, not their slots
            evicted = np.fromiter((s.num_evicted_tokens for s, _ in pairs), dtype=np.int64,
                                  count=num_rows)
            starts = starts - evicted
            cache_positions = positions - np.repeat(evicted, q_lens)
        bs = self.block_size
        blocks_needed = (starts + q_lens + bs - 1) // bs
        table_rows = np.fromiter((st.row for _, st in pairs), dtype=np.int64, count=num_rows)
        block_table = self.batch.block_table[table_rows, :int(blocks_needed.max())]
        token_rows = np.repeat(np.arange(num_rows), q_lens)
        slot_mapping = (block_table[token_rows, cache_positions // bs] * bs
                        + cache_positions % bs)

        step = AttentionStep(q_lens, row_offsets, starts, block_table, slot_mapping,
                             int(np.count_nonzero(q_lens == 1)), bs, self.num_cache_blocks)
        if self.batch.sliding_block_table is not None:
            sliding_table = self.batch.sliding_block_table[table_rows, :block_table.shape[1]]
            step.sliding = AttentionStep(
                q_lens, row_offsets, starts, sliding_table,
                sliding_table[token_rows, positions // bs] * bs + positions % bs,
                step.num_single_token_rows, bs, self.num_sliding_cache_blocks)
        rows = [_Row(s, st, int(off)) for (s, st), off in zip(pairs, row_offsets)]
        lora_segments = _lora_segments(rows) if self.lora is not None else []
        # A decode graph was captured without adapter terms: a step with adapter rows
        # runs eagerly.
        graphed = (self.decode_graphs is not None and not lora_segments
                   and step.sliding is None and self.h2o is None
                   and self.decode_graphs.accepts(step))
        meta = None if graphed else self.attention.build_metadata(step, self.device)
        if self.h2o is not None:  # scores seen by every layer (AttentionLayer.__call__)
            meta.observer = self.h2o.step_observer(
                step, [st.request_id for _, st in pairs], starts + evicted)

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
        return PreparedInputs(None if graphed else to_device(input_ids),
                              None if graphed else to_device(positions), meta, step,
                              input_ids, positions, rows,
                              np.asarray(logits_indices, dtype=np.int64), sample_rows,
                              lora_segments)

    @staticmethod
    def _row_tokens(scheduled: ScheduledRequest, state: CachedRequestState) -> list[int]:
        """The tokens a row computes: known tokens from its position, then any proposed."""
        start = scheduled.num_computed_tokens
        num_known = scheduled.num_scheduled_tokens - len(scheduled.spec_token_ids)
        tokens = state.token_ids(start, start + num_known)
        return tokens + scheduled.spec_token_ids if scheduled.spec_token_ids else tokens

    # ----- one step ------------------------------------------------------------------------

    def _start_swaps(self, scheduler_output: SchedulerOutput,
                     timings: StepTimings) -> Callable[[], None]:
        """Issue the step's swap copies; the returned wait comes before the forward pass
        (which may write the blocks just swapped out, or read those swapped in)."""
        out, into = scheduler_output.swap_out, scheduler_output.swap_in
        if not out and not into:
            return no_wait

        def copy() -> None:
            # Swap-outs first: a block freed by a swap-out may be the target of a swap-in.
            # A draft's own KV cache follows its target blocks (worker/spec/draft.py).
            if out:
                timings.swap_bytes_out = copy_blocks(self.kv_caches, self.swap_caches, out,
                                                     self.block_dim)
                if self.proposer is not None:
                    self.proposer.swap_blocks(out, out=True)
            if into:
                timings.swap_bytes_in = copy_blocks(self.swap_caches, self.kv_caches, into,
                                                    self.block_dim)
                if self.proposer is not None:
                    self.proposer.swap_blocks(into, out=False)
        return self.start_copies(copy)

    def _begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished requests' sampler and grammar state, evict (H2O), and start
        compiling new requests' grammars."""
        self.sampler.drop(scheduler_output.finished_request_ids)
        if self.h2o is not None:
            self._evict(scheduler_output)
        if self.grammar is not None and self.parallel.is_output_rank:
            self.grammar.drop(scheduler_output.finished_request_ids)
            self.grammar.prepare(
                (s.request_id, s.new_request.sampling_params.structured_outputs)
                for s in scheduler_output.scheduled if s.new_request is not None
                and s.new_request.sampling_params.structured_outputs is not None)

    def _greedy_tokens(self, chosen: torch.Tensor, entries) -> torch.Tensor | None:
        """Each row's argmax straight from the hidden states when every row takes plain
        argmax and the model can (no logits made), else None."""
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        if greedy_tokens is None or not all(
                takes_plain_argmax(e.params, len(e.output_token_ids)) for e in entries):
            return None
        greedy = greedy_tokens(chosen)
        if greedy is not None and bool((greedy < 0).any()):  # a row of NaNs
            return None
        return greedy

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._begin_step(scheduler_output)
        proposer = self.proposer
        if proposer is not None:
            proposer.begin_step(scheduler_output)
        timings = StepTimings()
        t_swap = time.perf_counter()
        wait_for_swaps = self._start_swaps(scheduler_output, timings)
        timings.swap_s = time.perf_counter() - t_swap
        par = self.parallel
        if not scheduler_output.scheduled:
            wait_for_swaps()
            self.batch.update(scheduler_output)
            return (ModelRunnerOutput(sampled_token_ids={}, timings=timings)
                    if par.is_output_rank else None)
        t0 = time.perf_counter()
        states = self.batch.update(scheduler_output)
        if self.greedy_decode and greedy_decode.qualifies(self, scheduler_output, states):
            wait_for_swaps()
            output, timings.prepare_s, timings.forward_s = greedy_decode.run(
                self, scheduler_output, states)
            if output is not None:
                output.timings = timings
                return output
        inputs = self.prepare(scheduler_output, states)  # overlaps swap copies on a GPU
        wait_for_swaps()
        rows, sample_rows = inputs.rows, inputs.sample_rows
        # Logits rows in the sampler's group order: it then works in place, copying none.
        order = group_order([rows[i].state.sampling_params for i, _ in sample_rows])
        sample_rows = [sample_rows[k] for k in order]
        if par.is_output_rank and self.grammar is not None:
            self.grammar.start(self._grammar_positions(rows, sample_rows))  # fills meanwhile
        logits_indices = inputs.logits_indices[order]
        num_tokens = len(inputs.host_positions)
        every_row = (len(logits_indices) == num_tokens
                     and np.array_equal(logits_indices, np.arange(num_tokens)))
        keep_rows = None
        if not every_row and inputs.attn_metadata is not None and self._keeps_rows(rows):
            keep_rows = torch.from_numpy(logits_indices).to(self.device)
        t1 = time.perf_counter()
        failed: dict[str, str] = {}
        hidden = self._forward(inputs, keep_rows, failed)
        if not par.is_last_stage:
            par.send_next_stage(hidden)
            return None
        if every_row or keep_rows is not None:
            chosen = hidden  # the sampling positions' rows, in order: no copy
        else:
            chosen = hidden.index_select(0, torch.from_numpy(logits_indices).to(hidden.device))
        entries = self._sample_entries(rows, sample_rows)
        greedy = self._greedy_tokens(chosen, entries)
        logits = self.model.compute_logits(chosen) if greedy is None else None
        t2 = time.perf_counter()
        prompt_lps = self._prompt_logprobs(rows, hidden)
        if not par.is_output_rank:
            return None
        if greedy is None:
            output = self._sample(logits, entries)
        else:  # no logits were made: each row's argmax is its token
            output = ModelRunnerOutput(
                sampled_token_ids=self.rejection.greedy(entries, greedy.tolist()),
                logprobs={})
        output.prompt_logprobs = prompt_lps
        if self.grammar is not None and self.grammar.failed:
            failed.update(self.grammar.failed)
        output.failed = failed
        t3 = time.perf_counter()
        if proposer is not None and not self.proposer_failed:
            output.spec_token_ids = self._propose(rows, output.sampled_token_ids)
        timings.propose_s = time.perf_counter() - t3
        timings.prepare_s, timings.forward_s, timings.sample_s = t1 - t0, t2 - t1, t3 - t2
        timings.comm_s = par.take_comm_seconds()
        output.timings = timings
        return output

    def _forward(self, inputs: PreparedInputs, keep_rows: torch.Tensor | None,
                 failed: dict[str, str]) -> torch.Tensor:
        """The step's forward pass: the previous stage's activations received first (a
        later pipeline stage), then the decode graph's replay or the model with the
        step's adapters (requests whose adapter cannot load go into `failed`)."""
        par = self.parallel
        received = None
        if not par.is_first_stage:
            received = par.recv_prev_stage((len(inputs.host_positions), self.model.hidden_size),
                                           self.model.dtype)
        if inputs.attn_metadata is None:  # a decode graph: no adapter rows (prepare)
            return self.decode_graphs.run(inputs.host_input_ids, inputs.host_positions,
                                          inputs.step)
        if self.lora is not None:
            failed.update(self._begin_lora_step(inputs.rows, inputs.lora_segments))
        try:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                              inputs.attn_metadata, received,
                              **({} if keep_rows is None else {"keep_rows": keep_rows}))
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _begin_lora_step(self, rows: list[_Row], segments: list) -> dict[str, str]:
        """Make the step's adapters resident. An adapter that cannot be loaded (its files
        changed since it was registered) fails the requests that run it this step, alone:
        their rows run on the base model and what they sample is dropped."""
        failed_adapters = self.lora.begin_step(segments)
        if not failed_adapters:
            return {}
        return {row.state.request_id: failed_adapters[row.state.lora_request.lora_int_id]
                for row in rows if row.state.lora_request is not None
                and row.state.lora_request.lora_int_id in failed_adapters}

    def _evict(self, scheduler_output: SchedulerOutput) -> None:
        """Heavy-hitter eviction's bookkeeping and compactions, before anything else of
        the step (its freed blocks may be swapped into or written this step)."""
        h2o = self.h2o
        h2o.drop(scheduler_output.finished_request_ids)
        swapped = set(scheduler_output.swapped_request_ids)
        h2o.drop(r for r in scheduler_output.preempted_request_ids if r not in swapped)
        if scheduler_output.kv_compactions:
            h2o.compact(scheduler_output.kv_compactions, self.kv_caches)

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

    def _keeps_rows(self, rows: list[_Row]) -> bool:
        """Whether the model may carry only the sampling positions past its last layer's
        attention this step: it can (`keeps_rows`), this rank holds the last stage, no
        adapters (their row segments cover every row) and no prompt logprobs (they read
        every prompt row's hidden state)."""
        return (getattr(self.model, "keeps_rows", False) and self.parallel.is_last_stage
                and self.lora is None
                and all(r.state.sampling_params.prompt_logprobs is None for r in rows))

    @staticmethod
    def _sample_entries(rows: list[_Row], sample_rows: list[tuple[int, int]]
                        ) -> list[SampleRow]:
        """The sampling positions (row, index among the row's positions) as SampleRows."""
        entries = []
        for i, j in sample_rows:
            state, spec = rows[i].state, rows[i].scheduled.spec_token_ids
            # Position j of a request with proposals sees them up to j as generated tokens.
            outputs = state.output_token_ids + spec[:j] if j else state.output_token_ids
            entries.append(SampleRow(state.request_id, state.sampling_params,
                                     state.prompt_token_ids, outputs, j, spec))
        return entries

    def _sample(self, logits: torch.Tensor, entries: list[SampleRow]) -> ModelRunnerOutput:
        """Sample every sampling position and verify each request's proposed tokens
        (worker/spec/rejection.py): the accepted ones, then one token of the model's."""
        draft_probs = (self.proposer.draft_probs if self.proposer is not None
                       else lambda request_id: None)
        masks = self.grammar.masks() if self.grammar is not None else None
        tokens, logprobs = self.rejection(logits, entries, draft_probs, masks)
        return ModelRunnerOutput(sampled_token_ids=tokens, logprobs=logprobs)

    def _propose(self, rows: list[_Row], sampled: dict[str, list[int]]
                 ) -> dict[str, list[int]]:
        """The proposer's tokens for the requests the step message asks them for. A
        model-based proposer writes KV past the request's tokens: never past the blocks
        it holds (the scheduler held slots for the proposals)."""
        requests = []
        bs = self.block_size
        for row in rows:
            s, state = row.scheduled, row.state
            new = sampled.get(state.request_id)
            if not s.num_proposals or not s.sample or not new:
                continue
            tokens = state.prompt_token_ids + state.output_token_ids + new
            k = s.num_proposals
            if self.proposer.runs_model:
                k = min(k, state.num_blocks * bs - (len(tokens) - 1))
            if k > 0:
                requests.append(ProposalRequest(state.request_id, tokens,
                                                len(state.prompt_token_ids), k,
                                                state.sampling_params, state.row))
        if not requests:
            return {}
        try:
            return self.proposer.propose(ProposalBatch(requests, self.batch.block_table))
        except Exception:  # noqa: BLE001 - proposals are an optimization: go on without
            logger.exception("the speculative proposer failed: speculation is off for the "
                             "rest of this engine's life (requests go on without proposals)")
            self.proposer_failed = True
            return {}

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
            entries, full = [], []
            first = row.first_token
            for a in range(start, end, _PROMPT_LOGPROBS_ROWS):
                b = min(end, a + _PROMPT_LOGPROBS_ROWS)
                logits = self.model.compute_logits(hidden[first + a - start:first + b - start])
                if logits is None:  # a rank that only lent its vocabulary shard
                    continue
                if num_top == ALL_LOGPROBS:
                    full.append(torch.log_softmax(logits.float(), dim=-1)
                                .to(torch.float16).cpu().numpy())
                else:
                    entries += prompt_logprobs(logits, prompt[a + 1:b + 1], num_top)
            result[state.request_id] = PromptLogprobs(
                start + 1, entries, np.concatenate(full) if full else None)
        return result
