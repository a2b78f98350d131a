"""The `treadle` command line: serve, generate, chat, worker, demo-model, trace, bench,
simulate.

Engine flags are generated from the config dataclasses (treadle/config.py), so every
knob has exactly one name and one help text. This module only parses arguments and calls
into the package; it holds no engine logic.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from treadle.config import add_config_arguments, add_dataclass_arguments, options_from_args
from treadle.server.config import ServerConfig


def _cmd_generate(args: argparse.Namespace) -> int:
    from treadle import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**options_from_args(args))
    (output,) = llm.generate([args.prompt], params, use_tqdm=False)
    if output.error:
        print(f"error: {output.error}", file=sys.stderr)
        return 1
    completion = output.outputs[0]
    print(args.prompt + completion.text)
    print(f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} "
          f"generated, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from treadle import SamplingParams
    from treadle.chat import run_chat

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    return run_chat(options_from_args(args), params, system=args.system)


def _cmd_bench_perplexity(args: argparse.Namespace) -> int:
    from treadle.bench.quality import run_perplexity
    from treadle.bench.report import format_table

    result = run_perplexity(args.model, args.text, window=args.window, stride=args.stride,
                            dtype=args.dtype, with_transformers=not args.no_transformers)
    rows = [{"system": name, "perplexity": r["perplexity"], "tokens scored": r["num_scored"],
             "seconds": r["seconds"]} for name, r in result["systems"].items()]
    print(format_table(rows, ["system", "perplexity", "tokens scored", "seconds"]))
    if "relative_difference" in result:
        print(f"treadle / transformers - 1 = {result['relative_difference']:+.4%} "
              f"({result['num_tokens']} tokens, {result['num_windows']} windows of "
              f"{args.window}, stride {args.stride}, {args.dtype})")
    print("wrote", _write_result(result, args.output, "perplexity.json"))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from treadle.config import EngineConfig, dataclass_from_args
    from treadle.executor.torchrun import launcher_rank
    from treadle.server.serve import serve

    from treadle.distributed.config import ReplicaConfig

    config = EngineConfig.from_options(**options_from_args(args))
    if config.parallel.executor == "torchrun" and launcher_rank() != 0:
        return _cmd_worker(args)  # one command for every rank: only rank 0 serves
    replica_config = dataclass_from_args(ReplicaConfig, args)
    if replica_config.on_ray:  # these read one engine's steps: off unless asked for
        args.dashboard = False if args.dashboard is None else args.dashboard
        args.request_timelines = 0 if args.request_timelines is None else args.request_timelines
    return serve(config, dataclass_from_args(ServerConfig, args), replica_config)


def _cmd_worker(args: argparse.Namespace) -> int:
    from treadle.config import EngineConfig
    from treadle.executor.torchrun import run_worker

    options = options_from_args(args)
    options.setdefault("distributed_executor_backend", "torchrun")
    return run_worker(EngineConfig.from_options(**options))


def _cmd_trace_plot(args: argparse.Namespace) -> int:
    from treadle.bench.trace_plot import plot_trace

    print(plot_trace(args.file, args.out, max_rows=args.max_rows))
    return 0


def _cmd_bench_scheduling(args: argparse.Namespace) -> int:
    from treadle.bench.scheduling import main as scheduling_main

    return scheduling_main(args.rest)


def _cmd_bench_lora(args: argparse.Namespace) -> int:
    from treadle.bench.lora import main as lora_main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return lora_main(rest)


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from treadle.models.demo import write_demo_model

    path = write_demo_model(args.out, seed=args.seed)
    print(path)
    return 0


def _workload(args: argparse.Namespace, model_path: str):
    """The chosen workload, its token ids drawn from (and checked against) the model's
    own vocabulary (`--vocab-size` overrides what its config.json says), its lengths
    within the model's context (`--max-model-len` where the command has it)."""
    from treadle.bench import workloads

    vocab = getattr(args, "vocab_size", None) or workloads.model_vocab_size(model_path)
    context = getattr(args, "max_model_len", None) or workloads.model_context_len(model_path)
    if getattr(args, "workload_file", None):
        workload = workloads.load_workload(args.workload_file)
        workloads.check_token_ids(workload, vocab)
        return workload
    if args.workload == "synthetic":
        return workloads.synthetic(num_requests=args.num_requests, seed=args.workload_seed,
                                   vocab_size=vocab, max_model_len=context,
                                   num_long=min(4, args.num_requests))
    if args.workload == "azure-conv":
        return workloads.azure_conv(num_requests=args.num_requests, token_scale=args.token_scale,
                                    seed=args.workload_seed, vocab_size=vocab,
                                    max_model_len=min(context or 2048, 2048))
    return workloads.shared_prefix(num_requests=args.num_requests, seed=args.workload_seed,
                                   vocab_size=vocab)


