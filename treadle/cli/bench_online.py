"""`treadle bench` commands that load a server over HTTP: serve (any OpenAI-compatible
server), soak (bounded mixed traffic), capacity (the highest rate under an SLO, per
policy and chunk size, with a peer) and dashboard (what watching costs).

Each command parses its options, launches `treadle serve` when asked to
(treadle/measure/launch.py), and calls treadle/bench and treadle/measure; no benchmark
logic lives here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treadle.cli.bench_common import failed, write_result


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

    from treadle.measure import workloads
    from treadle.measure.launch import launched_server
    from treadle.measure.http_load import request_records, run_load, served_model, summarize

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
    print("wrote", write_result(summary, args.output, "serve.json"))
    return failed("serve", summary["num_failed"], summary["num_requests"], summary["errors"])


def _cmd_bench_soak(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import secrets
    import shlex
    import tempfile

    from treadle.measure.launch import launched_server
    from treadle.measure.http_load import served_model
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
    print("wrote", write_result(result, args.output, "soak.json"))
    return failed("soak", summary["error"], summary["num_requests"], summary["errors"])


VLLM_SERVER = ("VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-{last_core} "
               "VLLM_HOST_IP=127.0.0.1 {python} -m vllm.entrypoints.openai.api_server "
               "--model {{model}} --host 127.0.0.1 --port {{port}} --dtype bfloat16 "
               "--max-model-len {max_model_len} {options}")
"""vLLM's CPU build as docs/benchmarks.md runs it (its own venv; both cores to its worker)."""


BOUND_NAMES = {-1: "no bound", 0: "auto bound"}
"""How a system's name says its `--decode-step-prefill-tokens` (core/decode_gap.py)."""


def _capacity_systems(args: argparse.Namespace) -> list:
    import contextlib
    import functools
    import os
    import shlex

    from treadle.bench.capacity import POLICIES_COMPARED, System
    from treadle.bench.compare import _external_server
    from treadle.config import SCHEDULING_POLICIES, SchedulerConfig
    from treadle.measure.launch import launched_server

    policies = (args.policies.split(",") if args.policies
                else [p for p in POLICIES_COMPARED if p in SCHEDULING_POLICIES])
    unknown = [p for p in policies if p not in SCHEDULING_POLICIES]
    if unknown:
        raise ValueError(f"--policies: {unknown[0]!r} is not a scheduling policy "
                         f"({', '.join(SCHEDULING_POLICIES)})")
    chunks = [int(c) for c in args.chunk_sizes.split(",")]
    base = ["--model", args.model, *shlex.split(args.launch or "")]

    @contextlib.contextmanager
    def treadle(options):
        with launched_server(base + options, startup_timeout=900) as (url, _):
            yield url

    bounds = ([int(b) for b in args.decode_step_prefill_tokens.split(",")]
              if args.decode_step_prefill_tokens else [None])
    for bound in bounds:  # the config's own check, before any server starts
        if bound is not None:
            SchedulerConfig(decode_step_prefill_tokens=bound)
    systems = []
    for chunk in chunks:
        for bound in bounds:
            for policy in policies:
                # The slo policy orders by each request's deadlines: the SLO's targets.
                extra = ({"slo_ttft_ms": args.slo_ms[0], "slo_tpot_ms": args.slo_ms[1]}
                         if policy == "slo" and args.slo_ms else None)
                options = ["--scheduling-policy", policy, "--max-num-batched-tokens",
                           str(chunk)]
                name = f"treadle {policy} chunk {chunk}"
                if bound is not None:
                    options += ["--decode-step-prefill-tokens", str(bound)]
                    name += " " + BOUND_NAMES.get(bound, f"{bound} beside decodes")
                systems.append(System(name, functools.partial(treadle, options), extra))
    if args.peer == "vllm":
        if not os.path.isdir(args.model):
            raise ValueError("--peer vllm needs --model to be a checkpoint folder both "
                             f"servers load, got {args.model!r}")
        command = VLLM_SERVER.format(last_core=(os.cpu_count() or 1) - 1,
                                     python=shlex.quote(args.vllm_python),
                                     max_model_len=args.max_model_len,
                                     options=args.vllm_options or "")
        systems.append(System("vllm", lambda: _external_server(command, args.model, 1800)))
    return systems


