"""`treadle bench latency` (issue 51, item 1): treadle offline at one stream and served
above, llama.cpp side by side on the same GGUF file.

The grid runs on a tiny GGUF file the test writes, against a stand-in llama.cpp build
folder (a `llama-bench` that prints llama-bench's JSON and a `llama-server` that streams
like it), so that the peer's whole path runs on every machine; the real llama.cpp runs
only when a build is given (TREADLE_LLAMACPP_DIR)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_tiny_checkpoint, use_fresh_cache_dir
from gguf_files import write_tiny_gguf
from treadle.bench.latency import run_latency

LLAMA_BENCH = textwrap.dedent('''
    import argparse, json, os
    p = argparse.ArgumentParser()
    for flag in ("-m", "-t", "-r", "-o", "-p", "-n", "-d"):
        p.add_argument(flag)
    a = p.parse_args()
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps({"program": "llama-bench", "args": vars(a)}) + "\\n")
    n_prompt, n_gen = int(a.p), int(a.n)
    print("some banner line")
    print(json.dumps([{"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": int(a.d or 0),
                       "avg_ts": 1000.0 if n_gen == 0 else 50.0}]))
''')

LLAMA_SERVER = textwrap.dedent('''
    import argparse, asyncio, json, os
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    p = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "-np", "-c", "-t"):
        p.add_argument(flag)
    p.add_argument("--no-webui", action="store_true")
    a = p.parse_args()
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps({"program": "llama-server", "args": vars(a)}) + "\\n")
    app = FastAPI()
    @app.get("/health")
    async def health():
        return {"status": "ok"}
    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "stub"}]}
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        with open(os.environ["STUB_LOG"], "a") as log:
            log.write(json.dumps({"program": "request", "prompt": len(body["prompt"])}) + "\\n")
        async def events():
            await asyncio.sleep(0.02)
            if os.environ.get("STUB_FAIL_TOKENS") == str(body["max_tokens"]):
                raise RuntimeError("the stand-in dies mid-stream")
            for _ in range(body["max_tokens"]):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\\n\\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    uvicorn.run(app, host=a.host, port=int(a.port), log_level="error")
''')


def _stub_llamacpp(folder: Path) -> Path:
    """A build folder whose build/bin holds the two stand-in programs."""
    bin_dir = folder / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("llama-bench", LLAMA_BENCH), ("llama-server", LLAMA_SERVER)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("latency")
    hf_dir = make_tiny_checkpoint(root / "hf", "llama", vocab_size=512, rope_scaling=None)
    (root / "gguf").mkdir()
    return write_tiny_gguf(hf_dir, root / "gguf" / "tiny.gguf", "llama", {"self_attn": "Q8_0"})


def test_grid_side_by_side_on_one_file(tiny_gguf, tmp_path, monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    log = tmp_path / "stub.log"
    monkeypatch.setenv("STUB_LOG", str(log))
    peer = _stub_llamacpp(tmp_path / "llama.cpp")
    result = run_latency(str(tiny_gguf), concurrency=(2, 1), prompt_len=8, output_len=3,
                         repeats=2, engine_options={"dtype": "float32", "num_kv_blocks": 64},
                         llamacpp_dir=str(peer), peer_threads=1, log_dir=str(tmp_path))
    points = result["points"]
    # Every (system, concurrency, repeat) once; the systems' order flips each repeat.
    assert sorted((p["system"], p["concurrency"], p["repeat"]) for p in points) == sorted(
        (s, c, r) for s in ("treadle", "llama.cpp") for c in (1, 2) for r in (0, 1))
    single = [p["system"] for p in points if p["concurrency"] == 1]
    assert single == ["treadle", "llama.cpp", "llama.cpp", "treadle"]
    for p in points:
        assert p["mode"] == ("offline" if p["concurrency"] == 1 else "served")
        assert p["prefill_tok_s"] > 0 and p["decode_tok_s"] > 0 and p["tpot_ms"] > 0
        if p["system"] == "treadle":
            assert p["output_tokens"] == 3 * p["concurrency"]
    # llama-bench's own figures, as it printed them
    llama_single = [p for p in points if p["system"] == "llama.cpp" and p["concurrency"] == 1]
    assert all(p["prefill_tok_s"] == 1000.0 and p["decode_tok_s"] == 50.0 for p in llama_single)
    assert all(p["ttft_ms"] == pytest.approx(8.0) and p["tpot_ms"] == pytest.approx(20.0)
               for p in llama_single)
    rows = {(r["concurrency"], r["system"]): r for r in result["table"]}
    treadle_1 = rows[(1, "treadle")]
    assert rows[(1, "llama.cpp")]["treadle_x_decode_tok_s"] == pytest.approx(
        treadle_1["decode_tok_s"] / 50.0, rel=0.5)
    assert rows[(2, "llama.cpp")]["output_tok_s"] > 0 and rows[(2, "treadle")]["output_tok_s"] > 0

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    bench_args = [c["args"] for c in calls if c["program"] == "llama-bench"]
    assert len(bench_args) == 4  # two runs per repeat: pp at depth 0, tg after the prompt
    assert {(a["p"], a["n"], a["d"]) for a in bench_args} == {("8", "0", None), ("0", "3", "8")}
    assert all(a["m"] == str(tiny_gguf) and a["t"] == "1" and a["o"] == "json"
               for a in bench_args)
    server = [c["args"] for c in calls if c["program"] == "llama-server"]
    assert len(server) == 1 and server[0]["np"] == "2" and server[0]["c"] == str(2 * (8 + 3 + 16))
    requests = [c["prompt"] for c in calls if c["program"] == "request"]
    assert requests == [8] * (2 + 2 * 2)  # the warm-up's two, then two per repeat
    assert result["cpu"]["model"] and result["treadle_kernels"]


@pytest.mark.skipif(not os.environ.get("TREADLE_LLAMACPP_DIR"),
                    reason="no llama.cpp given: set TREADLE_LLAMACPP_DIR to a llama.cpp build "
                           "folder (build/bin/llama-bench, llama-server) to run the real peer; "
                           "test_grid_side_by_side_on_one_file runs its path on stand-ins")
def test_real_llamacpp_on_the_same_file(tiny_gguf, tmp_path, monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    result = run_latency(str(tiny_gguf), concurrency=(1, 2), prompt_len=8, output_len=3,
                         repeats=1, engine_options={"dtype": "float32", "num_kv_blocks": 64},
                         llamacpp_dir=os.environ["TREADLE_LLAMACPP_DIR"], peer_threads=1,
                         log_dir=str(tmp_path))
    peer = [p for p in result["points"] if p["system"] == "llama.cpp"]
    assert len(peer) == 2 and all(p["decode_tok_s"] > 0 and p["prefill_tok_s"] > 0
                                  for p in peer)


def test_a_server_that_fails_keeps_what_was_measured(tiny_gguf, tmp_path, monkeypatch):
    """A served point whose requests fail (here the peer's stand-in breaks every stream of
    the measured length; a Gemma 3 engine that segfaulted did the same) is recorded with
    the error, that system gets no more points, the other system's points and the
    table stay, and the command exits 1 naming the failure."""
    import argparse

    from treadle.cli import bench_latency

    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "stub.log"))
    monkeypatch.setenv("STUB_FAIL_TOKENS", "3")  # not the warm-up's 4
    peer = _stub_llamacpp(tmp_path / "llama.cpp")
    result = run_latency(str(tiny_gguf), concurrency=(2,), prompt_len=8, output_len=3,
                         repeats=2, engine_options={"dtype": "float32", "num_kv_blocks": 64},
                         llamacpp_dir=str(peer), peer_threads=1, log_dir=str(tmp_path))
    points = result["points"]
    failed = [p for p in points if "error" in p]
    assert [(p["system"], p["repeat"]) for p in failed] == [("llama.cpp", 0)]
    assert "2 of 2 requests failed" in failed[0]["error"]
    ours = [p for p in points if p["system"] == "treadle"]
    assert len(ours) == 2 and all(p["output_tok_s"] > 0 for p in ours)
    assert len(points) == 3  # the failed system is not sent the second repeat
    rows = {r["system"]: r for r in result["table"]}
    assert rows["llama.cpp"]["failed"] == 1 and rows["llama.cpp"]["output_tok_s"] is None
    assert rows["treadle"]["failed"] == 0 and rows["treadle"]["output_tok_s"] > 0

    monkeypatch.setattr("treadle.bench.latency.run_latency", lambda *a, **k: result)
    args = argparse.Namespace(peer=None, llamacpp_dir=None, concurrency="2", prompt_len=8,
                              output_len=3, repeats=2, peer_threads=None, background_load=0,
                              prompt_seed=0, output=str(tmp_path / "out.json"))
    monkeypatch.setattr(bench_latency, "options_from_args", lambda a: {})
    assert bench_latency._cmd_bench_latency(args) == 1
    assert any("error" in p for p in json.loads((tmp_path / "out.json").read_text())["points"])