def _model_path(args: argparse.Namespace) -> str:
    """The checkpoint directory of a benchmark's --model: the demo model when not given
    (benchmarks measure speed on the fixed demo checkpoint unless told otherwise)."""
    from treadle.models.resolve import resolve_model
    return str(resolve_model(args.model or "demo", getattr(args, "revision", None),
                             getattr(args, "download_dir", None),
                             getattr(args, "dtype", None) or "auto"))


def _failed(what: str, num_failed: int, num_requests: int, errors: list) -> int:
    """Exit status 1 with the reason when a benchmark's requests failed (its figures would
    not measure what they claim), else 0."""
    if not num_failed:
        return 0
    print(f"error: {num_failed} of {num_requests} {what} requests failed; first errors: "
          f"{errors[:3]}", file=sys.stderr)
    return 1


def _write_result(result: dict, path: str | None, default_name: str) -> Path:
    from treadle.bench.report import environment, write_json

    result["environment"] = environment()
    return write_json(path or Path("results") / default_name, result)


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from treadle.bench.throughput import run_throughput

    options = options_from_args(args)
    options["model"] = _model_path(args)
    result = run_throughput(_workload(args, options["model"]), **options)
    print(json.dumps({k: v for k, v in result.items() if k != "engine"}, indent=2, default=str))
    print(json.dumps(result["engine"], indent=2))
    print("wrote", _write_result(result, args.output, "throughput.json"))
    return _failed("throughput", result["num_errors"], result["num_requests"], result["errors"])


def _cmd_bench_static(args: argparse.Namespace) -> int:
    from treadle.bench.static import run_static

    model = _model_path(args)
    result = run_static(model, _workload(args, model), batch_size=args.batch_size,
                        dtype=args.dtype or "bfloat16")
    print(json.dumps({k: v for k, v in result.items() if k != "per_batch"}, indent=2,
                     default=str))
    print("wrote", _write_result(result, args.output, "static.json"))
    return 0


