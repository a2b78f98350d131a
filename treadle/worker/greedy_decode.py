"""The runner's short path for a step of plain greedy decodes (issue 51, item 3).

One user decoding alone runs a step of one row, and the Python around the forward pass
was most of what that step cost above the memory floor: ~1.3 ms of thread CPU a step of
SmolLM2-135M at 1 request (benchmarks/step_overhead.py; the decode stack's one C call
did the layers): the general input preparation (row order, chunks, proposals, LoRA
segments), the sampling glue (each position's SampleRow, the sampler's groups) and the
logits' float copy. A step qualifies when every scheduled row is one decoded token that
samples plain greedy (`takes_plain_argmax`: no penalties, bias, logprobs, min_tokens ban
or grammar), with no adapters, proposer, heavy-hitter eviction, sliding-window tables,
decode graphs or parallel ranks; then the inputs are the rows' last tokens, positions and
slots (a few numpy operations), the model runs as before (embedding, the decode stack,
the final norm), and each row's token is the first largest logit: the LM head's own
argmax where its kernel has one, else the argmax of its logits, as the sampler's greedy
rows take it. Anything else (a NaN row among them) goes the general way.

Results are the general path's, token for token (tests/integration/test_greedy_decode.py).
It decides nothing: the step message says what runs.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput
from treadle.layers.attention import AttentionStep
from treadle.worker.input_batch import CachedRequestState
from treadle.worker.sampler import takes_plain_argmax

def qualifies(runner, scheduler_output: SchedulerOutput,
              states: list[CachedRequestState]) -> bool:
    """Whether this step takes the short path (see the module docstring)."""
    par = runner.parallel
    # A grammar state is always there: a constrained row is not plain greedy (below).
    if (runner.lora is not None or runner.proposer is not None or runner.h2o is not None
            or runner.decode_graphs is not None or runner.batch.sliding_block_table is not None
            or par.world_size != 1 or not states):
        return False
    for s, state in zip(scheduler_output.scheduled, states):
        if s.num_scheduled_tokens != 1 or s.spec_token_ids or not s.sample \
                or s.num_proposals:
            return False
        params = state.sampling_params
        if params.prompt_logprobs is not None or not takes_plain_argmax(
                params, len(state.output_token_ids)):
            return False
    return True


def step_inputs(runner, scheduler_output: SchedulerOutput,
                states: list[CachedRequestState]) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Token ids, positions and the attention backend's metadata of a qualifying step:
    each row's last token at its position, in the message's order."""
    scheduled = scheduler_output.scheduled
    n = len(states)
    positions = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64,
                            count=n)
    input_ids = np.fromiter((st.token_ids(p, p + 1)[0] for st, p in
                             zip(states, positions.tolist())), dtype=np.int64, count=n)
    rows = np.fromiter((st.row for st in states), dtype=np.int64, count=n)
    bs = runner.block_size
    block_table = runner.batch.block_table[rows, :int(positions.max()) // bs + 1]
    slots = block_table[np.arange(n), positions // bs] * bs + positions % bs
    step = AttentionStep(np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64),
                         positions, block_table, slots, n, bs, runner.num_cache_blocks)
    meta = runner.attention.build_metadata(step, runner.device)
    return (torch.from_numpy(input_ids).to(runner.device),
            torch.from_numpy(positions).to(runner.device), meta)


def run(runner, scheduler_output: SchedulerOutput,
        states: list[CachedRequestState]) -> tuple[ModelRunnerOutput | None, float, float]:
    """The step's tokens, or None where a row's logits hold a NaN (the caller then runs
    the general path on the same step: nothing here changed the batch, and the keys and
    values written are what it writes again); with the seconds spent preparing, and in
    the forward pass and the LM head."""
    t0 = time.perf_counter()
    ids, positions, meta = step_inputs(runner, scheduler_output, states)
    t1 = time.perf_counter()
    model = runner.model
    hidden = model(ids, positions, runner.kv_caches, meta)
    tokens = model.greedy_tokens(hidden) if hasattr(model, "greedy_tokens") else None
    if tokens is None or bool((tokens < 0).any()):
        logits = model.compute_logits(hidden)
        values, tokens = logits.max(dim=-1)  # the first largest, as torch.argmax
        if bool(values.isnan().any()):
            return None, t1 - t0, time.perf_counter() - t1
    t2 = time.perf_counter()
    sampled = {st.request_id: [t] for st, t in zip(states, tokens.tolist())}
    return ModelRunnerOutput(sampled_token_ids=sampled, logprobs={}), t1 - t0, t2 - t1
