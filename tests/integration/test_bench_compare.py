"""`treadle bench compare`: systems run in turn on one workload; table ratios and plots."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import make_tiny_checkpoint
from treadle.bench.compare import (compare, load_config, main_table, make_workload, plot,
                                   table)
from treadle.measure.workloads import load_workload, save_workload

STUB = textwrap.dedent('''
    import argparse, asyncio, json
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    app = FastAPI()
    @app.get("/health")
    async def health():
        return {"status": "ok"}
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--model", default="stub")
    parser.add_argument("--no-usage", action="store_true")  # as servers without stream usage
    args = parser.parse_args()
    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": args.model}]}
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        async def events():
            await asyncio.sleep(0.03)
            for _ in range(body["max_tokens"]):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\\n\\n"
                await asyncio.sleep(0.005)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            if not args.no_usage:
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\\n\\n"
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="error")
''')


def test_table_ratios_against_first_system():
    point = lambda tps, p99: {"output_tokens_per_s": tps, "total_tokens_per_s": 2 * tps,  # noqa: E731
                              "num_failed": 0, "ttft_ms": {"median": p99 / 2, "p99": p99},
                              "tpot_ms": {"median": 1.0}}
    rows = table({"a": [[point(100, 50)], [point(120, 70)]], "b": [[point(300, 20)]]})
    assert rows[0]["output tok/s"] == 110 and rows[0]["TTFT p99 ms"] == 60
    assert rows[1]["x output tok/s"] == pytest.approx(300 / 110)
    assert rows[1]["x TTFT p99"] == pytest.approx(20 / 60)
    assert "TTFT p99 pooled ms" not in rows[0]  # no per-request samples given


def test_table_pools_every_repeat_for_a_steadier_p99():
    def point(ttfts):
        return {"output_tokens_per_s": 1.0, "total_tokens_per_s": 1.0, "num_failed": 0,
                "ttft_ms": {"median": 0.0, "p99": 1000 * max(ttfts)},
                "tpot_ms": {"median": 1.0}, "ttft_s_values": ttfts}
    runs = [[i / 100 for i in range(100)], [0.5] * 99 + [9.0], [0.2] * 100]
    rows = table({"a": [[point(r)] for r in runs]})
    pooled = [v * 1000 for r in runs for v in r]
    assert rows[0]["TTFT p99 pooled ms"] == pytest.approx(np.percentile(pooled, 99))
    assert rows[0]["TTFT p99 ms"] == pytest.approx(990)  # the median run's p99


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"systems": [{"kind": "magic"}]}))
    with pytest.raises(ValueError, match=r"systems\[0\].kind"):
        load_config(bad)
    bad.write_text(yaml.safe_dump({"systems": [{"kind": "server"}]}))
    with pytest.raises(ValueError, match="command"):
        load_config(bad)


OFFLINE_STUB = textwrap.dedent('''
    import json, sys
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    requests = json.load(open(args["--workload"]))["requests"]
    out = sum(r["max_tokens"] for r in requests)
    total = out + sum(len(r["prompt_token_ids"]) for r in requests)
    json.dump({"output_tokens_per_s": out / 2.0, "total_tokens_per_s": total / 2.0,
               "model": args["--model"]}, open(args["--output"], "w"))
''')


def test_offline_runners_get_the_workload_file_and_report_its_figures(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    stub = tmp_path / "offline_stub.py"
    stub.write_text(OFFLINE_STUB)
    workload = {"name": "synthetic", "num_requests": 5, "prompt_len": [4, 12],
                "output_len": [2, 6], "num_long": 0, "vocab_size": 512, "seed": 3}
    config_path = tmp_path / "cmp.yaml"
    config_path.write_text(yaml.safe_dump({
        "model": model, "workload": workload, "repeats": 1,
        "systems": [
            {"name": "treadle-offline", "kind": "treadle-offline",
             "options": "--dtype float32 --num-kv-blocks 64"},
            {"name": "stub", "kind": "offline",
             "command": f"{sys.executable} {stub} --model {{model}} --workload {{workload}} "
                        "--output {output}"},
        ]}))
    result = compare(load_config(config_path))
    expected = make_workload(workload)
    stub_point = result["runs"]["stub"][0][0]
    # The stub saw exactly the configured workload and model.
    assert stub_point["output_tokens_per_s"] == expected.total_output_tokens / 2.0
    assert stub_point["offline"]["model"] == model
    ours = result["runs"]["treadle-offline"][0][0]["offline"]
    assert ours["output_tokens"] == ours["expected_output_tokens"] == expected.total_output_tokens
    assert ours["num_errors"] == 0 and ours["output_tokens_per_s"] > 0
    rows = {r["system"]: r for r in result["table"]}
    assert rows["stub"]["TTFT p99 ms"] is None


def test_a_failing_offline_runner_is_an_error_with_its_log(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 512}')  # the workload's ids
    config_path = tmp_path / "cmp.yaml"
    config_path.write_text(yaml.safe_dump({
        "model": str(tmp_path), "workload": {"name": "synthetic", "num_requests": 2, "num_long": 0},
        "systems": [{"name": "broken", "kind": "offline",
                     "command": "echo no such runner >&2; exit 3"}]}))
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no such runner"):
        compare(load_config(config_path))


def test_missing_plot_dependency_stops_before_any_system_runs(tmp_path, monkeypatch):
    """Without matplotlib (the `bench` extra) a comparison says so at once, instead of
    after every system has run."""
    import importlib.util

    import treadle.bench.compare as compare_module

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    ran = []
    monkeypatch.setattr(compare_module, "run_system", lambda *args: ran.append(args) or [])
    config = {"systems": [{"name": "s", "kind": "static"}], "workload": {"name": "synthetic"},
              "load": {}, "repeats": 1}
    with pytest.raises(SystemExit, match=r"matplotlib \(for the plots\).*treadle\[bench\]"):
        compare(config)
    assert ran == []


def test_workload_file_round_trip(tmp_path):
    original = make_workload({"name": "synthetic", "num_requests": 7, "seed": 5})
    loaded = load_workload(save_workload(original, tmp_path / "w.json"))
    assert loaded.requests == original.requests and loaded.description == original.description
    (tmp_path / "bad.json").write_text('{"requests": [{"max_tokens": 3}]}')
    with pytest.raises(ValueError, match="prompt_token_ids"):
        load_workload(tmp_path / "bad.json")


def test_compare_treadle_static_and_an_external_server(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    config_path = tmp_path / "cmp.yaml"
    config_path.write_text(yaml.safe_dump({
        "model": model,
        "workload": {"name": "synthetic", "num_requests": 6, "prompt_len": [4, 20],
                     "output_len": [3, 8], "num_long": 0, "vocab_size": 512, "seed": 1},
        "load": {"rates": [None, 50.0]},
        "repeats": 1,
        "systems": [
            {"name": "treadle", "kind": "treadle",
             "options": "--dtype float32 --num-kv-blocks 64"},
            {"name": "static", "kind": "static", "batch_size": 4, "dtype": "float32"},
            {"name": "stub", "kind": "server",
             "command": f"${{TREADLE_UNSET_VAR:-{sys.executable}}} {stub} --port {{port}}"},
        ]}))
    result = compare(load_config(config_path))
    rows = {r["system"]: r for r in result["table"]}
    assert set(rows) == {"treadle", "static", "stub"}
    assert rows["treadle"]["x output tok/s"] == 1.0 and rows["treadle"]["failed"] == 0
    assert rows["stub"]["failed"] == 0 and rows["stub"]["TTFT p50 ms"] >= 30
    assert rows["static"]["TTFT p50 ms"] is None and rows["static"]["output tok/s"] > 0
    assert [p["rate"] for p in result["runs"]["treadle"][0]] == [None, 50.0]
    assert "x output tok/s" in main_table(result)
    written = plot(result, tmp_path / "plots")
    assert {p.name for p in written} == {"throughput.png", "latency_cdf.png",
                                         "latency_vs_rate.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def test_a_gguf_file_reaches_every_system_as_is(tmp_path):
    """A .gguf model is passed to the systems as the file (llama-server and treadle both
    run its quantized weights), the workload's ids stay below its vocabulary (read from
    the GGUF's metadata), and a server that streams no usage is counted a token per
    chunk."""
    from gguf_files import write_tiny_gguf
    from test_gguf import tiny_hf

    gguf = write_tiny_gguf(tiny_hf(tmp_path / "hf", "llama", vocab=300), tmp_path / "t.gguf",
                           "llama", {"mlp.": "Q8_0"})
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    config_path = tmp_path / "cmp.yaml"
    config_path.write_text(yaml.safe_dump({
        "model": str(gguf),
        "workload": {"name": "synthetic", "num_requests": 4, "prompt_len": [4, 20],
                     "output_len": [3, 8], "num_long": 0, "seed": 1},
        "load": {"rates": [None]}, "repeats": 1,
        "systems": [{"name": "stub", "kind": "server", "command":
                     f"{sys.executable} {stub} --port {{port}} --model {{model}} --no-usage"}]}))
    result = compare(load_config(config_path))
    assert result["model"] == str(gguf)
    assert result["workload"]["vocab_size"] == 300
    point = result["runs"]["stub"][0][0]
    assert point["num_failed"] == 0
    workload = make_workload(load_config(config_path)["workload"], str(gguf))
    assert sum(r["output_tokens"] for r in point["requests"]) == sum(
        r.max_tokens for r in workload.requests)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.parametrize("kind", ["offline", "server"])
def test_stopping_the_benchmark_stops_the_system_it_started(tmp_path, kind):
    """A `treadle bench compare` ended by SIGTERM (a job runner's stop, `kill PID`) ends the
    system it was running: peers and offline runners run in sessions of their own, so
    without it they kept running after the benchmark was gone."""
    (tmp_path / "config.json").write_text('{"vocab_size": 512}')
    pid_file = tmp_path / "child.pid"
    # a grandchild in the system's process group, as a shell command's server would be
    command = f"sleep 600 & echo $! > {pid_file}; wait"
    config_path = tmp_path / "cmp.yaml"
    config_path.write_text(yaml.safe_dump({
        "model": str(tmp_path), "workload": {"name": "synthetic", "num_requests": 2, "num_long": 0},
        "systems": [{"name": "slow", "kind": kind, "command": command,
                     "startup_timeout_s": 600}]}))
    bench = subprocess.Popen([sys.executable, "-m", "treadle.cli", "bench", "compare",
                              str(config_path), "--output", str(tmp_path / "out")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert bench.poll() is None, bench.stderr.read().decode()
            assert time.monotonic() < deadline, "the system never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert not _gone(child)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, f"the system's process {child} outlived the benchmark"
            time.sleep(0.05)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if pid_file.exists() and pid_file.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