def _cmd_bench_engine_core(args: argparse.Namespace) -> int:
    from treadle.bench.report import format_table
    from treadle.bench.throughput import run_engine_core

    options = options_from_args(args)
    options.pop("model", None)
    dtype = options.pop("dtype", None) or "bfloat16"
    model = _model_path(args)
    result = run_engine_core(model, _workload(args, model), dtype=dtype,
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
    print("wrote", _write_result(result, args.output, "engine_core.json"))
    return _failed("engine-core", t["num_errors"], t["num_requests"], t["errors"])


def _cmd_bench_kv(args: argparse.Namespace) -> int:
    from treadle.bench import kv_pressure, workloads

    options = options_from_args(args)
    options["model"] = _model_path(args)
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
    print("wrote", _write_result(result, args.output, "kv_pressure.json"))
    return 0


def _parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        if key not in ("ttft", "tpot") or not value:
            raise ValueError(f"--slo takes ttft=MS,tpot=MS, got {part!r}")
        slo[key] = float(value)
    return slo


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import shlex

    import numpy as np

    from treadle.bench import workloads
    from treadle.bench.launch import launched_server
    from treadle.bench.serve import request_records, run_load, served_model, summarize

    if (args.url is None) == (args.launch is None):
        raise ValueError("give exactly one of --url URL or --launch 'SERVE OPTIONS'")
    slo = _parse_slo(args.slo)
    launch = shlex.split(args.launch) if args.launch is not None else None
    if launch is not None and not any(a == "--model" or a.startswith("--model=") for a in launch):
        launch = ["--model", "demo", *launch]  # benchmarks run the demo model unless told
    server = (launched_server(launch) if launch is not None
              else contextlib.nullcontext((args.url, None)))
    with server as (url, _):
        card = served_model(url, args.api_key)
        model = args.served_model or card["id"]
        vocab = args.vocab_size or card.get("vocab_size") or workloads.DEFAULT_VOCAB_SIZE
        if args.workload == "azure-conv":
            workload = workloads.azure_conv(num_requests=args.num_requests,
                                            token_scale=args.token_scale,
                                            time_scale=args.time_scale,
                                            max_model_len=args.max_model_len, vocab_size=vocab)
        else:
            workload = workloads.synthetic(num_requests=args.num_requests,
                                           seed=args.workload_seed,
                                           max_model_len=args.max_model_len, vocab_size=vocab,
                                           num_long=min(4, args.num_requests))
        priorities = None
        if args.priority_mix:
            # A fraction of the requests are urgent (priority 0); the rest background (1).
            rng = np.random.default_rng(args.workload_seed)
            priorities = [0 if x < args.priority_mix else 1
                          for x in rng.random(len(workload.requests))]
        results, duration = asyncio.run(run_load(
            url, workload, model, rate=args.rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, priorities=priorities, api_key=args.api_key,
            seed=args.workload_seed, use_trace_times=args.workload == "azure-conv"))
    summary = summarize(results, duration, slo.get("ttft"), slo.get("tpot"))
    if priorities is not None:
        for level in (0, 1):
            subset = [r for r in results if r.priority == level]
            summary[f"priority_{level}"] = summarize(subset, duration, slo.get("ttft"),
                                                     slo.get("tpot"))
    summary["workload"] = workload.description | {"name": workload.name}
    summary["load"] = {"rate": args.rate, "burstiness": args.burstiness,
                       "max_concurrency": args.max_concurrency, "url": args.url,
                       "launch": args.launch, "priority_mix": args.priority_mix}
    print(json.dumps({k: v for k, v in summary.items() if k != "workload"}, indent=2))
    summary["requests"] = request_records(results)
    print("wrote", _write_result(summary, args.output, "serve.json"))
    return _failed("serve", summary["num_failed"], summary["num_requests"], summary["errors"])


def _cmd_bench_dashboard(args: argparse.Namespace) -> int:
    import shlex

    from treadle.bench.dashboard import recorder_cost, served_cost
    from treadle.bench.report import format_table

    result: dict = {"recorder": recorder_cost()}
    print(format_table(result["recorder"], ["scheduled_requests", "recorder_us_per_step",
                                            "event_ms_per_second_of_steps"]))
    if args.repeats:
        options = shlex.split(args.launch)
        if not any(a == "--model" or a.startswith("--model=") for a in options):
            options = ["--model", "demo", *options]
        served = served_cost(options, args.num_requests, args.repeats, args.viewer,
                             args.workload_seed, args.max_model_len,
                             on_first=args.launch_on_first)
        result["served"] = served
        print(format_table([{"system": name, "median output tok/s": tps,
                             "ratio to off": served["ratio_to_off"][name]}
                            for name, tps in served["median_output_tokens_per_s"].items()],
                           ["system", "median output tok/s", "ratio to off"]))
        print("open / on per repeat:", ", ".join(f"{r:.4f}"
                                                  for r in served["per_repeat_open_to_on"]))
    print("wrote", _write_result(result, args.output, "dashboard.json"))
    return 0


def _cmd_bench_soak(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import secrets
    import shlex
    import tempfile

    from treadle.bench.launch import launched_server
    from treadle.bench.serve import served_model
    from treadle.bench.soak import SoakConfig, run_soak

    if (args.url is None) == (args.launch is None):
        raise ValueError("give exactly one of --url URL or --launch 'SERVE OPTIONS'")
    config = SoakConfig(
        rate=args.rate, duration_s=args.duration, max_in_flight=args.max_in_flight,
        timeout_s=args.timeout, disconnect_fraction=args.disconnect_fraction,
        priorities=tuple(args.priorities), priority_weights=tuple(args.priority_weights),
        prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len),
        report_interval_s=args.report_interval, seed=args.workload_seed)
    with contextlib.ExitStack() as stack:
        keys: list[str | None] = list(args.api_key or [])
        if args.launch is not None:
            serve_args = shlex.split(args.launch)
            if not keys and "--api-keys-file" not in serve_args:  # two tenants, one key each
                keys = [f"soak-{name}-{secrets.token_hex(8)}" for name in ("a", "b")]
                folder = stack.enter_context(tempfile.TemporaryDirectory())
                keys_file = Path(folder) / "keys.yaml"
                keys_file.write_text("".join(f"- {{key: {k}, tenant: tenant-{n}}}\n"
                                             for k, n in zip(keys, "ab")))
                serve_args += ["--api-keys-file", str(keys_file)]
            url, proc = stack.enter_context(launched_server(serve_args))
            print(f"server pid {proc.pid}, log {proc.log_path}", file=sys.stderr)
        else:
            url = args.url
        keys = keys or [None]
        card = served_model(url, keys[0])
        vocab = args.vocab_size or card.get("vocab_size") or 49152
        result = asyncio.run(run_soak(url, card["id"], keys, vocab, config,
                                      card.get("max_model_len")))
    result["launch"], result["url"] = args.launch, args.url
    summary = result["summary"]
    print(json.dumps(summary, indent=2, default=str))
    print("wrote", _write_result(result, args.output, "soak.json"))
    return _failed("soak", summary["error"], summary["num_requests"], summary["errors"])


def _cmd_bench_spec(args: argparse.Namespace) -> int:
    from treadle.bench import spec

    return spec.report(spec.run(args), args.output)


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
    print("wrote", _write_result(clean, str(out_dir / "compare.json"), "compare.json"))
    return 0


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["synthetic", "azure-conv", "shared-prefix"],
                        default="synthetic", help="which workload to run")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="azure-conv: multiply the trace's token counts by this")
    parser.add_argument("--workload-file", default=None,
                        help="a workload saved as JSON (bench/workloads.save_workload); "
                             "overrides the options above")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="draw token ids below this (default: the model's config.json)")
    parser.add_argument("--output", default=None, help="where to write the JSON result")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="print a completion of one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    add_config_arguments(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with a model in the terminal (streamed; /reset, "
                                       "/exit; Ctrl-C stops an answer)")
    chat.add_argument("--system", default=None, help="system prompt (the template's own "
                                                     "default when not given)")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--sampling-seed", type=int, default=None)
    add_config_arguments(chat)
    chat.set_defaults(func=_cmd_chat)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API "
                                       "(SmolLM2-135M-Instruct by default)")
    add_config_arguments(srv)
    add_dataclass_arguments(srv, ServerConfig, "server options")
    from treadle.distributed.config import ReplicaConfig
    add_dataclass_arguments(srv, ReplicaConfig, "replicas on Ray (docs/replicas.md)")
    srv.set_defaults(func=_cmd_serve)

    wrk = sub.add_parser("worker", help="a rank other than 0 under torchrun (RANK, "
                         "WORLD_SIZE, MASTER_ADDR, MASTER_PORT): serve rank 0's calls")
    add_config_arguments(wrk)
    wrk.set_defaults(func=_cmd_worker)

    trace = sub.add_parser("trace", help="per-step traces (written with --trace FILE)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    plot = trace_sub.add_parser("plot", help="draw a trace as a timeline PNG")
    plot.add_argument("file")
    plot.add_argument("-o", "--out", default=None, help="PNG path (default: FILE.png)")
    plot.add_argument("--max-rows", type=int, default=400)
    plot.set_defaults(func=_cmd_trace_plot)

    demo = sub.add_parser("demo-model", help="write the built-in demo checkpoint to a folder")
    demo.add_argument("--out", required=True)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo_model)

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    thr = bench_sub.add_parser("throughput", help="offline throughput of LLM.generate")
    _add_workload_arguments(thr)
    add_config_arguments(thr)
    thr.set_defaults(func=_cmd_bench_throughput)
    static = bench_sub.add_parser("static", help="transformers generate in padded batches")
    _add_workload_arguments(static)
    static.add_argument("--batch-size", type=int, default=16)
    static.add_argument("--model", default=None)
    static.add_argument("--dtype", default="bfloat16")
    static.set_defaults(func=_cmd_bench_static)
    core = bench_sub.add_parser("engine-core",
                                help="treadle vs static batching, same workload, same run")
    _add_workload_arguments(core)
    core.add_argument("--batch-size", type=int, default=16, help="static batching batch size")
    add_config_arguments(core)
    core.set_defaults(func=_cmd_bench_engine_core)
    cmp_ = bench_sub.add_parser("compare", help="several systems on one workload, side by "
                                                "side (see benchmarks/*.yaml)")
    cmp_.add_argument("config", help="YAML: model, workload, load, repeats, systems")
    cmp_.add_argument("--output", default=None, help="folder for compare.json and the PNGs")
    cmp_.add_argument("--model", default=None,
                      help="the model every system loads, in place of the config's `model`")
    cmp_.set_defaults(func=_cmd_bench_compare)

    online = bench_sub.add_parser("serve", help="load an OpenAI-compatible server over HTTP")
    online.add_argument("--url", default=None, help="base URL of a running server")
    online.add_argument("--launch", default=None,
                        help="start `treadle serve` with these options instead, e.g. "
                             "\"--max-num-seqs 64\"; stopped when the run ends")
    online.add_argument("--workload", choices=["synthetic", "azure-conv"], default="synthetic")
    online.add_argument("--num-requests", type=int, default=64)
    online.add_argument("--workload-seed", type=int, default=0)
    online.add_argument("--rate", type=float, default=None,
                        help="requests per second (default: all at once)")
    online.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrivals (1: Poisson)")
    online.add_argument("--max-concurrency", type=int, default=None)
    online.add_argument("--token-scale", type=float, default=1.0)
    online.add_argument("--time-scale", type=float, default=1.0,
                        help="azure-conv: divide the trace's arrival times by this")
    online.add_argument("--max-model-len", type=int, default=2048)
    online.add_argument("--slo", default=None, help="ttft=MS,tpot=MS for goodput")
    online.add_argument("--priority-mix", type=float, default=None,
                        help="fraction of requests sent with priority 0 (the rest 1)")
    online.add_argument("--served-model", default=None, help="model name (asked when omitted)")
    online.add_argument("--vocab-size", type=int, default=None,
                        help="draw token ids below this (default: the server's /v1/models "
                             "vocab_size, else 49152)")
    online.add_argument("--api-key", default=None)
    online.add_argument("--output", default=None)
    online.set_defaults(func=_cmd_bench_serve)

    soak = bench_sub.add_parser(
        "soak", help="bounded mixed traffic (arrivals, disconnects, priorities, two tenants, "
                     "timeouts) with a report every minute; goodput at the end")
    soak.add_argument("--url", default=None, help="base URL of a running server")
    soak.add_argument("--launch", default=None,
                      help="start `treadle serve` with these options instead (two API keys "
                           "are made for two tenants unless --api-keys-file is among them)")
    soak.add_argument("--api-key", action="append", default=None,
                      help="with --url: one key per tenant (repeat for two tenants)")
    soak.add_argument("--rate", type=float, default=6.0, help="arrivals per second (Poisson)")
    soak.add_argument("--duration", type=float, default=240.0,
                      help="seconds of arrivals; open requests then finish or time out")
    soak.add_argument("--max-in-flight", type=int, default=150)
    soak.add_argument("--timeout", type=float, default=300.0,
                      help="client deadline per request, from its arrival (s)")
    soak.add_argument("--disconnect-fraction", type=float, default=0.1,
                      help="share of clients that leave mid-stream")
    soak.add_argument("--priorities", type=int, nargs="+", default=[-5, 0, 5])
    soak.add_argument("--priority-weights", type=float, nargs="+", default=[0.2, 0.6, 0.2])
    soak.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("LO", "HI"))
    soak.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"))
    soak.add_argument("--report-interval", type=float, default=60.0, help="seconds")
    soak.add_argument("--workload-seed", type=int, default=0)
    soak.add_argument("--vocab-size", type=int, default=None,
                      help="token ids below this (default: the server's /v1/models vocab_size)")
    soak.add_argument("--output", default=None)
    soak.set_defaults(func=_cmd_bench_soak)

    dash = bench_sub.add_parser(
        "dashboard", help="what watching costs: the step recorder per step, and served "
                          "throughput with the recorder off, on, and a dashboard open")
    dash.add_argument("--launch", default="--dtype bfloat16",
                      help="`treadle serve` options of both servers (the demo model unless "
                           "--model is among them)")
    dash.add_argument("--num-requests", type=int, default=64)
    dash.add_argument("--repeats", type=int, default=3,
                      help="alternating repeats of the served runs (0: the recorder only)")
    dash.add_argument("--viewer", choices=["sse", "browser"], default="sse",
                      help="what keeps the dashboard open: an events client, or headless "
                           "Chromium")
    dash.add_argument("--workload-seed", type=int, default=0)
    dash.add_argument("--max-model-len", type=int, default=2048,
                      help="cap each request's prompt + output to this many tokens (prompt "
                           "first; a shorter run of the same workload on a busy machine)")
    dash.add_argument("--launch-on-first", action="store_true",
                      help="launch the server with the recorder before the one without "
                           "(default: the other way round)")
    dash.add_argument("--output", default=None)
    dash.set_defaults(func=_cmd_bench_dashboard)

    sched = bench_sub.add_parser(
        "scheduling", help="mixed-priority and azure-conv replays under several policies "
                           "(options: treadle bench scheduling -- --help)")
    sched.add_argument("rest", nargs=argparse.REMAINDER)
    sched.set_defaults(func=_cmd_bench_scheduling)

    lora = bench_sub.add_parser(
        "lora", help="multi-LoRA offline throughput with 0/1/4/16 adapters against the base "
                     "model (options: treadle bench lora -- --help)")
    lora.add_argument("rest", nargs=argparse.REMAINDER)
    lora.set_defaults(func=_cmd_bench_lora)

    spec_ = bench_sub.add_parser("spec", help="speculative decoding: off, ngram, draft, self "
                                              "on copy-heavy and chat workloads")
    from treadle.bench.spec import add_arguments as add_spec_arguments
    add_spec_arguments(spec_)
    spec_.set_defaults(func=_cmd_bench_spec)
    ppl = bench_sub.add_parser("perplexity", help="perplexity of a fixed text through treadle "
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

    kv = bench_sub.add_parser("kv", help="KV memory: fragmentation, prefix cache, preemption")
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

    from treadle.sim.cli import add_parser as add_simulate_parser
    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a load generator's thousands of lines, not news.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
