"""The `treadle` command line (the console script `treadle = treadle.cli:main`, and
`python -m treadle.cli`): one module per command.

    generate.py    generate, chat        an in-process engine on a prompt or a conversation
    serve.py       serve, worker         the OpenAI-compatible server; torchrun's other ranks
    trace.py       trace plot            a per-step trace as a timeline
    demo_model.py  demo-model            the random-weight benchmark checkpoint
    bench.py       bench ...             the benchmarks users run (bench_offline.py,
                                         bench_online.py, bench_common.py)
    simulate.py    simulate ...          the capacity simulator

Engine flags are generated from the config dataclasses (treadle/config.py), so every
knob has exactly one name and one help text. These modules only parse arguments and call
into the package; they hold no engine logic. A new command is one module with an
`add_parser(sub)` plus its line in COMMANDS.
"""

from __future__ import annotations

import argparse
import logging
import sys

from treadle.cli import bench, demo_model, generate, serve, simulate, trace

COMMANDS = (generate, serve, trace, demo_model, bench, simulate)
"""The modules that register the top-level commands, in the order `treadle --help` lists
them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    parser.description = "The `treadle` command line: " + ", ".join(sub.choices) + "."
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a load generator's thousands of lines, not news.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        _prepare_openmp(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _prepare_openmp(args: argparse.Namespace) -> None:
    """A command that runs an engine in this process sets OpenMP's wait policy now, before
    anything imports torch (resolving --model may): worker/threads.py."""
    if not hasattr(args, "omp_wait_policy"):
        return
    import os

    from treadle.config import ENV_PREFIX
    from treadle.worker.threads import prepare_openmp

    policy = args.omp_wait_policy or os.environ.get(ENV_PREFIX + "OMP_WAIT_POLICY", "auto")
    logging.getLogger("treadle.cli").info(prepare_openmp(policy))
