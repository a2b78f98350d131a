"""The per-step trace: which requests ran in each engine step, and how many tokens each.

Owns the trace file format, JSON lines, one object per line:

    {"type": "header", "version": 1, "policy": "priority"}
    {"type": "arrival", "request_id": "7", "t": 0.0312, "priority": 0, "tenant": null,
     "num_prompt_tokens": 120, "max_tokens": 64}
    {"type": "step", "step": 0, "t_start": 0.0315, "t_end": 0.1702,
     "scheduled": [["7", 120, "prefill"], ["3", 1, "decode"]],
     "preempted": ["5"], "finished": [["3", "length"]],
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

`TraceRecorder` writes it (EngineCore calls it, when `scheduler.trace` is set);
`read_trace` reads it back for `treadle.bench.trace_plot`. This module must not decide
anything, import torch, or do more per step than format and write one line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable

from treadle.core.outputs import EngineCoreOutput, ScheduledRequest, SchedulerOutput
from treadle.core.spec_decode import SpecDecodeStats
from treadle.request import Request

TRACE_VERSION = 1


def step_kind(scheduled: ScheduledRequest) -> str:
    """'decode' for a decoding request (Request.is_decoding: its last token, with any
    proposed tokens after it), 'prefill' for anything else."""
    return "decode" if scheduled.is_decoding else "prefill"


class TraceRecorder:
    """Appends one JSON line per arrival, per step and per early end to a file."""

    def __init__(self, path: str | Path, policy: str = "fcfs",
                 clock=time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._t0 = clock()
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        self._write({"type": "header", "version": TRACE_VERSION, "policy": policy})

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
            "tenant": request.tenant, "num_prompt_tokens": request.num_prompt_tokens,
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
                         for o in outputs if o.finish_reason is not None]}
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
    spec: dict | None = None
    """{"drafts", "draft_tokens", "accepted"} of a step that verified proposed tokens."""


@dataclass
class Trace:
    """A trace file read back: arrivals by request id (in arrival order) and steps."""

    policy: str
    arrivals: dict[str, TraceArrival]
    steps: list[TraceStep]
    ends: dict[str, tuple[float, str]] = field(default_factory=dict)

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
            if record.get("version") != TRACE_VERSION:
                raise ValueError(f"{path}: trace version {record.get('version')}, "
                                 f"this treadle reads version {TRACE_VERSION}")
            policy = record.get("policy", policy)
        elif kind == "arrival":
            arrivals[record["request_id"]] = TraceArrival(
                record["request_id"], record["t"], record.get("priority", 0),
                record.get("tenant"), record.get("num_prompt_tokens", 0),
                record.get("max_tokens", 0))
        elif kind == "step":
            steps.append(TraceStep(
                record["step"], record["t_start"], record["t_end"],
                [tuple(s) for s in record["scheduled"]], list(record.get("preempted", [])),
                [tuple(x) for x in record.get("finished", [])], record.get("spec")))
        elif kind == "end":
            ends[record["request_id"]] = (record["t"], record.get("reason", ""))
    return Trace(policy, arrivals, steps, ends)
