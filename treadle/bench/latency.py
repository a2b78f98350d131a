"""`treadle bench latency`: one user at a time and a few, measured as llama.cpp measures it.

Owns the grid of one model file x concurrency: at concurrency 1, treadle's offline engine
(`LLM`, in this process) against `llama-bench` (a 512-token prompt's prefill, pp512, and
128 tokens decoded after a context of that prompt, tg128 at depth 512); at concurrency
above 1, `treadle serve` against `llama-server` on the same GGUF file, both loaded by the
same load generator (treadle.measure.http_load): `concurrency` requests of the same
lengths sent at once, streamed. The systems alternate within each repeat, so drift on a
shared machine falls on both; ratios are paired by repeat. Every point reports prefill
tok/s, decode tok/s (per stream at 1; the streams' rates summed above), TTFT and TPOT,
and the aggregate output tok/s of the served points. Optionally a bounded CPU hog runs
beside (treadle.measure.background_load). A served point whose requests fail is kept
with its error (the table counts them, the command exits 1) and that system is sent no
more: what was measured before stays in the result.

It measures only: nothing here is a target, and the engine is reached through its public
API (LLM, `treadle serve`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shlex
import statistics
import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

from treadle.measure import workloads
from treadle.measure.background_load import background_load
from treadle.measure.http_load import run_load, served_model, summarize
from treadle.measure.launch import (free_port, launched_server, peer_environment, stop,
                                    wait_healthy)
from treadle.measure.report import cpu_info

DEFAULT_CONCURRENCY = (1, 4, 16, 64)
PEERS = ("llamacpp",)

FIGURES = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "tpot_ms", "output_tok_s")
"""What each point reports (output_tok_s on served points only)."""


def prompts(num: int, prompt_len: int, output_len: int, vocab_size: int, seed: int
            ) -> workloads.Workload:
    """`num` requests of exactly `prompt_len` random token ids and `output_len` outputs."""
    return workloads.synthetic(num_requests=num, prompt_len=(prompt_len, prompt_len),
                               output_len=(output_len, output_len), num_long=0,
                               vocab_size=vocab_size, seed=seed)


# ----- treadle ------------------------------------------------------------------------------

def treadle_single(llm, prompt_len: int, output_len: int, seed: int) -> dict:
    """One request on the offline engine: TTFT is its prefill (the first token comes with
    the prompt's last chunk), TPOT the mean gap of the tokens after it."""
    from treadle import SamplingParams

    work = prompts(1, prompt_len, output_len, llm.limits.vocab_size, seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    output = llm.generate([{"prompt_token_ids": work.requests[0].prompt_token_ids}], params,
                          use_tqdm=False)[0]
    if output.error:
        raise RuntimeError(f"treadle failed the request: {output.error}")
    m = output.metrics
    ttft = m.first_token_time - m.arrival_time
    num_out = len(output.outputs[0].token_ids)
    tpot = (m.finished_time - m.first_token_time) / max(1, num_out - 1)
    return {"prefill_tok_s": prompt_len / ttft, "decode_tok_s": 1.0 / tpot,
            "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "output_tokens": num_out}


def served_point(base: str, concurrency: int, prompt_len: int, output_len: int,
                 vocab_size: int, seed: int) -> dict:
    """`concurrency` requests sent at once to a server, streamed; the point's figures:
    prefill tok/s (every prompt token over the time until the last first token), decode
    tok/s (the streams' own rates after their first token, summed), TTFT and TPOT
    (medians, and p99), output tok/s (every output token over the run)."""
    work = prompts(concurrency, prompt_len, output_len, vocab_size, seed)
    model = served_model(base)["id"]
    results, duration = asyncio.run(run_load(base, work, model, rate=None, progress=False))
    summary = summarize(results, duration)
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):
        raise RuntimeError(f"{len(results) - len(ok)} of {len(results)} requests failed at "
                           f"{base}: {summary['errors'][:2]}")
    rates = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in ok
             if r.output_tokens > 1 and r.e2e > r.ttft]
    return {"prefill_tok_s": sum(r.prompt_tokens for r in ok) / max(r.ttft for r in ok),
            "decode_tok_s": sum(rates), "ttft_ms": summary["ttft_ms"]["median"],
            "ttft_p99_ms": summary["ttft_ms"]["p99"], "tpot_ms": summary["tpot_ms"]["median"],
            "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "output_tok_s": summary["output_tokens_per_s"],
            "output_tokens": sum(r.output_tokens for r in ok)}


def serve_flags(options: dict[str, Any]) -> list[str]:
    """Engine options as `treadle serve` flags (config.add_config_arguments' spelling)."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


# ----- llama.cpp ----------------------------------------------------------------------------

def llamacpp_binary(llamacpp_dir: str, name: str) -> Path:
    """A llama.cpp program in a build folder (build/bin/NAME, bin/NAME or NAME)."""
    root = Path(llamacpp_dir).expanduser()
    for candidate in (root / "build" / "bin" / name, root / "bin" / name, root / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"no executable {name} under {root} (looked in build/bin, bin "
                            "and the folder itself); build llama.cpp first "
                            "(docs/benchmarks.md, 'llama.cpp as a peer')")


def llama_bench_args(binary: Path, model: str, prompt_len: int, output_len: int,
                     threads: int) -> list[list[str]]:
    """The two llama-bench runs of one repeat: pp<prompt_len> at depth 0, then
    tg<output_len> at depth <prompt_len> (decoding after the prompt, as treadle does)."""
    common = [str(binary), "-m", model, "-t", str(threads), "-r", "1", "-o", "json"]
    return [common + ["-p", str(prompt_len), "-n", "0"],
            common + ["-p", "0", "-n", str(output_len), "-d", str(prompt_len)]]


def parse_llama_bench(text: str) -> dict:
    """llama-bench's JSON (a list of tests) -> {"pp": tok/s, "tg": tok/s}."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"llama-bench printed no JSON: {text[-500:]!r}")
    rows = json.loads(text[start:])
    figures = {}
    for row in rows:
        key = "tg" if row.get("n_gen", 0) > 0 else "pp"
        figures[key] = float(row["avg_ts"])
    return figures


def llamacpp_single(binary: Path, model: str, prompt_len: int, output_len: int,
                    threads: int, timeout_s: float = 1800.0) -> dict:
    """One repeat of llama-bench: the same figures as `treadle_single`."""
    figures: dict[str, float] = {}
    for args in llama_bench_args(binary, model, prompt_len, output_len, threads):
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                              env=peer_environment(), cwd=binary.parent)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(args)} exited with {done.returncode}: "
                               f"{done.stderr[-1000:]}")
        figures.update(parse_llama_bench(done.stdout))
    pp, tg = figures["pp"], figures["tg"]
    return {"prefill_tok_s": pp, "decode_tok_s": tg, "ttft_ms": prompt_len / pp * 1e3,
            "tpot_ms": 1e3 / tg}


