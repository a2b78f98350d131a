"""`treadle bench compare CONFIG.yaml`: several systems, one workload, one run, side by side.

Owns reading the comparison config, checking the optional dependencies before anything
runs (matplotlib, from the `bench` extra: a run takes many minutes, and only then come the
plots), running each system on the same workload in turn (alternating over repeats, so
drift on a shared machine hits every system alike), the table of figures with ratios
against the first entry, and the plots. A system is one of:

- `treadle`: `treadle serve <options>` launched on 127.0.0.1, loaded over HTTP;
- `server`: any OpenAI-compatible server started by a shell `command` (`{port}` and
  `{model}` are filled in), loaded over HTTP, stopped by its process group;
- `static`: transformers `generate` in padded batches (offline: throughput only);
- `treadle-offline`: `treadle bench throughput <options>` in a child process, i.e.
  `LLM.generate` on the whole workload at once (offline: throughput only);
- `offline`: any offline runner started by a shell `command` with `{model}`, `{workload}`
  (the workload as a JSON file, `workloads.save_workload`) and `{output}` (where it writes
  a JSON object with `output_tokens_per_s` and `total_tokens_per_s`), e.g.
  benchmarks/vllm_offline.py for vLLM's `LLM.generate`.

Example (benchmarks/compare_cpu.yaml):

    model: demo                 # demo (random weights), a checkpoint folder, .gguf or HF id
    workload: {name: synthetic, num_requests: 64, seed: 0}
    load: {rates: [null]}       # requests/s per point; null = all at once;
                                # "trace" = the workload's own arrival times
    repeats: 1
    systems:
      - {name: treadle, kind: treadle, options: "--dtype bfloat16"}
      - {name: static-16, kind: static, batch_size: 16}
      - {name: vllm, kind: server, command: "python -m vllm... --port {port}"}
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from treadle.measure import workloads
from treadle.measure.launch import (free_port, launched_server, peer_environment, stop,
                                    wait_healthy)
from treadle.measure.report import format_table, percentiles
from treadle.measure.http_load import request_records, run_load, summarize

_KINDS = ("treadle", "server", "static", "treadle-offline", "offline")
_NEEDS_COMMAND = ("server", "offline")
_OPTIONAL_MODULES = {"matplotlib": "the plots"}
"""Modules of the `bench` extra that a comparison needs, and what for."""


def check_dependencies() -> None:
    """SystemExit naming what is missing and how to install it, before any system runs."""
    missing = [f"{name} (for {use})" for name, use in _OPTIONAL_MODULES.items()
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"treadle bench compare needs {', '.join(missing)}, which the "
                         f"`bench` extra installs: pip install 'treadle[bench]' (or "
                         f"pip install -e '.[bench]' in a checkout). Nothing was run.")


def load_config(path: str | Path) -> dict:
    config = yaml.safe_load(Path(path).read_text())
    systems = config.get("systems") or []
    if not systems:
        raise ValueError(f"{path}: 'systems' must list at least one system")
    for i, system in enumerate(systems):
        if system.get("kind") not in _KINDS:
            raise ValueError(f"{path}: systems[{i}].kind must be one of {_KINDS}, "
                             f"got {system.get('kind')!r}")
        if system["kind"] in _NEEDS_COMMAND and not system.get("command"):
            raise ValueError(f"{path}: systems[{i}] ({system['kind']}) needs a 'command'")
        system.setdefault("name", f"{system['kind']}-{i}")
    config.setdefault("workload", {"name": "synthetic"})
    config.setdefault("load", {})
    config.setdefault("repeats", 1)
    return config


def make_workload(spec: dict, model: str | None = None) -> workloads.Workload:
    """The configured workload; its token ids below the model's vocabulary unless the
    spec gives `vocab_size`."""
    spec = dict(spec)
    name = spec.pop("name", "synthetic")
    if model is not None and "vocab_size" not in spec:
        spec["vocab_size"] = workloads.model_vocab_size(model)
    builders = {"synthetic": workloads.synthetic, "azure-conv": workloads.azure_conv,
                "shared-prefix": workloads.shared_prefix}
    if name not in builders:
        raise ValueError(f"workload.name must be one of {sorted(builders)}, got {name!r}")
    return builders[name](**spec)


def _fill(command: str, **values: str) -> str:
    """Fill `{name}` placeholders with shell-quoted values. Only these names are filled:
    the shell's own ${VAR} braces stay as they are (str.format would read them as fields)."""
    for name, value in values.items():
        command = command.replace("{" + name + "}", shlex.quote(value))
    return command


