"""The per-step trace: which requests ran in each engine step, and how many tokens each.

Owns the trace file format, JSON lines, one object per line:

    {"type": "header", "version": 2, "policy": "priority",
     "engine": {"block_size": 16, "num_kv_blocks": 8192, "kv_bytes_per_token": 46080, ...}}
    {"type": "arrival", "request_id": "7", "t": 0.0312, "priority": 0, "tenant": null,
     "band": "interactive", "num_prompt_tokens": 120, "max_tokens": 64}
    {"type": "step", "step": 0, "t_start": 0.0315, "t_end": 0.1702,
     "scheduled": [["7", 120, "prefill"], ["3", 1, "decode"]],
     "preempted": ["5"], "finished": [["3", "length"]],
     "features": {"prefill_tokens": 120, "prefill_rows": 1, "decode_rows": 1,
                  "decode_tokens": 1, "decode_context_tokens": 131,
                  "prefill_context_tokens": 120, "prefill_attention_pairs": 7260,
                  "swap_out_bytes": 0, "swap_in_bytes": 0},
     "spec": {"drafts": 2, "draft_tokens": 8, "accepted": 5}}
    {"type": "end", "request_id": "9", "t": 1.5, "reason": "abort"}

Times are seconds since the recorder started (time.monotonic). A scheduled entry is
`[request_id, num_tokens, kind]`: kind "prefill" covers prompt chunks and the recompute
of a preempted request, "decode" a request's one uncomputed token (with any proposed
tokens after it: `Request.is_decoding`). "preempted" lists the requests that
lost their KV (swap or recompute) when the step was scheduled. "spec" (only in steps
that verified proposed tokens) counts the step's drafts (requests whose proposals ran),
their proposed tokens and the accepted ones; `Trace.spec_summary` gives the acceptance
rate and the mean accepted length (1 + accepted / drafts, vLLM's) over a trace.

Version 2 adds what a step-time model is fitted on (treadle/sim/fit.py): the header's
"engine" facts (block size, KV blocks, KV bytes per token, budgets, model size) and each
step's "features", computed from the SchedulerOutput alone (`step_features`), never from
the worker: a row of n tokens starting at position c (ScheduledRequest.num_computed_tokens)
reads c + n context tokens and attends n*c + n*(n+1)/2 (query, key) pairs; swap bytes are
the swap plans' blocks times the bytes of one block. Version 1 files still read (without
features: a fit then uses what `scheduled` gives, prefill tokens and rows and decode rows).

`TraceRecorder` writes it (EngineCore calls it, when `scheduler.trace` is set);
`read_trace` reads it back for `treadle.bench.trace_plot`. This module must not decide
anything, import torch, or do more per step than format and write one line.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable

from treadle.core.outputs import EngineCoreOutput, ScheduledRequest, SchedulerOutput
from treadle.core.spec_decode import SpecDecodeStats
from treadle.request import Request

TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)

FEATURE_NAMES = ("prefill_tokens", "prefill_rows", "decode_rows", "decode_tokens",
                 "decode_context_tokens", "prefill_context_tokens", "prefill_attention_pairs",
                 "swap_out_bytes", "swap_in_bytes")
"""A step's features (step_features), in this order in the trace and the fit."""


def step_kind(scheduled: ScheduledRequest) -> str:
    """'decode' for a decoding request (Request.is_decoding: its last token, with any
    proposed tokens after it), 'prefill' for anything else."""
    return "decode" if scheduled.is_decoding else "prefill"


def step_features(scheduler_output: SchedulerOutput, swap_block_bytes: int = 0) -> dict:
    """What a step computes, from its SchedulerOutput alone (the fit's and the simulator's
    inputs; see the module docstring). `swap_block_bytes`: bytes one KV block copies."""
    prefill_tokens = prefill_rows = decode_rows = decode_tokens = 0
    decode_context = prefill_context = pairs = 0
    for s in scheduler_output.scheduled:
        n = s.num_scheduled_tokens
        end = s.num_computed_tokens + n
        if s.is_decoding:
            decode_rows += 1
            decode_tokens += n
            decode_context += end
        else:
            prefill_rows += 1
            prefill_tokens += n
            prefill_context += end
            pairs += n * s.num_computed_tokens + n * (n + 1) // 2
    return {"prefill_tokens": prefill_tokens, "prefill_rows": prefill_rows,
            "decode_rows": decode_rows, "decode_tokens": decode_tokens,
            "decode_context_tokens": decode_context, "prefill_context_tokens": prefill_context,
            "prefill_attention_pairs": pairs,
            "swap_out_bytes": len(scheduler_output.swap_out) * swap_block_bytes,
            "swap_in_bytes": len(scheduler_output.swap_in) * swap_block_bytes}


def engine_facts(config, info, num_kv_blocks: int, num_swap_blocks: int) -> dict:
    """The header's engine facts, from the EngineConfig and the WorkerInfo: what a
    simulator needs to rebuild the engine's memory and budgets (treadle/sim), and what the
    step times depend on."""
    costs = info.preemption_costs
    return {
        "model": Path(info.model_dir).name, "dtype": info.dtype,
        "num_parameters": info.num_parameters, "vocab_size": info.vocab_size,
        "attention_backend": info.attention_backend,
        "kernels": info.kernels, "num_threads": config.model.num_threads,
        "max_model_len": info.max_model_len, "kv_bytes_per_token": info.kv_bytes_per_token,
        "block_size": config.cache.block_size, "num_kv_blocks": num_kv_blocks,
        "num_swap_blocks": num_swap_blocks,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "scheduler": dataclasses.asdict(config.scheduler) | {"trace": None},
        "preemption_costs": dataclasses.asdict(costs) if costs is not None else None}


