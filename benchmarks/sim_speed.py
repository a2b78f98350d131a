"""How fast the simulator runs: wall seconds per simulated step and per scheduled request.

    python benchmarks/sim_speed.py [--num-requests 2000] [--replicas 2] [--repeats 3]

Replays the first N requests of the Azure conversation trace (real rate) on N replicas of
the roofline H200 / Llama-3-8B model and prints the median wall and CPU time (the process's
own: steadier on a shared machine) over repeats, steps per CPU second and CPU microseconds
per scheduled request-step (the scheduler's own cost is most
of it). Compare commits by running it on each, alternating, on the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from treadle.sim.config import SimConfig
from treadle.sim.simulate import simulate


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=2000,
                        help="first N requests of the trace; 0: all 19,366")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", default="fcfs")
    args = parser.parse_args()
    walls, cpus, summary = [], [], None
    for _ in range(args.repeats):
        cpu = time.process_time()
        config = SimConfig(num_requests=args.num_requests or None, replicas=args.replicas,
                           rate_scale=args.rate_scale, time_scale=args.time_scale)
        summary = simulate(config, {"scheduling_policy": args.policy}, with_requests=False)
        cpus.append(time.process_time() - cpu)
        walls.append(summary["simulation"]["wall_s"])
    sim = summary["simulation"]
    request_steps = sum(r["mean_batch_size"] * r["num_steps"] for r in sim["replicas"])
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    load = [round(x, 1) for x in os.getloadavg()]
    print(f"{summary['num_requests']} requests, {args.replicas} replicas, rate x"
          f"{args.rate_scale}, time x{args.time_scale}; load average {load}")
    print(f"wall {wall:.2f}s, cpu {cpu:.2f}s (runs {', '.join(f'{c:.2f}' for c in cpus)}), "
          f"{sim['num_steps']} steps, {sim['num_steps'] / cpu:.0f} steps per cpu-s, "
          f"{cpu / request_steps * 1e6:.1f} cpu-us per request-step, "
          f"TTFT p99 {summary['ttft_ms']['p99']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