def llama_server_args(binary: Path, model: str, port: int, slots: int, context: int,
                      threads: int) -> list[str]:
    """llama-server with `slots` parallel sequences of `context` tokens each."""
    return [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "--no-webui"]


@contextmanager
def llama_server(binary: Path, model: str, slots: int, context: int, threads: int,
                 log_dir: Path, timeout_s: float = 600.0) -> Iterator[str]:
    """A llama-server on a free port; its base URL; stopped by its PID at the end."""
    port = free_port()
    log_path = log_dir / f"llama-server-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(llama_server_args(binary, model, port, slots, context, threads),
                                stdout=log, stderr=subprocess.STDOUT, env=peer_environment(),
                                cwd=binary.parent, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc, timeout_s, str(log_path))
            yield base
        finally:
            stop(proc)


# ----- the grid -----------------------------------------------------------------------------

_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
              "amx_bf16")


def cpu_description() -> dict:
    """The CPU a figure ran on: model name and the flags the kernels' levels depend on."""
    name, flags = cpu_info()
    return {"model": name, "flags": [f for f in _CPU_FLAGS if f in flags]}


def _alternate(systems: list, repeat: int) -> list:
    """Systems in turn, the order reversed every other repeat."""
    return list(systems) if repeat % 2 == 0 else list(reversed(systems))


