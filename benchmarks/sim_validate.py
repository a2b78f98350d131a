"""Validate the simulator against real runs on this machine (docs/simulator.md).

    python benchmarks/sim_validate.py real --out DIR      # the two real runs, back to back
    python benchmarks/sim_validate.py real --num-threads 2 --out DIR   # the server on 2 cores
    python benchmarks/sim_validate.py real --length 4 --out DIR   # 4x as many requests each
    python benchmarks/sim_validate.py real-concurrent --out DIR   # the two at once
    python benchmarks/sim_validate.py compare --out DIR   # fit each, simulate the other
    python benchmarks/sim_validate.py compare --out DIR --fit-dir DIR2   # fit on DIR2's runs
    python benchmarks/sim_validate.py compare --out DIR --fit-dir DIR2 --pooled  # one fit of both
    python benchmarks/sim_validate.py compare ... --no-front-end   # engine-side latencies only
    python benchmarks/sim_validate.py floor --out DIR --fit-dir DIR2   # DIR2's measured figures
                                                          # as the prediction of DIR's
    python benchmarks/sim_validate.py repeats --out D2,D3,D4 --fit-dir D1   # D1's pooled fit
                              # against each of the repeated pairs and their median figures
    python benchmarks/sim_validate.py calibrate --out DIR  # a sweep of step shapes
    python benchmarks/sim_validate.py calibrate --served --out DIR  # ... through the server
    python benchmarks/sim_validate.py compare --out DIR --fit-trace DIR/calibration.trace.jsonl

`real` runs, with the same model options (`--model demo`: the SmolLM2-135M shape with
random weights, as benchmarks/compare_azure.yaml; bf16,
--num-threads 1, max_model_len 2048, 1 GiB of KV) and each with a per-step trace:
  1. the azure-conv replay of benchmarks/compare_azure.yaml (first 100 requests, tokens
     x0.25, arrival gaps x2) over HTTP: `treadle bench serve --launch "... --trace ..."`;
  2. the mixed-priority workload of treadle.measure.workloads (priority policy, budget 256,
     32 sequences) over HTTP too, by measure.http_load's load generator at the workload's own
     arrival times and priorities (the same serving path, so one fit can carry over).
`--length K` makes both K times as long (the first 100 K azure requests, K x 40 s of
mixed arrivals): a p99 over 100 requests is their largest one or two, so one request
caught by a race between arrivals moves it by 2-3x from one run to the next (docs/
simulator.md, round 17); over 400 it rests on four or more. `compare` reads K from the
target folder's real.json. It records the load average before and after each.
`real-concurrent` runs the two at the same time (the mixed one `--mixed-delay` seconds
later), so that both see the same machine: on a shared machine the speed of a step
drifts by 1.3-2x from one minute to the next, more than any model error. `compare` fits
a step-time model on each run's trace and simulates the other run's workload with it (and its own, for
reference), with the other run's scheduler settings, and prints TTFT / TPOT p50 and p99
and throughput: measured, simulated, error. Every figure is measured in the runs it
reports; the machine is shared, so the load is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODEL_OPTIONS = {"model": "demo", "dtype": "bfloat16", "num_threads": 1, "max_model_len": 2048,
                 "kv_cache_memory": "1GiB", "swap_space": "256MiB"}
AZURE = {"num_requests": 100, "token_scale": 0.25, "time_scale": 0.5, "max_model_len": 2048}
MIXED_DURATION_S = 40.0
"""Seconds of mixed-priority arrivals at --length 1 (treadle.measure.workloads' default)."""
MIXED_SCHEDULER = {"scheduling_policy": "priority", "max_num_batched_tokens": 256,
                   "max_num_seqs": 32}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def real_azure(out: Path, length: int = 1) -> dict:
    import shlex

    launch = shlex.join(_launch_args(out / "azure.trace.jsonl"))
    cmd = [sys.executable, "-m", "treadle.cli", "--log-level", "WARNING", "bench", "serve",
           "--launch", launch, "--workload", "azure-conv",
           "--num-requests", str(AZURE["num_requests"] * length),
           "--token-scale", str(AZURE["token_scale"]), "--time-scale", str(AZURE["time_scale"]),
           "--max-model-len", str(AZURE["max_model_len"]), "--output", str(out / "azure.json")]
    before = _load()
    started = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {"load_before": before, "load_after": _load(), "wall_s": time.time() - started}


def _launch_args(trace: Path, scheduler: dict | None = None) -> list[str]:
    options = MODEL_OPTIONS | (scheduler or {})
    args = ["--trace", str(trace)]
    for k, v in options.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def real_mixed(out: Path, length: int = 1) -> dict:
    """The mixed-priority workload over HTTP (measure.http_load's load generator at the
    workload's own arrival times and priorities), against a server with a trace."""
    import asyncio

    from treadle.measure.launch import launched_server
    from treadle.measure.report import write_json
    from treadle.measure.workloads import mixed_priority_workload
    from treadle.measure.http_load import request_records, run_load, served_model, summarize
    from treadle.measure.workloads import Workload, WorkloadRequest

    replay = mixed_priority_workload(duration_s=MIXED_DURATION_S * length)
    workload = Workload("mixed-priority", [WorkloadRequest(r.prompt_token_ids, r.max_tokens,
                                                           r.arrival_time) for r in replay])
    priorities = [r.priority for r in replay]
    with launched_server(_launch_args(out / "mixed.trace.jsonl", MIXED_SCHEDULER)) as (url, _):
        model = served_model(url)["id"]  # served_model returns the whole model card
        before = _load()
        results, duration = asyncio.run(run_load(url, workload, model, priorities=priorities,
                                                 use_trace_times=True, progress=False))
        after = _load()
    summary = summarize(results, duration)
    for level in (0, 1):
        summary[f"priority_{level}"] = summarize([r for r in results if r.priority == level],
                                                 duration)
    summary["requests"] = request_records(results)
    write_json(out / "mixed.json", summary)
    return {"load_before": before, "load_after": after, "wall_s": duration}


def front_end_ms(fit_dir: Path, names: tuple[str, ...]) -> float:
    """The front end's milliseconds per request measured on `fit_dir`'s served runs `names`
    (treadle/sim/front_end.py; the median of their medians)."""
    import statistics

    from treadle.engine.trace import read_trace
    from treadle.sim.front_end import front_end_seconds

    return 1000.0 * statistics.median(
        front_end_seconds(read_trace(fit_dir / f"{name}.trace.jsonl"),
                          json.loads((fit_dir / f"{name}.json").read_text())["requests"])
        ["front_end_s"] for name in names)


def simulate_run(fit_trace: Path, target: str, out: Path, front_end: float = 0.0,
                 length: int = 1) -> dict:
    """Simulate run `target` ('azure' or 'mixed') with a model fitted on `fit_trace`, with
    the target run's own scheduler settings and memory (its trace header), and `front_end`
    milliseconds per request outside the engine; `length`: the real runs' --length."""
    from treadle.sim.config import SimConfig
    from treadle.engine.trace import read_trace
    from treadle.sim.simulate import simulate

    header = read_trace(out / f"{target}.trace.jsonl").engine
    options = {k: v for k, v in header["scheduler"].items() if k != "trace"}
    options |= {"num_kv_blocks": header["num_kv_blocks"], "block_size": header["block_size"]}
    if target == "azure":
        config = SimConfig(step_model=f"fit:{fit_trace}",
                           num_requests=AZURE["num_requests"] * length,
                           token_scale=AZURE["token_scale"], time_scale=AZURE["time_scale"],
                           max_model_len=AZURE["max_model_len"], front_end_ms=front_end)
    else:
        config = SimConfig(step_model=f"fit:{fit_trace}", workload="mixed-priority",
                           mixed_duration_s=MIXED_DURATION_S * length,
                           max_model_len=MODEL_OPTIONS["max_model_len"], front_end_ms=front_end)
    return simulate(config, options)


def calibration(out: Path, served: bool = False) -> dict:
    """`treadle simulate calibrate` with the real runs' model options: its trace is a fit
    source that has seen every step shape (compare --fit-trace). served: through the
    server and the load generator, as the real runs are served."""
    from treadle.sim.calibrate import calibrate, calibrate_served

    before = _load()
    run = calibrate_served if served else calibrate
    result = run(out / "calibration.trace.jsonl", **MODEL_OPTIONS)
    return result | {"load_before": before, "load_after": _load(), "served": served}


def compare(out: Path, fit_dir: Path | None = None, fit_trace: Path | None = None,
            pooled: bool = False, with_front_end: bool = True) -> dict:
    """Fit on each run's trace in `fit_dir` (default: `out` itself), or on the one trace
    `fit_trace` (a calibration run's), or (`pooled`) on both of `fit_dir`'s runs as one
    pool of steps, and simulate each run in `out`. With another pair's folder as
    `fit_dir`, every model comes from a different run, the same workload's included.
    with_front_end: each simulation adds the front end measured on its fit's served runs
    (none for a calibration trace, which is not served by the load generator)."""
    from treadle.measure.report import format_table, write_json
    from treadle.sim.results import compare as compare_results

    fit_dir = fit_dir or out
    if fit_trace is not None:
        sources = {fit_trace.name.split(".")[0]: fit_trace}
    elif pooled:
        sources = {"pooled": ",".join(str(fit_dir / f"{name}.trace.jsonl")
                                      for name in ("azure", "mixed"))}
    else:
        sources = {name: fit_dir / f"{name}.trace.jsonl" for name in ("azure", "mixed")}
    report = {"real": json.loads((out / "real.json").read_text())
              if (out / "real.json").exists() else {}, "fit_dir": str(fit_dir),
              "fit_sources": {k: str(v) for k, v in sources.items()}}
    rows = []
    for fit_on, source in sources.items():
        front = (0.0 if fit_trace is not None or not with_front_end else
                 front_end_ms(fit_dir, ("azure", "mixed") if pooled else (fit_on,)))
        report[f"front_end_ms_{fit_on}"] = front
        for target in ("azure", "mixed"):
            sim = simulate_run(source, target, out, front, report["real"].get("length", 1))
            measured = json.loads((out / f"{target}.json").read_text())
            fit = sim["simulation"]["step_model"]["fit"]
            for row in compare_results(sim, measured):
                rows.append({"fit on": fit_on, "run": target, **row})
            report[f"fit_{fit_on}_sim_{target}"] = {
                "fit": {k: fit[k] for k in ("num_steps", "mean_abs_pct_error",
                                            "weighted_abs_pct_error", "r2", "step_time_ratio",
                                            "busy_time_ratio", "narrow_max_rows") if k in fit},
                "simulated": {k: sim[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms",
                                                  "output_tokens_per_s", "total_tokens_per_s",
                                                  "duration_s")}}
    report["rows"] = rows
    print(format_table([r for r in rows if not r["figure"].startswith("e2e")],
                       ["fit on", "run", "figure", "measured", "simulated", "error"]))
    name = ("validation.json" if fit_dir == out and fit_trace is None and not pooled else
            f"validation-fit-{next(iter(sources)) if fit_trace else fit_dir.name}"
            f"{'-pooled' if pooled else ''}.json")
    write_json(out / name, report)
    return report


def median_result(results: list[dict]) -> dict:
    """Per figure `compare` reads, the median over several runs' bench-serve results (the
    project's rule for a measured figure: the median of repeated runs)."""
    import statistics

    from treadle.sim.results import _COMPARED

    median: dict = {}
    for key, stat in _COMPARED:
        values = [r[key] if stat is None else r[key][stat] for r in results
                  if (r.get(key) if stat is None else (r.get(key) or {}).get(stat)) is not None]
        if not values:
            continue
        if stat is None:
            median[key] = statistics.median(values)
        else:
            median.setdefault(key, {})[stat] = statistics.median(values)
    return median


def repeats(outs: list[Path], fit_dir: Path, with_front_end: bool = True) -> dict:
    """The pooled fit of `fit_dir`'s pair simulates each workload once (with the first
    target's scheduler settings and memory, the same in every `real` run), compared with
    each repeated pair in `outs` and with the median of their measured figures."""
    from treadle.measure.report import format_table, write_json
    from treadle.sim.results import compare as compare_results

    lengths = {json.loads((d / "real.json").read_text()).get("length", 1)
               for d in [fit_dir, *outs]}
    if len(lengths) != 1:
        raise SystemExit(f"the runs were made at different --length: {sorted(lengths)}")
    source = ",".join(str(fit_dir / f"{name}.trace.jsonl") for name in ("azure", "mixed"))
    front = front_end_ms(fit_dir, ("azure", "mixed")) if with_front_end else 0.0
    report: dict = {"fit_dir": str(fit_dir), "runs": [str(d) for d in outs],
                    "front_end_ms": front, "length": lengths.pop()}
    rows = []
    for target in ("azure", "mixed"):
        sim = simulate_run(Path(source), target, outs[0], front, report["length"])
        measured = [json.loads((d / f"{target}.json").read_text()) for d in outs]
        per_run = [compare_results(sim, m) for m in measured]
        for i, row in enumerate(compare_results(sim, median_result(measured))):
            if row["figure"].startswith(("e2e", "total")):
                continue
            rows.append({"run": target, "figure": row["figure"],
                         "measured (median)": round(row["measured"], 2),
                         "simulated": round(row["simulated"], 2),
                         "error": round(row["error"], 3),
                         "each run's error": " ".join(f"{r[i]['error']:+.2f}" for r in per_run)})
        report[target] = {"simulated": {k: sim[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms",
                                                            "output_tokens_per_s")},
                          "measured_median": median_result(measured)}
    report["rows"] = rows
    print(format_table(rows, list(rows[0])))
    write_json(fit_dir / f"repeats-{'-'.join(d.name for d in outs)}.json", report)
    return report


def floor(out: Path, fit_dir: Path) -> dict:
    """The host's own reproducibility: `fit_dir`'s measured figures taken as the
    prediction of `out`'s (the same runs, minutes apart), with the errors `compare`
    prints for a simulation."""
    from treadle.measure.report import format_table

    rows = []
    for target in ("azure", "mixed"):
        other = json.loads((fit_dir / f"{target}.json").read_text())
        measured = json.loads((out / f"{target}.json").read_text())
        for figure, stat in (("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median"),
                             ("tpot_ms", "p99"), ("output_tokens_per_s", None)):
            m = measured[figure] if stat is None else measured[figure][stat]
            p = other[figure] if stat is None else other[figure][stat]
            rows.append({"run": target, "figure": f"{figure} {stat or ''}".strip(),
                         "measured": round(m, 2), f"{fit_dir.name} measured": round(p, 2),
                         "error": round(p / m - 1, 3)})
    print(format_table(rows, list(rows[0])))
    return {"rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["real", "real-concurrent", "calibrate", "compare",
                                         "floor", "repeats"])
    parser.add_argument("--out", required=True,
                        help="the run's folder (repeats: several, comma-separated)")
    parser.add_argument("--mixed-delay", type=float, default=20.0,
                        help="real-concurrent: seconds after the azure run's start")
    parser.add_argument("--fit-dir", default=None,
                        help="compare: fit on the traces of this folder's runs (another "
                             "`real` pair) instead of --out's own")
    parser.add_argument("--fit-trace", default=None,
                        help="compare: fit every simulation on this one trace (e.g. "
                             "`calibrate`'s DIR/calibration.trace.jsonl)")
    parser.add_argument("--pooled", action="store_true",
                        help="compare: one fit of both of the fit folder's runs together")
    parser.add_argument("--served", action="store_true",
                        help="calibrate: through the server and the load generator")
    parser.add_argument("--no-front-end", action="store_true",
                        help="compare: simulate engine-side latencies only (no front end "
                             "measured on the fit's served runs)")
    parser.add_argument("--length", type=int, default=1,
                        help="real: both workloads this many times as long (azure: the first "
                             "100 x K requests; mixed: 40 x K seconds of arrivals)")
    parser.add_argument("--num-threads", type=int, default=MODEL_OPTIONS["num_threads"],
                        help="real / calibrate: the server's compute threads (default 1, "
                             "a core left to the load generator; on a 2-core host where the "
                             "azure replay saturates one thread, 2 keeps up with it)")
    args = parser.parse_args()
    MODEL_OPTIONS["num_threads"] = args.num_threads
    if args.what == "repeats":
        if not args.fit_dir:
            parser.error("repeats needs --fit-dir (the pair whose pooled fit simulates)")
        repeats([Path(d) for d in args.out.split(",") if d], Path(args.fit_dir),
                not args.no_front_end)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "real":
        real = {"azure": real_azure(out, args.length)}
        real["mixed"] = real_mixed(out, args.length)
        real["length"] = args.length
    elif args.what == "real-concurrent":
        import threading

        real = {}
        azure = threading.Thread(target=lambda: real.update(azure=real_azure(out)))
        azure.start()
        time.sleep(args.mixed_delay)
        real["mixed"] = real_mixed(out)
        azure.join()
        real["concurrent"] = {"mixed_delay_s": args.mixed_delay}
    elif args.what == "calibrate":
        result = calibration(out, served=args.served)
        (out / "calibration.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    if args.what in ("real", "real-concurrent"):
        real["model_options"] = dict(MODEL_OPTIONS)
        (out / "real.json").write_text(json.dumps(real, indent=2))
        print(json.dumps(real, indent=2))
    elif args.what == "floor":
        if not args.fit_dir:
            parser.error("floor needs --fit-dir (the runs whose measured figures predict)")
        floor(out, Path(args.fit_dir))
    elif args.what == "compare":
        compare(out, Path(args.fit_dir) if args.fit_dir else None,
                Path(args.fit_trace) if args.fit_trace else None, args.pooled,
                not args.no_front_end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