def _server_log(port_or_name) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"compare-server-{port_or_name}.log"


_offline_runs = itertools.count()


def _offline(command: str, model: str, workload, timeout_s: float) -> dict:
    """Run an offline runner on the workload (written to a file); its JSON result."""
    with tempfile.TemporaryDirectory(prefix="treadle-compare-") as tmp:
        workload_path = workloads.save_workload(workload, Path(tmp) / "workload.json")
        output = Path(tmp) / "result.json"
        filled = _fill(command, model=model, workload=str(workload_path), output=str(output))
        log_path = _server_log(f"offline-{os.getpid()}-{next(_offline_runs)}")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(filled, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=peer_environment())
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"offline runner ran past {timeout_s:.0f} s "
                                   f"(log: {log_path})") from None
            finally:  # past its time, or this process stopped while it ran
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if code != 0 or not output.exists():
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"offline runner exited with {code} (log: {log_path}):\n{tail}")
        result = json.loads(output.read_text())
    for key in ("output_tokens_per_s", "total_tokens_per_s"):
        if not isinstance(result.get(key), (int, float)):
            raise RuntimeError(f"offline runner's result has no number {key!r}")
    return result


def treadle_offline_command(options: str) -> str:
    """The `offline` command that runs treadle's own LLM.generate on a workload file."""
    return (f"{shlex.quote(sys.executable)} -m treadle.cli bench throughput "
            f"--workload-file {{workload}} --model {{model}} --output {{output}} {options}")


@contextmanager
def _external_server(command: str, model: str, timeout_s: float) -> Iterator[str]:
    """Start a server from a shell command; yield its base URL; stop its process group."""
    port = free_port()
    log = open(_server_log(port), "w")
    command = _fill(command, port=str(port), model=model)
    proc = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=peer_environment())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout_s, log.name)
        yield base
    finally:
        stop(proc, group=True)
        log.close()


def _online(base: str, workload, rates: list, load: dict) -> list[dict]:
    """One summary per rate, every request streamed over HTTP."""
    from treadle.measure.http_load import served_model

    model = served_model(base)["id"]
    points = []
    for rate in rates:
        results, duration = asyncio.run(run_load(
            base, workload, model, rate=rate, burstiness=load.get("burstiness", 1.0),
            max_concurrency=load.get("max_concurrency"), progress=False,
            use_trace_times=rate == "trace"))
        summary = summarize(results, duration, load.get("slo_ttft_ms"), load.get("slo_tpot_ms"))
        summary["rate"] = rate
        summary["ttft_s_values"] = sorted(r.ttft for r in results if r.ok)
        summary["tpot_s_values"] = sorted(r.tpot for r in results if r.ok and r.tpot)
        summary["requests"] = request_records(results)
        points.append(summary)
    return points


def run_system(system: dict, model: str, workload, load: dict) -> list[dict]:
    """Every load point of one system (one point for static batching)."""
    rates = load.get("rates") or [None]
    timeout = float(system.get("startup_timeout_s", 600))
    if system["kind"] == "static":
        from treadle.bench.static import run_static
        r = run_static(model, workload, batch_size=int(system.get("batch_size", 16)),
                       dtype=system.get("dtype", "bfloat16"), progress=False)
        return [{"rate": None, "output_tokens_per_s": r["output_tokens_per_s"],
                 "total_tokens_per_s": r["total_tokens_per_s"], "num_failed": 0,
                 "static": {k: v for k, v in r.items() if k != "per_batch"}}]
    if system["kind"] in ("offline", "treadle-offline"):
        command = (system["command"] if system["kind"] == "offline"
                   else treadle_offline_command(system.get("options", "")))
        r = _offline(command, model, workload, timeout)
        return [{"rate": None, "output_tokens_per_s": r["output_tokens_per_s"],
                 "total_tokens_per_s": r["total_tokens_per_s"],
                 "num_failed": int(r.get("num_errors", 0)),
                 "offline": {k: v for k, v in r.items() if k not in ("per_batch",)}}]
    if system["kind"] == "treadle":
        serve_args = ["--model", model, *shlex.split(system.get("options", ""))]
        with launched_server(serve_args, startup_timeout=timeout) as (base, _):
            return _online(base, workload, rates, load)
    with _external_server(system["command"], model, timeout) as base:
        return _online(base, workload, rates, load)


