"""Where a run's time went, by kind of step: `python -m treadle.bench.step_split TRACE...`.

Reads per-step traces (`--trace` of `treadle bench throughput`, `treadle serve` and the
others; treadle/engine/trace.py) and bins each step by what it ran: any prefill tokens
(prompt chunks, recomputes), or decode rows only, by how many (1-4, 5-16, 17-64, 65+ by
default). Prints, per bin, the steps, their seconds, the share of all step time and the
mean step. A step's time is its `t_end - t_start` (schedule, forward, sample, update);
what lies between steps (the engine's input handling) is reported as one more line.
With `--roofline` each bin also gets the arithmetic rate and the read rate its steps
achieved, and with `--peak-gflops` and `--read-gbs` (the machine's measured matmul peak
and memory read rate) its floor and how far above it the steps ran (bench/step_floor.py;
traces of the benchmark model). On a shared host the read rate moves by the minute, so the
achieved rates are the sturdier figures for memory-bound steps. The docs' "time split"
tables (docs/benchmarks.md) come from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treadle.bench.step_floor import StepRoofline, step_rooflines
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


def split(trace: Trace, edges: tuple[int, ...] = DEFAULT_EDGES,
          rooflines: list[StepRoofline] | None = None) -> dict:
    """{"bins": {bin: {"steps", "seconds", "share", "ms_per_step"}}, "step_seconds",
    "between_steps_seconds", "span_seconds"} for one trace. `rooflines` (one per step,
    step_floor.step_rooflines): each bin also gets "gflop_per_s" and "gb_per_s", and
    "floor_seconds" and "x_floor" where they carry floors."""
    with_floor = rooflines is not None and all(r.floor_seconds is not None
                                               for r in rooflines)
    bins: dict[str, dict] = {}
    order = ["prefill"] + [step_bin({"prefill_tokens": 0, "decode_rows": e}, edges)
                           for e in (*edges, edges[-1] + 1)]
    for name in order:
        bins[name] = {"steps": 0, "seconds": 0.0}
        if rooflines is not None:
            bins[name] |= {"flops": 0.0, "bytes": 0.0}
        if with_floor:
            bins[name]["floor_seconds"] = 0.0
    for i, step in enumerate(trace.steps):
        entry = bins[step_bin(_features(step), edges)]
        entry["steps"] += 1
        entry["seconds"] += step.t_end - step.t_start
        if rooflines is not None:
            entry["flops"] += rooflines[i].flops
            entry["bytes"] += rooflines[i].bytes
        if with_floor:
            entry["floor_seconds"] += rooflines[i].floor_seconds
    total = sum(b["seconds"] for b in bins.values())
    for entry in bins.values():
        entry["share"] = entry["seconds"] / total if total else 0.0
        entry["ms_per_step"] = 1e3 * entry["seconds"] / entry["steps"] if entry["steps"] else 0.0
        if rooflines is not None:
            seconds = entry["seconds"] or float("inf")
            entry["gflop_per_s"] = entry.pop("flops") / seconds / 1e9
            entry["gb_per_s"] = entry.pop("bytes") / seconds / 1e9
        if with_floor:
            entry["x_floor"] = (entry["seconds"] / entry["floor_seconds"]
                                if entry["floor_seconds"] else 0.0)
    span = trace.steps[-1].t_end - trace.steps[0].t_start if trace.steps else 0.0
    return {"bins": {k: v for k, v in bins.items() if v["steps"]}, "step_seconds": total,
            "between_steps_seconds": span - total, "span_seconds": span}


def format_split(result: dict) -> str:
    bins = result["bins"].values()
    with_rates = any("gb_per_s" in b for b in bins)
    with_floor = any("floor_seconds" in b for b in bins)
    head = "| steps | count | seconds | share | ms per step |"
    extra = 2 * with_rates + 2 * with_floor
    if with_rates:
        head += " GFLOP/s | GB/s |"
    if with_floor:
        head += " floor s | x floor |"
    lines = [head, "|" + " --- |" * (5 + extra)]
    for name, b in result["bins"].items():
        line = (f"| {name} | {b['steps']} | {b['seconds']:.2f} | {100 * b['share']:.0f}% "
                f"| {b['ms_per_step']:.1f} |")
        if with_rates:
            line += f" {b['gflop_per_s']:.0f} | {b['gb_per_s']:.1f} |"
        if with_floor:
            line += f" {b['floor_seconds']:.2f} | {b['x_floor']:.2f} |"
        lines.append(line)
    lines.append(f"| between steps | | {result['between_steps_seconds']:.2f} | | |"
                 + " |" * extra)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                        help="upper ends of the decode-only bins, in rows (default: "
                             "%(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--roofline", action="store_true",
                        help="each bin's achieved GFLOP/s and GB/s (benchmark-model traces)")
    parser.add_argument("--peak-gflops", type=float,
                        help="the measured matmul peak (GFLOP/s): with --read-gbs, each bin's "
                             "floor too (implies --roofline)")
    parser.add_argument("--read-gbs", type=float,
                        help="the measured memory read rate (GB/s), with --peak-gflops")
    args = parser.parse_args(argv)
    edges = tuple(parse_int_list(args.edges, "--edges"))
    if (args.peak_gflops is None) != (args.read_gbs is None):
        parser.error("--peak-gflops and --read-gbs go together")
    for path in args.traces:
        trace = read_trace(path)
        rooflines = None
        if args.roofline or args.peak_gflops is not None:
            try:
                rooflines = step_rooflines(trace, args.peak_gflops, args.read_gbs)
            except ValueError as e:
                parser.error(f"{path}: {e}")
        result = split(trace, edges, rooflines)
        if args.json:
            print(json.dumps({"trace": str(path), **result}))
        else:
            print(f"{path}:\n{format_split(result)}\n")


if __name__ == "__main__":
    main()
