"""`treadle bench fairness --suite NAME`: the VTC paper's fairness suites, fcfs, an RPM
limit and `fair` side by side, on the simulator's clock (default: treadle/sim/fairness.py)
or on the real engine (`--engine real`: treadle/bench/fairness.py).

Parses the options, runs each suite through the chosen runner, prints the figures
(Jain's index over windows of backlogged tenants, the largest gap in weighted service
between two backlogged tenants against the paper's bound of twice the largest request's
cost), writes one JSON and one PNG (per-tenant service over time, a panel per policy)
per suite. The figures are measure/fairness.py's; no benchmark logic lives here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treadle.config import parse_tenant_weights


def _cmd_bench_fairness(args: argparse.Namespace) -> int:
    from treadle.measure import fairness as fm
    from treadle.measure.report import environment, format_table, write_json

    suites = list(fm.SUITES) if args.suite == "all" else [args.suite]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    weights = parse_tenant_weights(args.tenant_weights)
    out_dir = Path(args.output or "results/fairness")
    common = dict(policies=policies, tenant_weights=weights, rpm_limit=args.rpm_limit,
                  seed=args.seed, window_s=args.window)
    if args.engine == "sim":
        from treadle.sim import fairness as runner
        setup = runner.sim_setup(args.hardware, args.model_shape)
        run = lambda name: runner.run_suite(  # noqa: E731
            name, duration_scale=args.duration_scale or 1.0,
            token_scale=args.token_scale or 1.0, setup=setup, **common)
    else:
        from treadle.bench import fairness as runner
        options = {"model": args.model or "demo", "dtype": args.dtype,
                   "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens}
        run = lambda name: runner.run_suite(  # noqa: E731
            name, duration_scale=args.duration_scale or 0.1,
            token_scale=args.token_scale or 0.25, capacity=args.capacity_rps, **common,
            **options)
    rows, all_within = [], True
    for name in suites:
        result = run(name)
        runs = result.pop("runs")
        png = fm.plot(runs, result["tenants"], weights, result["window_s"],
                      f"{name} ({result['engine']}): {result['description']}",
                      out_dir / f"{name}.png")
        result["runs"] = {policy: summary for policy, (_, summary) in runs.items()}
        result["environment"] = environment()
        path = write_json(out_dir / f"{name}.json", result)
        print(f"wrote {path} and {png}")
        for policy, s in result["runs"].items():
            rows.append({"suite": name, "policy": policy, "jain": s["jain_mean"],
                         "max gap": s["max_backlogged_gap"], "bound": s["bound"],
                         "within": s["within_bound"], "refused": s["num_refused"],
                         "tok/s": s["service_tokens_per_s"]})
            if policy == "fair":
                all_within = all_within and s["within_bound"]
    print(format_table(rows, ["suite", "policy", "jain", "max gap", "bound", "within",
                              "refused", "tok/s"]))
    print(json.dumps({"fair_within_bound_in_every_suite": all_within}))
    return 0 if all_within or "fair" not in policies else 1


def add_fairness(sub) -> None:
    """Register `bench fairness`."""
    from treadle.measure.fairness import SUITES

    fair = sub.add_parser("fairness", help="the VTC paper's fairness suites: fcfs, an RPM "
                                           "limit and fair side by side (Jain, gap vs bound)")
    fair.add_argument("--suite", default="overload", choices=[*SUITES, "all"],
                      help="; ".join(f"{s.name}: {s.description}" for s in SUITES.values()))
    fair.add_argument("--engine", choices=["sim", "real"], default="sim",
                      help="sim: the production scheduler on the simulator's clock (fast); "
                           "real: the engine in-process on the wall clock")
    fair.add_argument("--policies", default="fcfs,rpm,fair",
                      help="comma-separated, of fcfs, rpm (fcfs behind a per-tenant "
                           "requests-per-minute limit) and fair")
    fair.add_argument("--duration-scale", type=float, default=None,
                      help="times the paper's durations (default 1 on sim, 0.1 real)")
    fair.add_argument("--token-scale", type=float, default=None,
                      help="times the paper's request lengths (default 1 on sim, 0.25 real)")
    fair.add_argument("--tenant-weights", default="", help="fair policy weights, 'A=1,B=2'")
    fair.add_argument("--rpm-limit", type=int, default=None,
                      help="requests per minute per tenant for rpm (default: an equal share "
                           "of the measured capacity)")
    fair.add_argument("--window", type=float, default=None,
                      help="seconds per window of the Jain index and the plot")
    fair.add_argument("--seed", type=int, default=0)
    fair.add_argument("--hardware", default="cpu-here", help="sim: hardware preset")
    fair.add_argument("--model-shape", default="smollm2-135m", help="sim: model shape preset")
    fair.add_argument("--model", default=None, help="real: the model (the demo model: "
                                                    "SmolLM2-135M's shapes)")
    fair.add_argument("--dtype", default="bfloat16", help="real: the engine's dtype")
    fair.add_argument("--max-num-seqs", type=int, default=32, help="real: max_num_seqs")
    fair.add_argument("--max-num-batched-tokens", type=int, default=256,
                      help="real: max_num_batched_tokens")
    fair.add_argument("--capacity-rps", type=float, default=None,
                      help="real: requests per second the suites are scaled to (measured "
                           "on a backlog when not given)")
    fair.add_argument("--output", default=None, help="folder for the JSON and PNG per suite")
    fair.set_defaults(func=_cmd_bench_fairness)
