"""High-priority TTFT under a saturating low-priority background, against its idle TTFT
(issue 50's target: p99 <= 2x idle), on the simulator.

The mixed-priority workload (treadle/measure/workloads.py: a low-priority background plus
a stream of short high-priority requests), its arrivals compressed `--time-scale` times
so that the background saturates the engine, replayed on one simulated replica (the
production scheduler; roofline SmolLM2-135M on this machine's measured CPU) under fcfs,
priority, and fcfs with the background in the batch band; then the high-priority
requests alone (idle). The real engine's run is `treadle bench scheduling
mixed-priority`.

    python benchmarks/priority_ttft.py --time-scale 1 1.5 3
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace


def run(time_scale: float, policy: str, background: str | None, options: dict) -> dict:
    """High-priority TTFT percentiles (ms) of one run; `background`: None (drop it),
    "interactive" or "batch" (its band)."""
    from treadle.sim.config import SimConfig
    from treadle.sim.results import summarize_fleet
    from treadle.sim.simulate import build
    from treadle.sim.simulate import run as run_sim

    config = SimConfig(workload="mixed-priority", step_model="roofline", hardware="cpu-here",
                       model_shape="smollm2-135m", max_model_len=2048, time_scale=time_scale)
    setup = build(config, {"scheduling_policy": policy, **options})
    if background is None:
        setup.requests = [r for r in setup.requests if r.label == "high"]
    else:
        setup.requests = [replace(r, band=background) if r.label == "background" else r
                          for r in setup.requests]
    summary = summarize_fleet(run_sim(setup), with_requests=False)
    high = summary.get("label_high", summary)["ttft_ms"]
    return {"high_ttft_p50_ms": high["median"], "high_ttft_p99_ms": high["p99"],
            "total_tokens_per_s": summary["total_tokens_per_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-scale", type=float, nargs="+", default=[1.0, 1.5, 3.0])
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another scheduler option for every run, e.g. "
                        "priority_aging=0 (repeatable)")
    args = parser.parse_args(argv)
    options = {"max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens}
    for item in args.set:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    results = {}
    for ts in args.time_scale:
        idle = run(ts, "fcfs", None, options)
        rows = {"idle": idle,
                "fcfs": run(ts, "fcfs", "interactive", options),
                "priority": run(ts, "priority", "interactive", options),
                "fcfs, background in the batch band": run(ts, "fcfs", "batch", options),
                "priority, background in the batch band": run(ts, "priority", "batch",
                                                              options)}
        for name, r in rows.items():
            r["p99_over_idle"] = r["high_ttft_p99_ms"] / idle["high_ttft_p99_ms"]
            line = (f"time scale {ts}: {name}: p50 {r['high_ttft_p50_ms']:.0f} ms, p99 "
                    f"{r['high_ttft_p99_ms']:.0f} ms ({r['p99_over_idle']:.2f}x idle)")
            if name != "idle":  # throughput over the whole run (background included)
                r["throughput_over_fcfs"] = (r["total_tokens_per_s"]
                                             / rows["fcfs"]["total_tokens_per_s"])
                line += f", throughput {r['throughput_over_fcfs']:.3f}x fcfs's"
            print(line)
        results[str(ts)] = rows
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
