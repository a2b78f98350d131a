"""Goodput under deadlines at 1.5x capacity, per scheduling policy (issue 50's target:
`slo` >= 1.3x fcfs's goodput and >= every other policy's).

Every request carries a TTFT and a TPOT target (`slo_ttft_ms`, `slo_tpot_ms`); goodput
is requests per second that meet both, over the arrival window (the same denominator for
every policy: a policy that finishes late is not paid for the drain). Capacity is the
highest request rate (the trace's arrivals compressed) at which fcfs meets the targets at
p99 TTFT and p99 TPOT, found by bisection; the run is at 1.5 times it, each policy on the
same arrivals.

    python benchmarks/slo_goodput.py sim    # the production scheduler on the simulator
    python benchmarks/slo_goodput.py real   # the engine in-process, wall clock, small

`sim` replays the Azure conversation trace (token counts scaled by --token-scale) on one
replica priced by the roofline model of SmolLM2-135M on this machine's measured CPU
(treadle/sim). `real` replays a Poisson stream of short requests into an EngineCore on
the demo model (SmolLM2-135M's shapes), with capacity and targets measured on the spot.
A script beside the engine: it reaches into treadle.sim internals.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

POLICIES = ("fcfs", "priority", "srpt", "fair", "makespan", "slo")


def _goodput(records, ttft_s: float, tpot_s: float, window_s: float) -> dict:
    """Requests meeting both targets per second of the arrival window, and p99s."""
    import numpy as np

    met, ttfts, tpots = 0, [], []
    for first, last, n, arrival, error in records:
        if error is not None or first is None:
            continue
        ttft = first - arrival
        tpot = (last - first) / (n - 1) if n > 1 else 0.0
        ttfts.append(ttft)
        tpots.append(tpot)
        met += ttft <= ttft_s and tpot <= tpot_s
    return {"goodput_rps": met / window_s, "met": met, "num": len(records),
            "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
            "tpot_p99_s": float(np.percentile(tpots, 99)) if tpots else None}


# ----- the simulator -----------------------------------------------------------------------

def sim_run(args, policy: str, time_scale: float) -> dict:
    from treadle.sim.config import SimConfig
    from treadle.sim.simulate import build, run

    config = SimConfig(workload="azure-conv", num_requests=args.num_requests,
                       token_scale=args.token_scale, time_scale=time_scale,
                       step_model="roofline", hardware="cpu-here", model_shape="smollm2-135m",
                       max_model_len=4096)
    setup = build(config, {"scheduling_policy": policy, "max_num_seqs": args.max_num_seqs,
                           "max_num_batched_tokens": args.max_num_batched_tokens})
    setup.requests = [replace(r, slo_ttft_ms=args.ttft_ms, slo_tpot_ms=args.tpot_ms)
                      for r in setup.requests]
    result = run(setup)
    window = max(r.request.arrival for r in result.records) or 1e-9
    return _goodput([(r.first_token, r.last_token, r.num_tokens, r.request.arrival, r.error)
                     for r in result.records], args.ttft_ms / 1000, args.tpot_ms / 1000, window)


# ----- the real engine ----------------------------------------------------------------------

def real_run(args, policy: str, rate: float) -> dict:
    import random

    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    engine = EngineCore(EngineConfig.from_options(
        model=args.model, dtype="bfloat16", scheduling_policy=policy,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads, attention_backend=args.attention_backend))
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while t < args.duration:
        t += rng.expovariate(rate)
        arrivals.append((t, rng.randint(*args.prompt), rng.randint(*args.output)))
    records = {}
    start = time.monotonic()
    i = 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        now = time.monotonic()
        while i < len(arrivals) and start + arrivals[i][0] <= now:
            at, p, o = arrivals[i]
            rid = str(i)
            records[rid] = [None, None, 0, start + at, None]
            out = engine.add_request(Request(
                rid, [rng.randrange(300, 4000) for _ in range(p)],
                SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True),
                arrival_time=start + at, slo_ttft_ms=args.ttft_ms, slo_tpot_ms=args.tpot_ms))
            if out is not None:
                records[rid][4] = out.error
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + arrivals[i][0] - time.monotonic()))
            continue
        for out in engine.step():
            rec = records[out.request_id]
            t = time.monotonic()
            if out.new_token_ids:
                rec[0] = rec[0] or t
                rec[1] = t
                rec[2] += len(out.new_token_ids)
            if out.error is not None:
                rec[4] = out.error
    engine.shutdown()
    return _goodput(list(records.values()), args.ttft_ms / 1000, args.tpot_ms / 1000,
                    args.duration)


def meets(result: dict, args) -> bool:
    return (result["ttft_p99_s"] is not None and result["ttft_p99_s"] * 1000 <= args.ttft_ms
            and result["tpot_p99_s"] * 1000 <= args.tpot_ms)


def capacity(args, run_at) -> float:
    """The highest load (time scale or rate) at which fcfs meets both targets at p99."""
    lo, hi = args.lo, args.hi
    if not meets(run_at("fcfs", lo), args):
        raise SystemExit(f"fcfs misses the targets even at load {lo}: loosen --ttft-ms / "
                         "--tpot-ms")
    for _ in range(args.bisections):
        mid = (lo * hi) ** 0.5
        if meets(run_at("fcfs", mid), args):
            lo = mid
        else:
            hi = mid
    return lo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["sim", "real"])
    parser.add_argument("--ttft-ms", type=float, default=None)
    parser.add_argument("--tpot-ms", type=float, default=None)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--overload", type=float, default=1.5)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--bisections", type=int, default=6)
    parser.add_argument("--num-requests", type=int, default=600, help="sim: trace rows")
    parser.add_argument("--token-scale", type=float, default=0.25, help="sim")
    parser.add_argument("--model", default="demo", help="real")
    parser.add_argument("--duration", type=float, default=60.0, help="real: seconds of arrivals")
    parser.add_argument("--prompt", type=int, nargs=2, default=(16, 160), help="real")
    parser.add_argument("--output", type=int, nargs=2, default=(8, 48), help="real")
    parser.add_argument("--num-threads", type=int, default=1, help="real")
    parser.add_argument("--attention-backend", default="torch", help="real")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity", type=float, default=None,
                        help="skip the search: the load (sim: time scale, real: req/s)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.mode == "sim":
        args.ttft_ms = args.ttft_ms or 2000.0
        args.tpot_ms = args.tpot_ms or 300.0
        args.lo, args.hi = 0.1, 64.0
        run_at = lambda policy, load: sim_run(args, policy, load)  # noqa: E731
    else:
        args.ttft_ms = args.ttft_ms or 1500.0
        args.tpot_ms = args.tpot_ms or 300.0
        args.lo, args.hi = 0.2, 8.0
        run_at = lambda policy, load: real_run(args, policy, load)  # noqa: E731
    cap = args.capacity or capacity(args, run_at)
    load = cap * args.overload
    rows = {}
    for policy in [p for p in args.policies.split(",") if p]:
        rows[policy] = run_at(policy, load)
        print(policy, json.dumps(rows[policy]), flush=True)
    fcfs = rows.get("fcfs", {}).get("goodput_rps") or float("nan")
    result = {"mode": args.mode, "capacity_load": cap, "run_load": load,
              "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms}, "runs": rows,
              "goodput_over_fcfs": {p: r["goodput_rps"] / fcfs for p, r in rows.items()}}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
