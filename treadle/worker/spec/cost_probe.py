"""Start-up measurement of the step-cost model the speculation policy uses
(core/spec_decode.py `SpecCosts`).

It times the worker's own step path — the model runner's `execute` on real step
messages: prepare, forward, logits of every sampling position, sampling and verification
— for steps of R decode rows with k proposed tokens each, at a few R and k, over
requests with a context of `context` tokens in a scratch KV cache; and, with a
model-based proposer, its pass over R rows (proposing one token, after a first call that
caught the draft up), and for a draft with its own KV the catch-up itself: a proposal
for requests whose draft KV was dropped, less the pass over caught-up rows, per token.
Each shape runs once to warm up, then at least `repeats` times and until it has run for
MIN_SECONDS (at most MAX_REPEATS times); the fastest run counts
(on a shared machine a run is slowed by whatever else runs then, never sped up), and
along each row count the times are made non-decreasing in tokens (a longer step never
costs less: pool-adjacent-violators). The figures are what this machine does now;
nothing is assumed.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

from treadle.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from treadle.core.spec_decode import SpecCosts
from treadle.sampling_params import SamplingParams
from treadle.worker.spec.base import ProposalBatch, ProposalRequest

logger = logging.getLogger(__name__)

ROWS = (1, 4, 16, 64)
MIN_SECONDS = 0.2
MAX_REPEATS = 15
PROPOSED = (0, 1, 2, 4, 8, 16)


def probe_grid(max_rows: int, max_proposed: int, max_tokens: int) -> dict[int, list[int]]:
    """Rows -> the proposed-token counts measured at them (within the step budget)."""
    rows = sorted({r for r in ROWS if r <= max_rows} | {min(max_rows, ROWS[-1])})
    ks = sorted({k for k in PROPOSED if k <= max_proposed} | {max_proposed})
    grid = {}
    for r in rows:
        fitting = [k for k in ks if r * (1 + k) <= max_tokens]
        if fitting:
            grid[r] = fitting
    return grid


def blocks_per_row(max_proposed: int, context: int, block_size: int) -> int:
    return -(-(context + 2 * max_proposed + 1) // block_size)


def measure_spec_costs(runner, proposer, vocab_size: int, max_rows: int, max_proposed: int,
                       max_tokens: int, block_size: int, context: int = 128,
                       repeats: int = 3, seed: int = 0) -> SpecCosts:
    """Time steps of the runner (and passes of the proposer) on scratch requests; the
    runner's KV cache must hold max_rows * blocks_per_row(...) blocks, none in use."""
    rng = random.Random(seed)
    per_row = blocks_per_row(max_proposed, context, block_size)
    ids = [f"__spec_probe_{i}" for i in range(max_rows)]
    prompts = [[rng.randrange(vocab_size) for _ in range(context)] for _ in ids]
    params = SamplingParams(max_tokens=max_proposed + 2, temperature=0.0, ignore_eos=True)
    blocks = [list(range(i * per_row, (i + 1) * per_row)) for i in range(max_rows)]
    # Prefill every scratch request's prompt but its last token, in budget-sized steps.
    pending = list(range(max_rows))
    while pending:
        batch, room = [], max_tokens
        while pending and (room >= context - 1 or not batch):
            i = pending.pop(0)
            batch.append(ScheduledRequest(ids[i], 0, context - 1, new_block_ids=blocks[i],
                                          new_request=NewRequestData(prompts[i], params)))
            room -= context - 1
        runner.execute(SchedulerOutput(scheduled=batch))

    def decode_step(rows: int, k: int) -> SchedulerOutput:
        return SchedulerOutput(scheduled=[
            ScheduledRequest(ids[i], context - 1, 1 + k,
                             spec_token_ids=[rng.randrange(vocab_size) for _ in range(k)],
                             sample=True, is_decoding=True) for i in range(rows)])

    def timed(fn) -> float:
        fn()
        times: list[float] = []
        while len(times) < repeats or (sum(times) < MIN_SECONDS and len(times) < MAX_REPEATS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    grid = probe_grid(max_rows, max_proposed, max_tokens)
    step_rows, step_tokens, step_seconds = [], [], []
    for rows, ks in grid.items():
        step_rows.append(rows)
        step_tokens.append(tuple(rows * (1 + k) for k in ks))
        step_seconds.append(tuple(monotone([timed(lambda: runner.execute(decode_step(rows, k)))
                                            for k in ks])))
    draft_rows, draft_seconds = [], []
    if proposer is not None and proposer.runs_model:
        for rows in grid:
            batch = one_token_proposals(runner, ids[:rows], prompts, params)
            draft_rows.append(rows)
            draft_seconds.append(timed(lambda: proposer.propose(batch)))
        draft_seconds = monotone(draft_seconds)
    costs = SpecCosts(tuple(step_rows), tuple(step_tokens), tuple(step_seconds),
                      tuple(draft_rows), tuple(draft_seconds))
    if proposer is not None and proposer.runs_model and proposer.catches_up:
        n = min(4, max_rows)
        catchup = measure_catchup(proposer, runner, ids[:n], prompts, params, timed)
        costs = replace(costs, catchup_seconds_per_token=max(
            catchup - costs.draft_time(n), 0.0) / (n * context))
    runner.execute(SchedulerOutput(scheduled=[], finished_request_ids=list(ids)))
    logger.info("speculation costs (context %d): %s", context, describe(costs))
    return costs


def one_token_proposals(runner, ids: list[str], prompts: list[list[int]],
                        params: SamplingParams) -> ProposalBatch:
    """A proposal of one token for each scratch request (its prompt is all its tokens)."""
    return ProposalBatch([ProposalRequest(rid, prompt, len(prompt), 1, params,
                                          runner.batch.requests[rid].row)
                          for rid, prompt in zip(ids, prompts)], runner.batch.block_table)


def measure_catchup(proposer, runner, ids: list[str], prompts: list[list[int]],
                    params: SamplingParams, timed) -> float:
    """Seconds of one proposal for the requests `ids` with their draft KV dropped first
    (the draft feeds each one's whole context again, then drafts a token)."""
    batch = one_token_proposals(runner, ids, prompts, params)

    def from_scratch() -> None:
        proposer.begin_step(SchedulerOutput(scheduled=[], finished_request_ids=list(ids)))
        proposer.propose(batch)

    return timed(from_scratch)


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out = []
    for total, count in blocks:
        out += [total / count] * int(count)
    return out


def describe(costs: SpecCosts) -> str:
    parts = []
    for rows, tokens, seconds in zip(costs.step_rows, costs.step_tokens, costs.step_seconds):
        parts.append(f"{rows} rows: " + ", ".join(f"{t} tok {s * 1e3:.1f} ms"
                                                   for t, s in zip(tokens, seconds)))
    if costs.draft_rows:
        parts.append("draft pass: " + ", ".join(f"{r} rows {s * 1e3:.1f} ms" for r, s in
                                                zip(costs.draft_rows, costs.draft_seconds)))
    if costs.catchup_seconds_per_token:
        parts.append(f"draft catch-up: {costs.catchup_seconds_per_token * 1e6:.1f} us/token")
    return "; ".join(parts)