def compare(config: dict) -> dict:
    """Run every system `repeats` times, alternating; keep every point of every run.
    Checks the optional dependencies first (`check_dependencies`)."""
    check_dependencies()
    from treadle.engine.core import resolve_checkpoint

    # Every system loads the same files: a folder or a .gguf file given is passed as is (a
    # GGUF's quantized weights are what llama-server and treadle's --quantization gguf
    # both run); demo (the default) or a Hub id become the folder treadle resolves them to.
    model = config.get("model") or "demo"
    if not Path(model).is_dir() and not (model.endswith(".gguf") and Path(model).is_file()):
        model = str(resolve_checkpoint(model))
    workload = make_workload(config["workload"], model)
    runs: dict[str, list[list[dict]]] = {s["name"]: [] for s in config["systems"]}
    for _ in range(int(config["repeats"])):
        for system in config["systems"]:
            runs[system["name"]].append(run_system(system, model, workload, config["load"]))
    return {"model": model, "workload": workload.description | {"name": workload.name},
            "load": config["load"], "systems": config["systems"], "runs": runs,
            "table": table(runs)}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def table(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """One row per system at its first load point: medians over repeats, and the ratio of
    output tokens/s and p99 TTFT against the first system."""
    rows = []
    for name, repeats in runs.items():
        first_points = [points[0] for points in repeats]
        row = {"system": name,
               "output tok/s": _median([p["output_tokens_per_s"] for p in first_points]),
               "total tok/s": _median([p["total_tokens_per_s"] for p in first_points]),
               "TTFT p50 ms": None, "TTFT p99 ms": None, "TPOT p50 ms": None,
               "failed": sum(p["num_failed"] for p in first_points)}
        if "ttft_ms" in first_points[0]:
            row["TTFT p50 ms"] = _median([p["ttft_ms"]["median"] for p in first_points])
            row["TTFT p99 ms"] = _median([p["ttft_ms"]["p99"] for p in first_points])
            row["TPOT p50 ms"] = _median([p["tpot_ms"]["median"] for p in first_points])
            pooled = [v for p in first_points for v in p.get("ttft_s_values", [])]
            if pooled:  # every request of every repeat: steadier than one run's p99
                row["TTFT p99 pooled ms"] = percentiles([v * 1000 for v in pooled])["p99"]
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["x output tok/s"] = row["output tok/s"] / base["output tok/s"]
        if row["TTFT p99 ms"] is not None and base["TTFT p99 ms"]:
            row["x TTFT p99"] = row["TTFT p99 ms"] / base["TTFT p99 ms"]
    return rows


TABLE_COLUMNS = ["system", "output tok/s", "x output tok/s", "total tok/s", "TTFT p50 ms",
                 "TTFT p99 ms", "x TTFT p99", "TTFT p99 pooled ms", "TPOT p50 ms", "failed"]


def plot(result: dict, out_dir: str | Path) -> list[Path]:
    """Throughput bars, TTFT / TPOT distributions, and latency against request rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, runs, written = result["table"], result["runs"], []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["system"] for r in rows], [r["output tok/s"] for r in rows], color="#4c72b0")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput, {result['workload']['name']}")
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    online = {name: reps[0][0] for name, reps in runs.items() if "ttft_s_values" in reps[0][0]}
    if online:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for name, point in online.items():
            for ax, key, label in ((axes[0], "ttft_s_values", "TTFT (s)"),
                                   (axes[1], "tpot_s_values", "TPOT (s)")):
                values = point[key]
                if values:
                    ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                            label=name)
                ax.set_xlabel(label)
                ax.set_ylabel("fraction of requests")
        axes[0].legend()
        fig.tight_layout()
        written.append(out / "latency_cdf.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

        if any(len(reps[0]) > 1 for reps in runs.values()):
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for name, reps in runs.items():
                points = [p for p in reps[0] if isinstance(p.get("rate"), (int, float))]
                if points:
                    ax.plot([p["rate"] for p in points], [p["ttft_ms"]["p99"] for p in points],
                            marker="o", label=name)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("p99 TTFT (ms)")
            ax.legend()
            fig.tight_layout()
            written.append(out / "latency_vs_rate.png")
            fig.savefig(written[-1], dpi=120)
            plt.close(fig)
    return written


def main_table(result: dict) -> str:
    return format_table(result["table"], TABLE_COLUMNS)


def strip_samples(result: dict) -> dict[str, Any]:
    """The result without per-request latency lists (kept for plots, not for JSON)."""
    clean = dict(result)
    clean["runs"] = {name: [[{k: v for k, v in p.items() if not k.endswith("_values")}
                             for p in points] for points in reps]
                     for name, reps in result["runs"].items()}
    return clean
