"""`treadle bench latency`'s argument handling and the llama.cpp plumbing, without a model
or a peer: every machine runs these (the peer itself: tests/integration/test_bench_latency.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.bench import latency
from treadle.cli import build_parser
from treadle.cli.bench_latency import check_args


def _args(*argv: str):
    return build_parser().parse_args(["bench", "latency", *argv])


def test_defaults_are_the_issues_grid():
    args = _args()
    assert (args.prompt_len, args.output_len, args.concurrency) == (512, 128, "1,4,16,64")
    assert args.peer is None and args.background_load == 0 and args.repeats == 3


def test_the_peer_needs_its_build_folder_and_the_folder_needs_the_peer():
    with pytest.raises(ValueError, match="--peer llamacpp needs --llamacpp-dir"):
        check_args(_args("--peer", "llamacpp"))
    with pytest.raises(ValueError, match="only used with --peer llamacpp"):
        check_args(_args("--llamacpp-dir", "/x"))
    check_args(_args("--peer", "llamacpp", "--llamacpp-dir", "/x"))
    with pytest.raises(SystemExit):
        _args("--peer", "vllm")


@pytest.mark.parametrize("kwargs, message", [
    (dict(concurrency=(0, 4)), "--concurrency"),
    (dict(output_len=1), "--output-len"),
    (dict(repeats=0), "--repeats"),
    (dict(background=-1), "--background-load"),
])
def test_bad_arguments_are_named(kwargs, message):
    base = dict(model=None, concurrency=(1,), prompt_len=8, output_len=4, repeats=1,
                llamacpp_dir=None, background=0)
    with pytest.raises(ValueError, match=message):
        latency.check_arguments(**{**base, **kwargs})


def test_llamacpp_needs_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="needs a GGUF model"):
        latency.gguf_file("demo")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        latency.gguf_file(str(tmp_path / "missing.gguf"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert latency.gguf_file(str(model)) == model


def test_llamacpp_programs_are_found_in_a_build_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no executable llama-bench"):
        latency.llamacpp_binary(str(tmp_path), "llama-bench")
    program = tmp_path / "build" / "bin" / "llama-bench"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    with pytest.raises(FileNotFoundError):  # not executable
        latency.llamacpp_binary(str(tmp_path), "llama-bench")
    program.chmod(0o755)
    assert latency.llamacpp_binary(str(tmp_path), "llama-bench") == program


def test_llama_bench_runs_prefill_then_decode_after_the_prompt():
    pp, tg = latency.llama_bench_args(Path("/b/llama-bench"), "m.gguf", 512, 128, 2)
    assert pp[-4:] == ["-p", "512", "-n", "0"]
    assert tg[-6:] == ["-p", "0", "-n", "128", "-d", "512"]
    assert pp[:9] == ["/b/llama-bench", "-m", "m.gguf", "-t", "2", "-r", "1", "-o", "json"]
    text = "load_backend: x\n" + json.dumps([
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 900.5},
        {"n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ts": 61.25}])
    assert latency.parse_llama_bench(text) == {"pp": 900.5, "tg": 61.25}
    with pytest.raises(ValueError, match="printed no JSON"):
        latency.parse_llama_bench("error: failed to load model")


def test_llama_server_slots_hold_a_request_each():
    args = latency.llama_server_args(Path("/b/llama-server"), "m.gguf", 8080, 64, 656, 2)
    assert args[args.index("-np") + 1] == "64" and args[args.index("-c") + 1] == str(64 * 656)
    assert args[args.index("--host") + 1] == "127.0.0.1"


def test_engine_options_become_serve_flags():
    assert latency.serve_flags({"max_num_seqs": 64, "kernel_isa": "avx2",
                                "enable_prefix_caching": False, "dtype": "bfloat16"}) == [
        "--max-num-seqs", "64", "--kernel-isa", "avx2", "--no-enable-prefix-caching",
        "--dtype", "bfloat16"]
    parsed = build_parser().parse_args(["serve", *latency.serve_flags({"kernel_isa": "avx2"})])
    assert parsed.kernel_isa == "avx2"


def test_table_medians_and_ratios_paired_by_repeat():
    def point(system, repeat, decode):
        return {"system": system, "concurrency": 1, "mode": "offline", "repeat": repeat,
                "prefill_tok_s": 100.0, "decode_tok_s": decode, "ttft_ms": 1.0,
                "tpot_ms": 1000.0 / decode}
    points = [point("treadle", 0, 60.0), point("llama.cpp", 0, 30.0),
              point("llama.cpp", 1, 40.0), point("treadle", 1, 40.0),
              point("treadle", 2, 50.0), point("llama.cpp", 2, 50.0)]
    rows = latency.table(points)
    assert [r["system"] for r in rows] == ["treadle", "llama.cpp"]
    assert rows[0]["decode_tok_s"] == 50.0 and rows[1]["decode_tok_s"] == 40.0
    assert rows[1]["treadle_x_decode_tok_s"] == 1.0  # median of 2.0, 1.0, 1.0
    assert rows[1]["treadle_x_prefill_tok_s"] == 1.0 and "treadle_x_decode_tok_s" not in rows[0]
