"""`python -m treadle.bench.paired`: engine options side by side, stepping in turn, on the
engine-core workload; each system generates every request's own max_tokens (EOS
ignored), its ratio to the first system is paired by repeat, and bad --system values get
a clear error."""

from __future__ import annotations

import json

import pytest

from treadle.bench import paired
from treadle.bench.lockstep import run_closed_loop
from treadle.measure import workloads
from treadle.models.demo import write_demo_model


def test_parse_system():
    assert paired.parse_system("q:quantization=int8,max_num_seqs=8,kv_cache_memory=64MiB") == (
        "q", {"quantization": "int8", "max_num_seqs": 8, "kv_cache_memory": "64MiB"})
    assert paired.parse_system("plain") == ("plain", {})
    with pytest.raises(ValueError, match="NAME"):
        paired.parse_system(":dtype=float32")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        paired.parse_system("a:dtype")


def test_two_systems_in_turn_generate_every_token(tmp_path, capsys):
    # A 256-token context: the workload's lengths are capped to it (its four 1,024-token
    # outputs to 255), so each lockstep run takes 255 steps, not 1,024 (the whole test was
    # 30 s), and the run still has four long requests beside a short one.
    model = write_demo_model(tmp_path / "m", seed=3, config_overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256))
    out = tmp_path / "paired.json"
    assert paired.main(["--model", str(model), "--dtype", "float32", "--num-threads", "1",
                        "--system", "a:kv_cache_memory=64MiB",
                        "--system", "b:kv_cache_memory=64MiB,max_num_seqs=2",
                        "--num-requests", "5", "--repeats", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["num_long"] == 4  # four long outputs among the five
    assert result["workload"]["max_model_len"] == 256
    limits = [r.max_tokens for r in workloads.synthetic(
        num_requests=5, seed=0, num_long=4, max_model_len=256).requests]
    assert sorted(limits)[1:] == [255] * 4  # the long ones, capped to the context
    runs = result["runs"]
    assert len(runs) == 4 and {r["system"] for r in runs} == {"a", "b"}
    tokens = {r["output_tokens"] for r in runs}
    assert tokens == {sum(limits)}  # every request's own limit reached, EOS ignored
    assert all(r["ratio_to_first"] == 1.0 for r in runs if r["system"] == "a")
    (b,) = [row for row in result["summary"] if row["system"] == "b"]
    assert b["options"] == {"kv_cache_memory": "64MiB", "max_num_seqs": 2}
    assert len(b["ratios"]) == 2 and all(r > 0 for r in b["ratios"])
    assert b["ratio_geomean"] == pytest.approx((b["ratios"][0] * b["ratios"][1]) ** 0.5,
                                               rel=1e-3)
    # Loaded anew each repeat, in its order (b first in the second): against the bias of
    # the engine loaded last.
    assert {name: len(times) for name, times in result["load_s"].items()} == {"a": 2, "b": 2}
    assert "ratio_to_first" in capsys.readouterr().out
    assert paired.main(["--model", str(model), "--dtype", "float32", "--num-threads", "1",
                        "--system", "a:kv_cache_memory=64MiB",
                        "--system", "b:kv_cache_memory=64MiB", "--no-reload",
                        "--num-requests", "2", "--repeats", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {name: len(times) for name, times in result["load_s"].items()} == {"a": 1, "b": 1}
    assert len(result["runs"]) == 4
    with pytest.raises(ValueError, match="at least two"):
        paired.main(["--model", str(model), "--system", "a:dtype=float32"])
    with pytest.raises(ValueError, match="distinct names"):  # one would silently replace the other
        paired.main(["--model", str(model), "--system", "a:dtype=float32",
                     "--system", "a:dtype=bfloat16", "--system", "b:dtype=float32"])


def test_closed_loop_takes_a_limit_per_prompt(tmp_path):
    from treadle import LLM

    model = write_demo_model(tmp_path / "m", seed=3, config_overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    llm = LLM(model=str(model), dtype="float32", num_threads=1, kv_cache_memory="64MiB")
    result = run_closed_loop(llm, [[5, 6, 7], [8, 9], [10]], [3, 7, 2], 2, ignore_eos=True)
    assert result["output_tokens"] == 12
