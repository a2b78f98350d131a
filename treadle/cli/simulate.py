"""`treadle simulate`: the command line of the capacity simulator.

    treadle simulate [options]            one simulation: JSON result + plots in --output
    treadle simulate size [options]       the smallest fleet meeting an SLO
    treadle simulate fit TRACE.jsonl...   fit a step-time model on real runs' traces
    treadle simulate measure-hardware     measure this machine's roofline preset (YAML)
    treadle simulate calibrate --trace F  the real engine over a sweep of step shapes
    treadle simulate compare SIM.json MEASURED.json   figure by figure, with errors

Flags are generated from SimConfig, SizingConfig (treadle/sim/config.py) and the engine's
SchedulerConfig and CacheConfig (treadle/config.py), so a replica takes the same options
`treadle serve` does. This module parses and prints; the work is in treadle/sim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from treadle.config import (CacheConfig, SchedulerConfig, add_config_arguments,
                            add_dataclass_arguments, dataclass_from_args, parse_int_list)
from treadle.sim.calibrate import DEFAULT_ROWS
from treadle.sim.config import SimConfig, SizingConfig

_ENGINE_TYPES = (SchedulerConfig, CacheConfig)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, SimConfig, "simulation options")
    add_dataclass_arguments(parser, SchedulerConfig, "scheduler options (every replica)",
                            skip=("trace",))
    add_dataclass_arguments(parser, CacheConfig, "cache options (every replica)")
    parser.add_argument("--no-request-records", action="store_true",
                        help="leave the per-request records out of the JSON result")


def _engine_options(args: argparse.Namespace) -> dict:
    import dataclasses

    names = {f.name for t in _ENGINE_TYPES for f in dataclasses.fields(t)} - {"trace"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def environment() -> dict:
    """What a simulation's speed depends on (no torch, no host name)."""
    from treadle.measure.report import cpu_info

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_model": cpu_info()[0], "cpu_count": os.cpu_count(),
            "load_average": list(load) if load else None}


def _print_summary(summary: dict) -> None:
    from treadle.measure.report import format_table

    sim = summary["simulation"]
    rows = [{"figure": name, "mean": summary[key]["mean"], "median": summary[key]["median"],
             "p90": summary[key]["p90"], "p99": summary[key]["p99"]}
            for name, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"),
                              ("ITL ms", "itl_ms"), ("E2E ms", "e2e_ms"))]
    print(format_table(rows, ["figure", "mean", "median", "p90", "p99"]))
    print(f"{summary['num_ok']}/{summary['num_requests']} requests ok over "
          f"{summary['duration_s']:.1f} simulated s: {summary['output_tokens_per_s']:.1f} "
          f"output tok/s, {summary['total_tokens_per_s']:.1f} total tok/s, goodput "
          f"{summary['goodput_requests_per_s']:.3f} req/s")
    print(f"{sim['mode']}, {sim['num_replicas']} replicas, step model "
          f"{sim['step_model']['name']}: {sim['num_steps']} steps simulated in "
          f"{sim['wall_s']:.1f} s wall")


def _cmd_run(args: argparse.Namespace) -> int:
    from treadle.measure.report import write_json
    from treadle.sim.results import plot
    from treadle.sim.simulate import simulate

    config = dataclass_from_args(SimConfig, args)
    summary = simulate(config, _engine_options(args), not args.no_request_records)
    summary["environment"] = environment()
    out_dir = Path(config.output or Path("results") / "simulate")
    _print_summary(summary)
    print("wrote", write_json(out_dir / "simulate.json", summary))
    if summary.get("requests"):
        for path in plot(summary, out_dir, summary["simulation"]["step_model"]["name"]):
            print("wrote", path)
    return 0