class TraceRecorder:
    """Appends one JSON line per arrival, per step and per early end to a file.

    `engine`: facts of the engine that wrote it (`engine_facts`: block size, KV blocks, KV
    bytes per token, budgets, ...), kept in the header so that a simulator can rebuild its
    memory; its block size and KV bytes per token price the swap plans in the features."""

    def __init__(self, path: str | Path, policy: str = "fcfs",
                 clock=time.monotonic, engine: dict | None = None) -> None:
        self.path = Path(path)
        self._clock = clock
        self._t0 = clock()
        engine = dict(engine or {})
        self._swap_block_bytes = engine.get("kv_bytes_per_token", 0) * engine.get("block_size", 0)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        self._write({"type": "header", "version": TRACE_VERSION, "policy": policy,
                     "engine": engine})

    def _write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def now(self) -> float:
        """Seconds since the recorder started."""
        return self._clock() - self._t0

    def record_arrival(self, request: Request) -> None:
        self._write({
            "type": "arrival", "request_id": request.request_id,
            "t": round(request.arrival_time - self._t0, 6), "priority": request.priority,
            "tenant": request.tenant, "band": request.band,
            "num_prompt_tokens": request.num_prompt_tokens,
            "max_tokens": request.sampling_params.max_tokens})

    def record_step(self, step: int, t_start: float, t_end: float,
                    scheduler_output: SchedulerOutput,
                    outputs: Iterable[EngineCoreOutput],
                    spec: SpecDecodeStats | None = None) -> None:
        """One step; t_start / t_end are clock readings (time.monotonic); `spec`: the
        step's own speculation counters."""
        record = {
            "type": "step", "step": step,
            "t_start": round(t_start - self._t0, 6), "t_end": round(t_end - self._t0, 6),
            "scheduled": [[s.request_id, s.num_scheduled_tokens, step_kind(s)]
                          for s in scheduler_output.scheduled],
            "preempted": list(scheduler_output.preempted_request_ids),
            "finished": [[o.request_id, o.finish_reason.value]
                         for o in outputs if o.finish_reason is not None],
            "features": step_features(scheduler_output, self._swap_block_bytes)}
        if spec is not None and spec.num_drafts:
            record["spec"] = {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                              "accepted": spec.num_accepted_tokens}
        self._write(record)

    def record_end(self, request_id: str, reason: str) -> None:
        """A request that ended outside a step (abort, stop string)."""
        self._write({"type": "end", "request_id": request_id, "t": round(self.now(), 6),
                     "reason": reason})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class TraceArrival:
    request_id: str
    t: float
    priority: int = 0
    tenant: str | None = None
    num_prompt_tokens: int = 0
    max_tokens: int = 0


@dataclass
class TraceStep:
    step: int
    t_start: float
    t_end: float
    scheduled: list[tuple[str, int, str]]
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)
    features: dict | None = None
    """step_features of the step (version 2); None in a version-1 file."""
    spec: dict | None = None
    """{"drafts", "draft_tokens", "accepted"} of a step that verified proposed tokens."""


@dataclass
class Trace:
    """A trace file read back: arrivals by request id (in arrival order) and steps."""

    policy: str
    arrivals: dict[str, TraceArrival]
    steps: list[TraceStep]
    ends: dict[str, tuple[float, str]] = field(default_factory=dict)
    version: int = TRACE_VERSION
    engine: dict = field(default_factory=dict)
    """The header's engine facts (version 2; empty in a version-1 file)."""

    def spec_summary(self) -> dict:
        """Speculation over the trace: drafts, proposed and accepted tokens, the
        acceptance rate (accepted / proposed) and the mean accepted length (1 + accepted
        / drafts)."""
        drafts = sum(s.spec["drafts"] for s in self.steps if s.spec)
        proposed = sum(s.spec["draft_tokens"] for s in self.steps if s.spec)
        accepted = sum(s.spec["accepted"] for s in self.steps if s.spec)
        return {"drafts": drafts, "draft_tokens": proposed, "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0}

    def tokens_by_request(self) -> dict[str, int]:
        """Tokens computed per request over the whole trace."""
        totals: dict[str, int] = {}
        for step in self.steps:
            for request_id, num_tokens, _ in step.scheduled:
                totals[request_id] = totals.get(request_id, 0) + num_tokens
        return totals


def read_trace(path: str | Path) -> Trace:
    """Parse a trace file; a truncated last line (the engine was killed) is ignored."""
    policy = "unknown"
    version = TRACE_VERSION
    engine: dict = {}
    arrivals: dict[str, TraceArrival] = {}
    steps: list[TraceStep] = []
    ends: dict[str, tuple[float, str]] = {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line")
        kind = record.get("type")
        if kind == "header":
            version = record.get("version")
            if version not in READABLE_VERSIONS:
                raise ValueError(f"{path}: trace version {version}, this treadle reads "
                                 f"versions {', '.join(map(str, READABLE_VERSIONS))}")
            policy = record.get("policy", policy)
            engine = dict(record.get("engine") or {})
        elif kind == "arrival":
            arrivals[record["request_id"]] = TraceArrival(
                record["request_id"], record["t"], record.get("priority", 0),
                record.get("tenant"), record.get("num_prompt_tokens", 0),
                record.get("max_tokens", 0))
        elif kind == "step":
            steps.append(TraceStep(
                record["step"], record["t_start"], record["t_end"],
                [tuple(s) for s in record["scheduled"]], list(record.get("preempted", [])),
                [tuple(x) for x in record.get("finished", [])], record.get("features"),
                record.get("spec")))
        elif kind == "end":
            ends[record["request_id"]] = (record["t"], record.get("reason", ""))
    return Trace(policy, arrivals, steps, ends, version, engine)
