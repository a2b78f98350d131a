"""The `treadle` command line (the console script `treadle = treadle.cli:main`, and
`python -m treadle.cli`): one module per command.

    generate.py    generate, chat        an in-process engine on a prompt or a conversation
    serve.py       serve, worker         the OpenAI-compatible server; torchrun's other ranks
    run_batch.py   run-batch             an OpenAI batch file answered offline
    trace.py       trace plot            a per-step trace as a timeline
    demo_model.py  demo-model            the random-weight benchmark checkpoint
    bench.py       bench ...             the benchmarks users run (bench_offline.py,
                                         bench_online.py, bench_common.py)
    simulate.py    simulate ...          the capacity simulator
    build_kernels.py  build-kernels      the C kernels, built ahead of the first start

Engine flags are generated from the config dataclasses (treadle/config.py), so every
knob has exactly one name and one help text. Shared option handling (help with defaults,
`--config FILE.yaml`) is options.py's; the fail-fast checks before anything heavy are
preflight.py's. These modules only parse arguments and call into the package; they hold
no engine logic. A new command is one module with an `add_parser(sub)` plus its line in
COMMANDS.
"""

from __future__ import annotations

import argparse
import logging
import sys

from treadle.cli import (bench, build_kernels, demo_model, generate, run_batch, serve, simulate,
                         trace)
from treadle.cli.options import TreadleParser, config_file_of, expand_config_file

COMMANDS = (generate, serve, run_batch, trace, demo_model, bench, simulate, build_kernels)
"""The modules that register the top-level commands, in the order `treadle --help` lists
them."""


def build_parser() -> argparse.ArgumentParser:
    parser = TreadleParser(prog="treadle")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    parser.description = "The `treadle` command line: " + ", ".join(sub.choices) + "."
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a `--config FILE.yaml`'s options under those given
    (cli/options.py); ValueError for a bad file."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    given = config_file_of(args)
    if given is not None:
        args = parser.parse_args(expand_config_file(argv, given[1], given[0]))
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a load generator's thousands of lines, not news.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.command == "bench":
        # a benchmark stopped by its user or a job runner stops the servers it started
        from treadle.measure.launch import end_children_on_termination
        end_children_on_termination()
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
    # debug: the fail-fast checks' one line comes first; the engine logs the setting it runs
    logging.getLogger("treadle.cli").debug(prepare_openmp(policy))