def _cmd_size(args: argparse.Namespace) -> int:
    from treadle.measure.report import write_json
    from treadle.sim.sizing import plot_search, search, table

    config = dataclass_from_args(SimConfig, args)
    sizing = dataclass_from_args(SizingConfig, args)
    result = search(sizing, config, _engine_options(args), progress=True)
    result["environment"] = environment()
    print(table(result))
    out_dir = Path(config.output or Path("results") / "simulate-size")
    print("wrote", write_json(out_dir / "size.json", result))
    print("wrote", plot_search(result, out_dir))
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from treadle.engine.trace import read_trace
    from treadle.sim.fit import evaluate, fit_trace

    model = fit_trace([read_trace(path) for path in args.trace], ",".join(args.trace))
    report = {"model": model.describe()}
    if args.check:
        report["check"] = {path: evaluate(model, read_trace(path)) for path in args.check}
    fit = model.fit_report
    print(f"fit on {fit['num_steps']} steps of {' + '.join(args.trace)}: intercept "
          f"{model.intercept * 1e3:.3f} ms; " + ", ".join(
              f"{k} {v * 1e6:.4g} us" for k, v in model.coefficients.items() if v))
    if model.narrow_max_rows:
        print(f"  steps of <= {model.narrow_max_rows} linear rows: intercept "
              f"{model.narrow_intercept * 1e3:.3f} ms; " + ", ".join(
                  f"{k} {v * 1e6:.4g} us" for k, v in model.narrow_coefficients.items() if v))
    for name, errors in [("fit", fit)] + list(report.get("check", {}).items()):
        print(f"  {name}: mean |error| {errors['mean_abs_pct_error']:.1%}, weighted "
              f"{errors['weighted_abs_pct_error']:.1%}, R^2 {errors['r2']:.3f}, predicted/"
              f"measured step time {errors['step_time_ratio']:.3f}, busy time "
              f"{errors.get('busy_time_ratio', float('nan')):.3f}")
    if fit.get("num_outliers"):
        clean = fit["without_outliers"]
        print(f"  {fit['num_outliers']} outlier steps ({fit['outlier_seconds']:.2f} s) left "
              f"out of the fit; without them: mean |error| {clean['mean_abs_pct_error']:.1%}, "
              f"weighted {clean['weighted_abs_pct_error']:.1%}, R^2 {clean['r2']:.3f}")
    if args.served_result:
        report["front_end"] = _front_end(args.trace, args.served_result)
        front = report["front_end"]
        print(f"  front end (client TTFT - engine TTFT, median of {front['num_requests']} "
              f"requests): {front['front_end_s'] * 1e3:.2f} ms (p10 {front['p10_s'] * 1e3:.2f}, "
              f"p90 {front['p90_s'] * 1e3:.2f}); simulate with --front-end-ms "
              f"{front['front_end_s'] * 1e3:.2f}")
    if args.save:
        print("wrote", model.save(args.save))
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    return 0


def _front_end(traces: list[str], results: list[str]) -> dict:
    """The front end's median over served runs: each trace with the bench serve result of
    the same run (given in the same order), their per-request differences pooled."""
    import statistics

    from treadle.engine.trace import read_trace
    from treadle.sim.front_end import front_end_seconds

    if len(results) != len(traces):
        raise SystemExit(f"treadle simulate fit: {len(traces)} traces and {len(results)} "
                         "--served-result files; give one result per trace, in order")
    runs = [front_end_seconds(read_trace(t), json.loads(Path(r).read_text())["requests"])
            for t, r in zip(traces, results)]
    if len(runs) == 1:
        return runs[0]
    return {"front_end_s": statistics.median(r["front_end_s"] for r in runs),
            "num_requests": sum(r["num_requests"] for r in runs),
            "p10_s": min(r["p10_s"] for r in runs), "p90_s": max(r["p90_s"] for r in runs),
            "runs": runs}