def _single_points(model: str | None, peer_model: str | None, options: dict,
                   cfg: dict, llama_bench: Path | None) -> tuple[list[dict], str | None]:
    """Concurrency 1, offline: treadle's LLM in this process against llama-bench."""
    from treadle import LLM

    llm = LLM(model=model, **options)
    kernels = llm.engine.info.kernels
    try:
        treadle_single(llm, min(cfg["prompt_len"], 64), 4, seed=10_000)  # warm-up
        systems = ["treadle"] + (["llama.cpp"] if llama_bench is not None else [])
        points = []
        for repeat in range(cfg["repeats"]):
            for system in _alternate(systems, repeat):
                if system == "treadle":
                    figures = treadle_single(llm, cfg["prompt_len"], cfg["output_len"],
                                             cfg["seed"] + repeat)
                else:
                    figures = llamacpp_single(llama_bench, peer_model, cfg["prompt_len"],
                                              cfg["output_len"], cfg["peer_threads"])
                points.append({"system": system, "concurrency": 1, "mode": "offline",
                               "repeat": repeat, **figures})
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
    return points, kernels


def _served_points(model: str | None, peer_model: str | None, options: dict, cfg: dict,
                   levels: list[int], llama_dir: str | None, log_dir: Path) -> list[dict]:
    """Concurrency above 1: `treadle serve` against llama-server, the same load."""
    # Every request of a point is sent at once and must be served, as llama-server serves
    # it: no refusal for a predicted wait (at 64 streams of 512-token prompts the wait
    # passes the default 20 s and a quarter of the requests were 503s).
    serve_args = ([] if model is None else ["--model", model]) + serve_flags(
        {"max_num_seqs": max(levels), **options}) + ["--max-queue-delay", "0"]
    points = []
    with ExitStack() as stack:
        bases = {"treadle": stack.enter_context(launched_server(
            serve_args, startup_timeout=cfg["startup_timeout_s"]))[0]}
        if llama_dir is not None:
            bases["llama.cpp"] = stack.enter_context(llama_server(
                llamacpp_binary(llama_dir, "llama-server"), peer_model, max(levels),
                cfg["prompt_len"] + cfg["output_len"] + 16, cfg["peer_threads"], log_dir,
                cfg["startup_timeout_s"]))
        vocab = served_model(bases["treadle"]).get("vocab_size") or cfg["vocab_size"]
        for base in bases.values():  # warm-up: kernels built, first pages touched
            served_point(base, 2, min(cfg["prompt_len"], 64), 4, vocab, seed=10_000)
        failed: set[str] = set()
        for repeat in range(cfg["repeats"]):
            for concurrency in levels:
                for system in _alternate(list(bases), repeat):
                    if system in failed:
                        continue
                    point = {"system": system, "concurrency": concurrency, "mode": "served",
                             "repeat": repeat}
                    try:
                        figures = served_point(bases[system], concurrency, cfg["prompt_len"],
                                               cfg["output_len"], vocab,
                                               cfg["seed"] + 100 * concurrency + repeat)
                    except RuntimeError as exc:
                        # Requests failed (a server that died fails every later point too):
                        # the point says why, that system is not sent more, and what was
                        # measured before stays in the result.
                        points.append({**point, "error": str(exc)})
                        failed.add(system)
                        continue
                    points.append({**point, **figures})
    return points


