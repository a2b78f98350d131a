"""Engine options side by side on one workload, stepping in turn.

Run: `python -m treadle.bench.paired --model M --system NAME:KEY=VALUE,... --system ...`.

Every system is an `LLM` of the same model with its own engine options (e.g.
`gguf:quantization=gguf` against `none:quantization=none`, or two `kernel_isa` levels).
In each repeat all are loaded anew, in that repeat's order, and every system runs the
whole workload (the
engine-core workload, `measure.workloads.synthetic`: all requests at once by default,
greedy, EOS ignored, each request's own max_tokens), the engines taking one step each in
turn (the order rotates each repeat)
and each timed over its own steps (treadle/bench/lockstep.py). Reported per system and
repeat: output tokens/s over its own steps, and its ratio to the first system paired by
repeat (the runs that shared the same minutes of the machine), with their medians and
geometric means. Back to back, two runs of one engine on a shared 2-core machine moved by
5-10%; in turn, their ratios hold within a few percent.

Why load anew each repeat: engines loaded once in a fixed order are not alike. Two
engines of identical options, loaded one after the other and stepping in turn on the Zen 4
host, gave the second 1.018, 1.024 and 1.023 times the first's throughput (docs/
benchmarks.md, "Round 18"), a bias as large as the changes measured with it. Loading in
the rotating order puts each system second in half the repeats, so over an even number of
repeats the bias cancels in the geometric mean; `--no-reload` keeps the engines of the
first repeat (faster, biased). It measures; nothing here is a target.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from treadle.measure import workloads
from treadle.bench.lockstep import run_closed_loop, run_lockstep
from treadle.measure.report import environment, format_table, write_json


def parse_system(text: str) -> tuple[str, dict]:
    """'name:key=value,key=value' -> (name, {key: value}); values that read as int or
    float become one. A ValueError names what is wrong."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"--system needs NAME:KEY=VALUE,..., got {text!r}")
    options: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--system {name}: {item!r} is not KEY=VALUE")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key.strip()] = value
    return name, options


def run(args) -> dict:
    from treadle import LLM

    systems = dict(parse_system(s) for s in args.system)
    if len(systems) < 2 or len(systems) < len(args.system):
        raise ValueError(f"--system: give at least two systems with distinct names, got "
                         f"{[s.partition(':')[0] for s in args.system]}")
    common = dict(model=args.model, dtype=args.dtype, num_threads=args.num_threads)
    llms: dict = {}
    load_s: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    workload = prompts = limits = None
    runs = []
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        if repeat == 0 or args.reload:
            _unload(llms)
            for name in order:  # loaded in this repeat's order (see the top)
                t0 = time.perf_counter()
                llms[name] = LLM(**{**common, **systems[name]})
                load_s[name].append(time.perf_counter() - t0)
            if workload is None:
                info = llms[names[0]].engine.info
                workload = workloads.synthetic(
                    num_requests=args.num_requests, seed=args.seed,
                    vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                    num_long=min(4, args.num_requests))
                prompts = [r.prompt_token_ids for r in workload.requests]
                limits = [r.max_tokens for r in workload.requests]
            for name in order:  # warm every engine once, untimed
                run_closed_loop(llms[name], prompts[:2], 4, 2, ignore_eos=True)
        concurrency = args.concurrency or len(prompts)
        results = run_lockstep({n: llms[n] for n in order}, prompts, limits, concurrency,
                               ignore_eos=True)
        first = results[names[0]]["output_tokens_per_s"]
        for name in names:
            result = results[name]
            result.update(system=name, repeat=repeat,
                          ratio_to_first=result["output_tokens_per_s"] / first)
            runs.append(result)
    summary = []
    for name in names:
        mine = [r for r in runs if r["system"] == name]
        summary.append({
            "system": name, "options": systems[name],
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in mine),
            "ratio_to_first": statistics.median(r["ratio_to_first"] for r in mine),
            "ratio_geomean": statistics.geometric_mean(r["ratio_to_first"] for r in mine),
            "ratios": [round(r["ratio_to_first"], 4) for r in mine]})
    _unload(llms)
    return {"benchmark": "paired", "args": vars(args), "common_options": common,
            "environment": environment(), "load_s": load_s,
            "workload": workload.description,
            "summary": summary, "runs": runs}


def _unload(llms: dict) -> None:
    """Stop and drop every engine of `llms` (emptied), so that the next ones load into
    the memory they held."""
    for llm in llms.values():
        llm.engine.shutdown()
    llms.clear()
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--system", action="append", required=True,
                        help="NAME:KEY=VALUE,... (engine options of LLM); give two or more")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="requests in flight per system (0: all at once)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reload", action=argparse.BooleanOptionalAction, default=True,
                        help="load the engines anew each repeat, in its order (default; "
                             "--no-reload: once, which favours the one loaded last)")
    parser.add_argument("--output", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = run(args)
    print(format_table(result["summary"], ["system", "output_tokens_per_s", "ratio_to_first",
                                           "ratio_geomean", "ratios"]))
    if args.output:
        write_json(args.output, result)
    else:
        print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
