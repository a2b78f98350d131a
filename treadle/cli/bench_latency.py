"""`treadle bench latency`: single-stream and few-stream speed, side by side with llama.cpp
(treadle/bench/latency.py). Parses the options and prints the table; no benchmark logic."""

from __future__ import annotations

import argparse
import json
import sys

from treadle.cli.bench_common import write_result
from treadle.config import add_config_arguments, options_from_args, parse_int_list


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option that cannot run (before anything loads)."""
    if args.peer is not None and args.llamacpp_dir is None:
        raise ValueError("--peer llamacpp needs --llamacpp-dir: the llama.cpp build folder "
                         "(with build/bin/llama-bench and llama-server)")
    if args.peer is None and args.llamacpp_dir is not None:
        raise ValueError("--llamacpp-dir is only used with --peer llamacpp")


def _cmd_bench_latency(args: argparse.Namespace) -> int:
    from treadle.bench.latency import TABLE_COLUMNS, run_latency
    from treadle.measure.report import format_table

    check_args(args)
    options = options_from_args(args)
    model = options.pop("model", None)
    result = run_latency(model, parse_int_list(args.concurrency, "--concurrency"),
                         args.prompt_len, args.output_len, args.repeats, options,
                         args.llamacpp_dir if args.peer else None, args.peer_threads,
                         args.background_load, args.prompt_seed)
    print(format_table(result["table"], TABLE_COLUMNS))
    print(json.dumps({"cpu": result["cpu"], "treadle_kernels": result["treadle_kernels"],
                      "background_load": result["background_load"]["busy_threads"],
                      "load_average_at_end": result["load_average_at_end"]}))
    print("wrote", write_result(result, args.output, "latency.json"))
    errors = [p for p in result["points"] if "error" in p]
    for p in errors:
        print(f"failed: {p['system']} at {p['concurrency']} streams (repeat {p['repeat']}): "
              f"{p['error']}", file=sys.stderr)
    return 1 if errors else 0


def add_latency(sub) -> None:
    """Register `bench latency`."""
    lat = sub.add_parser(
        "latency", help="prefill and decode tok/s, TTFT and TPOT at 1-64 streams; with "
                        "--peer llamacpp, llama-bench / llama-server on the same GGUF file")
    lat.add_argument("--prompt-len", type=int, default=512)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--concurrency", default="1,4,16,64",
                     help="streams at once, comma-separated: 1 runs offline (LLM against "
                          "llama-bench), more run served (treadle serve against llama-server)")
    lat.add_argument("--repeats", type=int, default=3, help="alternating repeats per point")
    lat.add_argument("--peer", choices=["llamacpp"], default=None,
                     help="run llama.cpp on the same GGUF file, side by side")
    lat.add_argument("--llamacpp-dir", default=None,
                     help="the llama.cpp build folder (build/bin/llama-bench, llama-server)")
    lat.add_argument("--peer-threads", type=int, default=None,
                     help="llama.cpp's threads (default: --num-threads, else the CPUs this "
                          "process may run on)")
    lat.add_argument("--background-load", type=int, default=0, metavar="N",
                     help="N busy threads (child processes) beside both systems while they "
                          "run, ended by PID")
    lat.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    lat.add_argument("--output", default=None, help="where to write the JSON result")
    add_config_arguments(lat)
    lat.set_defaults(func=_cmd_bench_latency)