def _cmd_measure(args: argparse.Namespace) -> int:
    import yaml

    from treadle.sim.hardware import measure_cpu_here

    preset = measure_cpu_here(repeats=args.repeats)
    preset["description"] += f"; load average {environment()['load_average']}"
    text = yaml.safe_dump(preset, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print("wrote", args.out)
    print(text, end="")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from treadle.config import options_from_args
    from treadle.sim.calibrate import calibrate, calibrate_served

    if not args.trace:
        raise SystemExit("treadle simulate calibrate: --trace FILE (the trace to write) "
                         "is required")
    options = options_from_args(args)
    trace = options.pop("trace")
    run = calibrate_served if args.served else calibrate
    result = run(trace, rows=args.rows, prompt_len=tuple(args.prompt_len),
                 max_tokens=tuple(args.max_tokens), sweep_seed=options.get("seed") or 0,
                 **options)
    print(json.dumps(result, indent=2))
    print(f"fit it: treadle simulate fit {trace}; simulate with it: treadle simulate "
          f"--step-model fit:{trace} ...")
    return 1 if result["num_errors"] else 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from treadle.measure.report import format_table
    from treadle.sim.results import compare

    simulated = json.loads(Path(args.simulated).read_text())
    measured = json.loads(Path(args.measured).read_text())
    print(format_table(compare(simulated, measured),
                       ["figure", "measured", "simulated", "error"]))
    return 0


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        return parse_int_list(text, "--rows")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `treadle simulate` and its subcommands on the top-level CLI."""
    sim = subparsers.add_parser("simulate", help="capacity simulator: the real scheduler on a "
                                                 "step-time model (docs/simulator.md)")
    _add_run_arguments(sim)
    sim.set_defaults(func=_cmd_run)
    sub = sim.add_subparsers(dest="simulate_command")
    size = sub.add_parser("size", help="the smallest fleet that meets an SLO")
    _add_run_arguments(size)
    add_dataclass_arguments(size, SizingConfig, "sizing options")
    size.set_defaults(func=_cmd_size)
    fit = sub.add_parser("fit", help="fit a step-time model on a --trace file of a real run "
                         "(several: one fit of all their steps)")
    fit.add_argument("trace", nargs="+")
    fit.add_argument("--check", action="append", default=[],
                     help="also report the fit's errors on this trace (repeatable)")
    fit.add_argument("--save", default=None, help="write the model as JSON (linear:FILE)")
    fit.add_argument("--served-result", action="append", default=[],
                     help="the `treadle bench serve` result of a traced run (one per trace, "
                          "in order): also report the front end's milliseconds per request "
                          "(for --front-end-ms)")
    fit.add_argument("--json", action="store_true", help="print the whole report as JSON")
    fit.set_defaults(func=_cmd_fit)
    hw = sub.add_parser("measure-hardware", help="measure this CPU's roofline preset (YAML)")
    hw.add_argument("--out", default=None, help="YAML file to write")
    hw.add_argument("--repeats", type=int, default=10)
    hw.set_defaults(func=_cmd_measure)
    cal = sub.add_parser("calibrate", help="run the real engine through a sweep of step "
                                           "shapes and write its --trace (a fit source for "
                                           "any workload)")
    cal.add_argument("--rows", type=_batch_sizes, default=DEFAULT_ROWS,
                     help="batch sizes swept, comma-separated (those above max_num_seqs "
                          "are dropped)")
    cal.add_argument("--prompt-len", type=int, nargs=2, default=[16, 1024],
                     metavar=("MIN", "MAX"), help="prompt lengths, drawn uniformly")
    cal.add_argument("--max-tokens", type=int, nargs=2, default=[4, 64],
                     metavar=("MIN", "MAX"), help="output lengths, drawn per request")
    cal.add_argument("--served", action="store_true",
                     help="run the sweep through `treadle serve` and the load generator "
                          "(the steps of a served run) instead of the in-process engine")
    add_config_arguments(cal)
    cal.set_defaults(func=_cmd_calibrate)
    cmp_ = sub.add_parser("compare", help="a simulated result against a measured one "
                                          "(both bench-serve-shaped JSON)")
    cmp_.add_argument("simulated")
    cmp_.add_argument("measured")
    cmp_.set_defaults(func=_cmd_compare)
    return sim
