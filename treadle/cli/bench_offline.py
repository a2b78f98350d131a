"""`treadle bench` commands that run the engine in-process: throughput, static,
engine-core, compare, scheduling, lora, spec, perplexity, kv.

Each command parses its options and calls treadle/bench (and treadle/measure for the
workloads and the reports); no benchmark logic lives here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treadle.cli.bench_common import (add_workload_arguments, failed, model_path, workload,
                                      write_result)
from treadle.config import add_config_arguments, options_from_args


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from treadle.bench.throughput import run_throughput

    options = options_from_args(args)
    options["model"] = model_path(args)
    result = run_throughput(workload(args, options["model"]), **options)
    print(json.dumps({k: v for k, v in result.items() if k != "engine"}, indent=2, default=str))
    print(json.dumps(result["engine"], indent=2))
    print("wrote", write_result(result, args.output, "throughput.json"))
    return failed("throughput", result["num_errors"], result["num_requests"], result["errors"])


def _cmd_bench_static(args: argparse.Namespace) -> int:
    from treadle.bench.static import run_static

    model = model_path(args)
    result = run_static(model, workload(args, model), batch_size=args.batch_size,
                        dtype=args.dtype or "bfloat16")
    print(json.dumps({k: v for k, v in result.items() if k != "per_batch"}, indent=2,
                     default=str))
    print("wrote", write_result(result, args.output, "static.json"))
    return 0


def _cmd_bench_engine_core(args: argparse.Namespace) -> int:
    from treadle.measure.report import format_table
    from treadle.bench.throughput import run_engine_core

    options = options_from_args(args)
    options.pop("model", None)
    dtype = options.pop("dtype", None) or "bfloat16"
    model = model_path(args)
    result = run_engine_core(model, workload(args, model), dtype=dtype,
                             static_batch_size=args.batch_size, **options)
    t, s = result["treadle"], result["static"]
    rows = [
        {"system": "treadle", "output tok/s": t["output_tokens_per_s"],
         "total tok/s": t["total_tokens_per_s"], "MFU": t["mfu"], "wall s": t["wall_s"]},
        {"system": f"static batching (batch {args.batch_size})",
         "output tok/s": s["output_tokens_per_s"], "total tok/s": s["total_tokens_per_s_useful"],
         "MFU": s["mfu"], "wall s": s["wall_s"]},
    ]
    print(format_table(rows, ["system", "output tok/s", "total tok/s", "MFU", "wall s"]))
    print(f"speedup (output tok/s): {result['speedup_output_tokens_per_s']:.2f}x; "
          f"peak matmul {result['peak_matmul']['used_gflops']:.0f} GFLOP/s ({dtype})")
    print("engine:", json.dumps(t["engine"], indent=2))
    print("wrote", write_result(result, args.output, "engine_core.json"))
    return failed("engine-core", t["num_errors"], t["num_requests"], t["errors"])


def _cmd_bench_compare(args: argparse.Namespace) -> int:
    from treadle.bench.compare import compare, load_config, main_table, plot, strip_samples

    config = load_config(args.config)
    if args.model is not None:
        config["model"] = args.model
    result = compare(config)
    out_dir = Path(args.output or Path("results") / Path(args.config).stem)
    print(main_table(result))
    for path in plot(result, out_dir):
        print("wrote", path)
    clean = strip_samples(result)
    clean["config"] = str(args.config)
    print("wrote", write_result(clean, str(out_dir / "compare.json"), "compare.json"))
    return 0


def _cmd_bench_scheduling(args: argparse.Namespace) -> int:
    from treadle.bench.scheduling import main as scheduling_main

    return scheduling_main(args.rest)


def _cmd_bench_lora(args: argparse.Namespace) -> int:
    from treadle.bench.lora import main as lora_main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return lora_main(rest)


def _cmd_bench_spec(args: argparse.Namespace) -> int:
    from treadle.bench import spec

    return spec.report(spec.run(args), args.output)


def _cmd_bench_perplexity(args: argparse.Namespace) -> int:
    from treadle.bench.quality import run_perplexity
    from treadle.measure.report import format_table

    result = run_perplexity(args.model, args.text, window=args.window, stride=args.stride,
                            dtype=args.dtype, with_transformers=not args.no_transformers)
    rows = [{"system": name, "perplexity": r["perplexity"], "tokens scored": r["num_scored"],
             "seconds": r["seconds"]} for name, r in result["systems"].items()]
    print(format_table(rows, ["system", "perplexity", "tokens scored", "seconds"]))
    if "relative_difference" in result:
        print(f"treadle / transformers - 1 = {result['relative_difference']:+.4%} "
              f"({result['num_tokens']} tokens, {result['num_windows']} windows of "
              f"{args.window}, stride {args.stride}, {args.dtype})")
    print("wrote", write_result(result, args.output, "perplexity.json"))
    return 0


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from treadle.bench.quantized_quality import run_quality
    from treadle.measure.report import format_table

    result = run_quality(args.model, window=args.window)
    rows = []
    for name, row in result["rows"].items():
        rows.append({"configuration": name,
                     "top-1 agreement": row.get("top1_agreement", 1.0),
                     "mean KL (nats)": row.get("mean_kl", 0.0),
                     "vs bf16: top-1 / KL": ("" if "vs_bf16" not in row else
                                             f"{row['vs_bf16']['top1_agreement']:.4f} / "
                                             f"{row['vs_bf16']['mean_kl']:.5f}"),
                     "seconds": row["seconds"]})
    print(format_table(rows, list(rows[0])))
    print(f"{result['num_scored']} tokens scored, teacher-forced, windows of {args.window}; "
          "against the float32 reference")
    print("wrote", write_result(result, args.output, "quality.json"))
    return 0


def _cmd_bench_kv(args: argparse.Namespace) -> int:
    from treadle.bench import kv_pressure
    from treadle.measure import workloads

    options = options_from_args(args)
    options["model"] = model_path(args)
    result: dict = {}
    if args.measure in ("fragmentation", "all"):
        trace = workloads.azure_conv(num_requests=args.trace_requests, max_model_len=8192)
        result["fragmentation"] = {"workload": trace.description,
                                   **kv_pressure.fragmentation(trace, block_size=args.block_size
                                                               or 16)}
        print(f"KV fragmentation, azure-conv ({args.trace_requests} requests, token scale 1), "
              f"block size {args.block_size or 16}: "
              f"{result['fragmentation']['kv_fragmentation']:.2%}")
    if args.measure in ("prefix", "all"):
        wl = workloads.shared_prefix(num_requests=args.num_requests, output_len=16)
        r = kv_pressure.prefix_cache_effect(wl, **options)
        result["prefix"] = {"workload": wl.description, **r}
        print(f"prefix cache on/off ({args.num_requests} requests, 4 prefixes of 512 tokens): "
              f"mean TTFT {r['on']['mean_ttft_s']:.2f}s vs {r['off']['mean_ttft_s']:.2f}s "
              f"({r['mean_ttft_ratio_off_over_on']:.2f}x lower), output tok/s "
              f"{r['on']['output_tokens_per_s']:.1f} vs {r['off']['output_tokens_per_s']:.1f}, "
              f"identical outputs: {r['identical_outputs']}")
    if args.measure in ("preemption", "all"):
        wl = workloads.synthetic(num_requests=args.num_requests, seed=args.workload_seed)
        options.pop("num_kv_blocks", None)
        r = kv_pressure.preemption_modes(wl, args.pressure_blocks, **options)
        result["preemption"] = {"workload": wl.description, **r}
        for mode, run in r["modes"].items():
            print(f"{mode:>9}: {run['output_tokens_per_s']:.1f} out tok/s, "
                  f"{run['num_preemptions']} preemptions ({run['num_preemptions_swap']} swap), "
                  f"identical to unpressured: {run['identical_to_unpressured']}")
        print(f"unpressured: {r['unpressured']['output_tokens_per_s']:.1f} out tok/s")
    print("wrote", write_result(result, args.output, "kv_pressure.json"))
    return 0


def add_throughput(sub) -> None:
    """Register `bench throughput`."""
    thr = sub.add_parser("throughput", help="offline throughput of LLM.generate")
    add_workload_arguments(thr)
    add_config_arguments(thr)
    thr.set_defaults(func=_cmd_bench_throughput)


def add_static(sub) -> None:
    """Register `bench static`."""
    static = sub.add_parser("static", help="transformers generate in padded batches")
    add_workload_arguments(static)
    static.add_argument("--batch-size", type=int, default=16)
    static.add_argument("--model", default=None)
    static.add_argument("--dtype", default="bfloat16")
    static.set_defaults(func=_cmd_bench_static)


def add_engine_core(sub) -> None:
    """Register `bench engine-core`."""
    core = sub.add_parser("engine-core",
                                help="treadle vs static batching, same workload, same run")
    add_workload_arguments(core)
    core.add_argument("--batch-size", type=int, default=16, help="static batching batch size")
    add_config_arguments(core)
    core.set_defaults(func=_cmd_bench_engine_core)


def add_compare(sub) -> None:
    """Register `bench compare`."""
    cmp_ = sub.add_parser("compare", help="several systems on one workload, side by "
                                                "side (see benchmarks/*.yaml)")
    cmp_.add_argument("config", help="YAML: model, workload, load, repeats, systems")
    cmp_.add_argument("--output", default=None, help="folder for compare.json and the PNGs")
    cmp_.add_argument("--model", default=None,
                      help="the model every system loads, in place of the config's `model`")
    cmp_.set_defaults(func=_cmd_bench_compare)


def add_scheduling(sub) -> None:
    """Register `bench scheduling`."""
    sched = sub.add_parser(
        "scheduling", help="mixed-priority and azure-conv replays under several policies "
                           "(options: treadle bench scheduling -- --help)")
    sched.add_argument("rest", nargs=argparse.REMAINDER)
    sched.set_defaults(func=_cmd_bench_scheduling)


def add_lora(sub) -> None:
    """Register `bench lora`."""
    lora = sub.add_parser(
        "lora", help="multi-LoRA offline throughput with 0/1/4/16 adapters against the base "
                     "model (options: treadle bench lora -- --help)")
    lora.add_argument("rest", nargs=argparse.REMAINDER)
    lora.set_defaults(func=_cmd_bench_lora)


def add_spec(sub) -> None:
    """Register `bench spec`."""
    spec_ = sub.add_parser("spec", help="speculative decoding: off, ngram, draft, self "
                                              "on copy-heavy and chat workloads")
    from treadle.bench.spec import add_arguments as add_spec_arguments
    add_spec_arguments(spec_)
    spec_.set_defaults(func=_cmd_bench_spec)


def add_perplexity(sub) -> None:
    """Register `bench perplexity`."""
    ppl = sub.add_parser("perplexity", help="perplexity of a fixed text through treadle "
                                                 "and transformers (output quality)")
    ppl.add_argument("--model", default=None,
                     help="as `serve --model`; the default model when not given")
    ppl.add_argument("--text", default=None,
                     help="UTF-8 text file (default: benchmarks/data/treadle_essay.txt)")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    ppl.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    ppl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ppl.add_argument("--no-transformers", action="store_true",
                     help="treadle only (no reference run)")
    ppl.add_argument("--output", default=None)
    ppl.set_defaults(func=_cmd_bench_perplexity)


def add_quality(sub) -> None:
    """Register `bench quality`."""
    quality = sub.add_parser("quality", help="each quantized path (GGUF kernels, int8 and "
                                             "fp8 KV, H2O) against a float32 reference: "
                                             "top-1 agreement and KL, teacher-forced")
    quality.add_argument("--model", default=None,
                         help="as `serve --model`; the default model when not given (a real "
                              "trained model: quality is never measured on random weights)")
    quality.add_argument("--window", type=int, default=512, help="tokens per scored window")
    quality.add_argument("--output", default=None)
    quality.set_defaults(func=_cmd_bench_quality)


def add_kv(sub) -> None:
    """Register `bench kv`."""
    kv = sub.add_parser("kv", help="KV memory: fragmentation, prefix cache, preemption")
    kv.add_argument("--measure", choices=["fragmentation", "prefix", "preemption", "all"],
                    default="all")
    kv.add_argument("--num-requests", type=int, default=32)
    kv.add_argument("--workload-seed", type=int, default=0)
    kv.add_argument("--trace-requests", type=int, default=2000,
                    help="azure-conv requests replayed for the fragmentation figure")
    kv.add_argument("--pressure-blocks", type=int, default=300,
                    help="KV blocks for the memory-pressure runs")
    kv.add_argument("--output", default=None)
    add_config_arguments(kv)
    kv.set_defaults(func=_cmd_bench_kv)
