"""`treadle trace`: what to do with a per-step trace written with --trace FILE (plot it
as a timeline, treadle/bench/trace_plot.py)."""

from __future__ import annotations

import argparse


def _cmd_trace_plot(args: argparse.Namespace) -> int:
    from treadle.bench.trace_plot import plot_trace

    print(plot_trace(args.file, args.out, max_rows=args.max_rows))
    return 0


def add_parser(sub) -> None:
    """Register `trace` and its subcommands on the top-level subparsers."""
    trace = sub.add_parser("trace", help="per-step traces (written with --trace FILE)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    plot = trace_sub.add_parser("plot", help="draw a trace as a timeline PNG")
    plot.add_argument("file")
    plot.add_argument("-o", "--out", default=None, help="PNG path (default: FILE.png)")
    plot.add_argument("--max-rows", type=int, default=400)
    plot.set_defaults(func=_cmd_trace_plot)
