"""Where a run's time went, by kind of step: `python -m treadle.bench.step_split TRACE...`.

Reads per-step traces (`--trace` of `treadle bench throughput`, `treadle serve` and the
others; treadle/engine/trace.py) and bins each step by what it ran: any prefill tokens
(prompt chunks, recomputes), or decode rows only, by how many (1-4, 5-16, 17-64, 65+ by
default). Prints, per bin, the steps, their seconds, the share of all step time and the
mean step. A step's time is its `t_end - t_start` (schedule, forward, sample, update);
what lies between steps (the engine's input handling) is reported as one more line.
The docs' "time split" tables (docs/benchmarks.md) come from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treadle.config import parse_int_list
from treadle.engine.trace import Trace, read_trace

DEFAULT_EDGES = (4, 16, 64)
"""Upper ends of the decode-only bins (rows); one more bin takes what lies above."""


def step_bin(features: dict, edges: tuple[int, ...]) -> str:
    """The bin of one step: "prefill" when it ran any prefill token, else the decode-rows
    range it falls in ("decode 1-4", ..., "decode 65+")."""
    if features["prefill_tokens"]:
        return "prefill"
    rows = features["decode_rows"]
    low = 1
    for high in edges:
        if rows <= high:
            return f"decode {low}-{high}"
        low = high + 1
    return f"decode {low}+"


def _features(step) -> dict:
    if step.features is not None:
        return step.features
    prefill = sum(n for _, n, kind in step.scheduled if kind == "prefill")
    rows = sum(1 for _, _, kind in step.scheduled if kind == "decode")
    return {"prefill_tokens": prefill, "decode_rows": rows}


def split(trace: Trace, edges: tuple[int, ...] = DEFAULT_EDGES) -> dict:
    """{"bins": {bin: {"steps", "seconds", "share", "ms_per_step"}}, "step_seconds",
    "between_steps_seconds", "span_seconds"} for one trace."""
    bins: dict[str, dict] = {}
    order = ["prefill"] + [step_bin({"prefill_tokens": 0, "decode_rows": e}, edges)
                           for e in (*edges, edges[-1] + 1)]
    for name in order:
        bins[name] = {"steps": 0, "seconds": 0.0}
    for step in trace.steps:
        entry = bins[step_bin(_features(step), edges)]
        entry["steps"] += 1
        entry["seconds"] += step.t_end - step.t_start
    total = sum(b["seconds"] for b in bins.values())
    for entry in bins.values():
        entry["share"] = entry["seconds"] / total if total else 0.0
        entry["ms_per_step"] = 1e3 * entry["seconds"] / entry["steps"] if entry["steps"] else 0.0
    span = trace.steps[-1].t_end - trace.steps[0].t_start if trace.steps else 0.0
    return {"bins": {k: v for k, v in bins.items() if v["steps"]}, "step_seconds": total,
            "between_steps_seconds": span - total, "span_seconds": span}


def format_split(result: dict) -> str:
    lines = ["| steps | count | seconds | share | ms per step |", "| --- | --- | --- | --- | --- |"]
    for name, b in result["bins"].items():
        lines.append(f"| {name} | {b['steps']} | {b['seconds']:.2f} | {100 * b['share']:.0f}% "
                     f"| {b['ms_per_step']:.1f} |")
    lines.append(f"| between steps | | {result['between_steps_seconds']:.2f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                        help="upper ends of the decode-only bins, in rows (default: "
                             "%(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    edges = tuple(parse_int_list(args.edges, "--edges"))
    for path in args.traces:
        result = split(read_trace(path), edges)
        if args.json:
            print(json.dumps({"trace": str(path), **result}))
        else:
            print(f"{path}:\n{format_split(result)}\n")


if __name__ == "__main__":
    main()
