"""`treadle bench`: the benchmarks users run against the public engine
(docs/benchmarks.md), one subcommand each; in-process ones in bench_offline.py, served
ones in bench_online.py. Micro-benchmarks of the engine's internals are scripts in
benchmarks/, not subcommands.
"""

from __future__ import annotations

from treadle.cli import bench_fairness, bench_latency, bench_offline, bench_online
from treadle.cli.options import add_config_file_argument

NO_CONFIG_FILE = ("compare", "scheduling", "lora")
"""Subcommands without `--config`: compare takes a YAML of its own, the other two hand
their arguments whole to their own parser."""


def add_parser(sub) -> None:
    """Register `bench` and its subcommands on the top-level subparsers, in the order
    `treadle bench --help` lists them."""
    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (bench_offline.add_throughput, bench_offline.add_static,
                bench_offline.add_engine_core, bench_offline.add_compare,
                bench_latency.add_latency,
                bench_online.add_serve, bench_online.add_soak, bench_online.add_capacity,
                bench_online.add_dashboard,
                bench_offline.add_scheduling, bench_fairness.add_fairness,
                bench_offline.add_lora, bench_offline.add_spec,
                bench_offline.add_perplexity, bench_offline.add_quality,
                bench_offline.add_kv):
        add(bench_sub)
    for name, parser in bench_sub.choices.items():
        if name not in NO_CONFIG_FILE:
            add_config_file_argument(parser)
