"""`treadle bench compare`: systems run in turn on one workload; table ratios and plots."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

from conftest import make_tiny_checkpoint
from treadle.bench.compare import compare, load_config, main_table, plot, table

STUB = textwrap.dedent('''
    import argparse, asyncio, json
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
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
        async def events():
            await asyncio.sleep(0.03)
            for _ in range(body["max_tokens"]):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\\n\\n"
                await asyncio.sleep(0.005)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\\n\\n"
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="error")
''')


def test_table_ratios_against_first_system():
    point = lambda tps, p99: {"output_tokens_per_s": tps, "total_tokens_per_s": 2 * tps,
                              "num_failed": 0, "ttft_ms": {"median": p99 / 2, "p99": p99},
                              "tpot_ms": {"median": 1.0}}
    rows = table({"a": [[point(100, 50)], [point(120, 70)]], "b": [[point(300, 20)]]})
    assert rows[0]["output tok/s"] == 110 and rows[0]["TTFT p99 ms"] == 60
    assert rows[1]["x output tok/s"] == pytest.approx(300 / 110)
    assert rows[1]["x TTFT p99"] == pytest.approx(20 / 60)


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"systems": [{"kind": "magic"}]}))
    with pytest.raises(ValueError, match=r"systems\[0\].kind"):
        load_config(bad)
    bad.write_text(yaml.safe_dump({"systems": [{"kind": "server"}]}))
    with pytest.raises(ValueError, match="command"):
        load_config(bad)


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