def _cmd_bench_capacity(args: argparse.Namespace) -> int:
    from treadle.bench.capacity import SLO, TraceLoad, run_capacity, table_rows
    from treadle.measure.report import format_table

    args.slo_ms = None
    slo = None
    if args.slo != "auto":
        targets = dict(part.split("=", 1) for part in args.slo.split(","))
        if set(targets) != {"ttft", "tbt"}:
            raise ValueError(f"--slo takes ttft=MS,tbt=MS or auto, got {args.slo!r}")
        args.slo_ms = (float(targets["ttft"]), float(targets["tbt"]))
        slo = SLO(args.slo_ms[0] / 1000, args.slo_ms[1] / 1000)
    load = TraceLoad(probe_s=args.probe_seconds, min_requests=args.min_requests,
                     token_scale=args.token_scale, max_model_len=args.max_model_len,
                     timeout_s=args.timeout)
    if args.max_doublings < 0 or args.bisections < 0:
        raise ValueError("--max-doublings and --bisections must be >= 0")
    result = run_capacity(_capacity_systems(args), load, slo, args.goodput_factor,
                          max_doublings=args.max_doublings, bisections=args.bisections)
    result["command"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(format_table(table_rows(result), ["system", "capacity req/s", "x first",
                                             "goodput req/s", "at req/s"]))
    print("wrote", write_result(result, args.output, "capacity.json"))
    return 0


def _cmd_bench_dashboard(args: argparse.Namespace) -> int:
    import shlex

    from treadle.bench.dashboard import served_cost
    from treadle.measure.report import format_table

    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1 (what the recorder alone costs per step: "
                         "python benchmarks/dashboard_recorder.py)")
    options = shlex.split(args.launch)
    if not any(a == "--model" or a.startswith("--model=") for a in options):
        options = ["--model", "demo", *options]
    served = served_cost(options, args.num_requests, args.repeats, args.viewer,
                         args.workload_seed, args.max_model_len, on_first=args.launch_on_first)
    result: dict = {"served": served}
    print(format_table([{"system": name, "median output tok/s": tps,
                         "ratio to off": served["ratio_to_off"][name]}
                        for name, tps in served["median_output_tokens_per_s"].items()],
                       ["system", "median output tok/s", "ratio to off"]))
    print("open / on per repeat:", ", ".join(f"{r:.4f}" for r in served["per_repeat_open_to_on"]))
    print("wrote", write_result(result, args.output, "dashboard.json"))
    return 0


def add_serve(sub) -> None:
    """Register `bench serve`."""
    online = sub.add_parser("serve", help="load an OpenAI-compatible server over HTTP")
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


def add_soak(sub) -> None:
    """Register `bench soak`."""
    soak = sub.add_parser(
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


def add_capacity(sub) -> None:
    """Register `bench capacity`."""
    cap = sub.add_parser(
        "capacity", help="the highest request rate meeting p99 TTFT and TBT targets on the "
                         "Azure conversation trace, per policy, chunk size and bound beside "
                         "decodes (and a peer); "
                         "goodput at 1.5x it")
    cap.add_argument("--model", default="demo",
                     help="the checkpoint every server loads (demo: random weights)")
    cap.add_argument("--launch", default="--dtype bfloat16",
                     help="further `treadle serve` options of every treadle server")
    cap.add_argument("--policies", default=None,
                     help="comma-separated (default: fcfs, priority, srpt, fair and slo, "
                          "those the registry has)")
    cap.add_argument("--chunk-sizes", default="512",
                     help="max_num_batched_tokens values, comma-separated")
    cap.add_argument("--decode-step-prefill-tokens", default=None,
                     help="also a list of bounds on prompt tokens beside decodes (-1: none, "
                          "0: auto, N), comma-separated, each a treadle system of its own "
                          "(`--decode-step-prefill-tokens=-1,0`; not set: the servers' own "
                          "setting)")
    cap.add_argument("--slo", default="auto",
                     help="ttft=MS,tbt=MS (p99 targets), or auto: 5x the first system's "
                          "p99 TTFT and median gap one request at a time")
    cap.add_argument("--goodput-factor", type=float, default=1.5,
                     help="goodput is measured at this multiple of the first capacity")
    cap.add_argument("--probe-seconds", type=float, default=40.0,
                     help="seconds of arrivals per probe")
    cap.add_argument("--min-requests", type=int, default=24)
    cap.add_argument("--max-doublings", type=int, default=8,
                     help="the search doubles the rate at most this many times")
    cap.add_argument("--bisections", type=int, default=3,
                     help="bisections between the last pass and the first miss")
    cap.add_argument("--token-scale", type=float, default=0.25,
                     help="the trace's token counts times this (this machine's scale)")
    cap.add_argument("--max-model-len", type=int, default=2048)
    cap.add_argument("--timeout", type=float, default=120.0,
                     help="a request open this long after it was sent is a failure (s)")
    cap.add_argument("--peer", choices=["vllm"], default=None,
                     help="also measure vLLM's CPU build on the same checkpoint")
    cap.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python",
                     help="the python of vLLM's virtual environment")
    cap.add_argument("--vllm-options", default=None,
                     help="further options of vLLM's api_server")
    cap.add_argument("--output", default=None)
    cap.set_defaults(func=_cmd_bench_capacity)


def add_dashboard(sub) -> None:
    """Register `bench dashboard`."""
    dash = sub.add_parser(
        "dashboard", help="what watching costs: served throughput with the step recorder "
                          "off, on, and a dashboard open")
    dash.add_argument("--launch", default="--dtype bfloat16",
                      help="`treadle serve` options of both servers (the demo model unless "
                           "--model is among them)")
    dash.add_argument("--num-requests", type=int, default=64)
    dash.add_argument("--repeats", type=int, default=3,
                      help="alternating repeats of the served runs")
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
