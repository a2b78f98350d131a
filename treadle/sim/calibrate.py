"""A calibration run: the real engine through a sweep of step shapes, as a per-step trace.

A step-time model fitted on one workload's trace knows only the step shapes that workload
made: a light replay seldom decodes more than a few requests at once, so its fit never sees
what a 24-request decode step costs, and the cost of a step is not linear across that range
(the bf16 linears switch from the C small-row kernels to oneDNN above 16 rows, above 4
where oneDNN has AMX: treadle/worker/cpu/native_linear.py). `calibrate` runs the engine, with
the options it will serve with, on closed batches of every size in `rows` (random prompts
of `prompt_len` tokens; outputs long enough that the whole batch decodes together, then
thinning out one request at a time): prefill chunks up to the step budget, prefill mixed
with decodes, and decode steps of every row count up to the largest batch, at short and
long contexts. The trace it writes is the source of `treadle simulate --step-model
fit:TRACE.jsonl` for any workload on that engine. `calibrate_served` runs the same sweep
through `treadle serve` and the load generator of `treadle bench serve` instead of the
in-process engine, so that its steps pay what a served run's do (the event loop, HTTP
and the client sharing the cores): the path the real runs it should predict take. It
measures steps; nothing here fits or simulates.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)
"""Batch sizes swept by default (those above max_num_seqs are dropped)."""


def calibration_batches(rows: tuple[int, ...], prompt_len: tuple[int, int],
                        max_tokens: tuple[int, int], vocab_size: int, max_model_len: int,
                        step_budget: int, seed: int = 0,
                        staggered: bool = False) -> list[list[tuple[list[int], int]]]:
    """The sweep's batches: for each size in `rows`, that many (prompt ids, max_tokens)
    pairs. Prompt lengths are drawn uniformly from `prompt_len`; each output runs as many
    tokens as the steps that prefill the whole batch (`step_budget` tokens a step) plus a
    draw from `max_tokens`, so that every request of a batch is decoding before the first
    one finishes and the batch then thins out one request at a time. `staggered`: the
    requests may reach the engine one step apart (sent over HTTP, where a small model's
    step is shorter than the front end's handling of a request), so each output runs one
    more token per request of its batch. Prompts are cut where a request would not fit
    `max_model_len`."""
    lo, hi = prompt_len
    out_lo, out_hi = max_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt_len must be 1 <= min <= max, got {lo}..{hi}")
    if not 1 <= out_lo <= out_hi:
        raise ValueError(f"max_tokens must be 1 <= min <= max, got {out_lo}..{out_hi}")
    if out_hi + 1 > max_model_len:
        raise ValueError(f"max_tokens up to {out_hi} leaves no room for a prompt in "
                         f"max_model_len {max_model_len}")
    if step_budget < 1:
        raise ValueError(f"step_budget must be >= 1, got {step_budget}")
    rng = random.Random(seed)
    batches = []
    for size in rows:
        lengths = [rng.randint(lo, hi) for _ in range(size)]
        outputs = [rng.randint(out_lo, out_hi) for _ in range(size)]
        # Steps before the last request of the batch decodes: its prefill, and with
        # staggered arrivals a step per request.
        lead_steps = -(-sum(lengths) // step_budget) + (size if staggered else 0)
        batch = []
        for n, out in zip(lengths, outputs):
            out = min(lead_steps + out, max_model_len - 1)
            n = max(1, min(n, max_model_len - out))
            batch.append(([rng.randrange(3, vocab_size) for _ in range(n)], out))
        batches.append(batch)
    return batches


def calibrate(trace: str | Path, rows: tuple[int, ...] = DEFAULT_ROWS,
              prompt_len: tuple[int, int] = (16, 1024), max_tokens: tuple[int, int] = (4, 64),
              sweep_seed: int = 0, progress: bool = True, **engine_options: Any) -> dict:
    """Run the sweep on an engine built from `engine_options` (as `treadle serve` takes
    them; the serving step budget unless one is given), writing its per-step trace to
    `trace`; `sweep_seed` draws the prompts and lengths. Returns what ran: batches,
    requests, tokens, steps, wall time."""
    from treadle import LLM, SamplingParams
    from treadle.config import SchedulerConfig

    engine_options.setdefault("max_num_batched_tokens",
                              SchedulerConfig().max_num_batched_tokens)
    llm = LLM(trace=str(trace), **engine_options)
    max_num_seqs = llm.config.scheduler.max_num_seqs
    swept = tuple(r for r in rows if 1 <= r <= max_num_seqs)
    if not swept:
        raise ValueError(f"no batch size in rows {list(rows)} is within 1..max_num_seqs "
                         f"({max_num_seqs})")
    batches = calibration_batches(swept, prompt_len, max_tokens, llm.limits.vocab_size,
                                  llm.limits.max_request_tokens,
                                  llm.config.scheduler.max_num_batched_tokens, sweep_seed)
    started = time.perf_counter()
    prompt_tokens = output_tokens = 0
    errors = []
    try:
        for size, batch in zip(swept, batches):
            outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in batch],
                                   [SamplingParams(max_tokens=n, ignore_eos=True,
                                                   temperature=0.0) for _, n in batch],
                                   use_tqdm=False)
            errors += [o.error for o in outputs if o.error]
            prompt_tokens += sum(len(ids) for ids, _ in batch)
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if not o.error)
            if progress:
                print(f"batch of {size}: {time.perf_counter() - started:.1f} s", flush=True)
        stats = llm.get_stats()
    finally:
        llm.engine.shutdown()  # closes the trace file, a partial sweep's included
    return {"trace": str(trace), "rows": list(swept), "num_requests": sum(swept),
            "num_errors": len(errors), "errors": errors[:5], "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "num_steps": stats.get("num_steps"),
            "wall_s": time.perf_counter() - started}


def calibrate_served(trace: str | Path, rows: tuple[int, ...] = DEFAULT_ROWS,
                     prompt_len: tuple[int, int] = (16, 1024),
                     max_tokens: tuple[int, int] = (4, 64), sweep_seed: int = 0,
                     progress: bool = True, **engine_options: Any) -> dict:
    """`calibrate`'s sweep through a server: `treadle serve` launched with
    `engine_options` and `--trace trace`, each batch sent at once over HTTP by the load
    generator and awaited before the next. Returns what `calibrate` returns."""
    import asyncio

    from treadle.measure.launch import launched_server
    from treadle.measure.http_load import run_load, served_model
    from treadle.measure.workloads import Workload, WorkloadRequest
    from treadle.config import EngineConfig

    scheduler = EngineConfig.from_options(**engine_options).scheduler
    args = ["--trace", str(trace)]
    for key, value in engine_options.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    swept = tuple(r for r in rows if 1 <= r <= scheduler.max_num_seqs)
    if not swept:
        raise ValueError(f"no batch size in rows {list(rows)} is within 1..max_num_seqs "
                         f"({scheduler.max_num_seqs})")
    started = time.perf_counter()
    prompt_tokens = output_tokens = 0
    errors: list[str] = []
    with launched_server(args) as (url, _):
        card = served_model(url)
        batches = calibration_batches(swept, prompt_len, max_tokens, card["vocab_size"],
                                      card["max_model_len"],
                                      scheduler.max_num_batched_tokens, sweep_seed,
                                      staggered=True)
        started = time.perf_counter()
        for size, batch in zip(swept, batches):
            workload = Workload("calibration", [WorkloadRequest(ids, n) for ids, n in batch])
            results, _ = asyncio.run(run_load(url, workload, card["id"], progress=False))
            errors += [r.error for r in results if r.error]
            prompt_tokens += sum(len(ids) for ids, _ in batch)
            output_tokens += sum(r.output_tokens for r in results if not r.error)
            if progress:
                print(f"batch of {size}: {time.perf_counter() - started:.1f} s", flush=True)
    steps = sum(1 for line in Path(trace).read_text().splitlines() if '"type":"step"' in line)
    return {"trace": str(trace), "rows": list(swept), "num_requests": sum(swept),
            "num_errors": len(errors), "errors": errors[:5], "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "num_steps": steps,
            "wall_s": time.perf_counter() - started}