def run_latency(model: str | None = None, concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY,
                prompt_len: int = 512, output_len: int = 128, repeats: int = 3,
                engine_options: dict | None = None, llamacpp_dir: str | None = None,
                peer_threads: int | None = None, background: int = 0, seed: int = 0,
                log_dir: str | None = None, startup_timeout_s: float = 900.0) -> dict:
    """The grid for one model: every concurrency level, treadle and (with `llamacpp_dir`)
    llama.cpp on the same GGUF file, alternating, `repeats` times; the points and the
    table of medians and paired ratios."""
    check_arguments(model, concurrency, prompt_len, output_len, repeats, llamacpp_dir,
                    background)
    options = dict(engine_options or {})
    peer_model = None
    if llamacpp_dir is not None:
        peer_model = str(gguf_file(model))
    cfg = {"prompt_len": prompt_len, "output_len": output_len, "repeats": repeats,
           "seed": seed, "startup_timeout_s": startup_timeout_s, "vocab_size": 49152,
           "peer_threads": peer_threads or options.get("num_threads")
           or len(os.sched_getaffinity(0))}
    levels = sorted(set(concurrency))
    folder = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
    points, kernels = [], None
    started = time.time()
    with background_load(background) as load:
        if 1 in levels:
            llama_bench = (llamacpp_binary(llamacpp_dir, "llama-bench")
                           if llamacpp_dir is not None else None)
            single, kernels = _single_points(model, peer_model, options, cfg, llama_bench)
            points += single
        served = [c for c in levels if c > 1]
        if served:
            points += _served_points(model, peer_model, options, cfg, served, llamacpp_dir,
                                     folder)
        background_pids = load.pids
    return {"model": model, "peer_model": peer_model, "prompt_len": prompt_len,
            "output_len": output_len, "concurrency": levels, "repeats": repeats,
            "engine_options": {k: str(v) for k, v in options.items()},
            "peer": None if llamacpp_dir is None else {
                "name": "llama.cpp", "dir": str(llamacpp_dir),
                "threads": cfg["peer_threads"]},
            "background_load": {"busy_threads": background, "pids": background_pids},
            "cpu": cpu_description(), "treadle_kernels": kernels,
            "load_average_at_end": os.getloadavg(), "seconds": time.time() - started,
            "points": points, "table": table(points)}


def check_arguments(model, concurrency, prompt_len, output_len, repeats, llamacpp_dir,
                    background) -> None:
    """ValueError naming the argument that cannot run."""
    if not concurrency or any(c < 1 for c in concurrency):
        raise ValueError(f"--concurrency: levels must be >= 1, got {list(concurrency)}")
    if prompt_len < 1 or output_len < 2:
        raise ValueError(f"--prompt-len must be >= 1 and --output-len >= 2 (a TPOT needs two "
                         f"tokens), got {prompt_len} and {output_len}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if background < 0:
        raise ValueError(f"--background-load must be >= 0 busy threads, got {background}")
    if llamacpp_dir is not None:
        gguf_file(model)


def gguf_file(model: str | None) -> Path:
    """The GGUF file both systems load: --model itself, or the one behind it (the default
    model's file); ValueError when there is none (llama.cpp reads only GGUF)."""
    from treadle.models.resolve import gguf_source

    path = gguf_source(model)
    if path is None or not Path(path).is_file():
        raise ValueError(f"--peer llamacpp needs a GGUF model (a .gguf file, or the default "
                         f"model); --model {model!r} is not one")
    return Path(path)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(points: list[dict]) -> list[dict]:
    """One row per (concurrency, system): medians over repeats; against the first system
    (treadle), each figure's ratio paired by repeat, then the median of the ratios."""
    rows = []
    levels = sorted({p["concurrency"] for p in points})
    for level in levels:
        at = [p for p in points if p["concurrency"] == level]
        systems = list(dict.fromkeys(p["system"] for p in at))
        base = {p["repeat"]: p for p in at if p["system"] == systems[0]}
        for system in systems:
            mine = [p for p in at if p["system"] == system]
            row = {"concurrency": level, "system": system, "mode": mine[0]["mode"],
                   "repeats": len(mine), "failed": sum("error" in p for p in mine)}
            for figure in (*FIGURES, "ttft_p99_ms", "tpot_p99_ms"):
                row[figure] = _median([p.get(figure) for p in mine])
            if system != systems[0]:
                for figure in ("prefill_tok_s", "decode_tok_s", "output_tok_s"):
                    ratios = [base[p["repeat"]][figure] / p[figure] for p in mine
                              if p["repeat"] in base and p.get(figure)
                              and base[p["repeat"]].get(figure) is not None]
                    row[f"treadle_x_{figure}"] = _median(ratios)
            rows.append(row)
    return rows


TABLE_COLUMNS = ["concurrency", "system", "mode", "prefill_tok_s", "decode_tok_s",
                 "ttft_ms", "tpot_ms", "output_tok_s", "treadle_x_prefill_tok_s",
                 "treadle_x_decode_tok_s", "treadle_x_output_tok_s", "failed"]
