"""bench/step_floor.py: each traced step's roofline floor, and step_split's floor columns."""

from __future__ import annotations

import json

import pytest

from treadle.measure import benchmark_shapes as shapes
from treadle.bench.step_floor import (benchmark_model_costs, sampling_prefill_rows,
                                      step_rooflines, step_work)
from treadle.bench.step_split import main
from treadle.engine.trace import read_trace

ENGINE = {"num_parameters": 134_515_008, "vocab_size": 49152, "dtype": "bfloat16",
          "kv_bytes_per_token": 23040}
PEAK, READ = 400e9, 40e9


def _features(prefill=0, prefill_rows=0, decode_rows=0, decode_tokens=None, decode_ctx=0,
              prefill_ctx=0, pairs=0):
    return {"prefill_tokens": prefill, "prefill_rows": prefill_rows, "decode_rows": decode_rows,
            "decode_tokens": decode_rows if decode_tokens is None else decode_tokens,
            "decode_context_tokens": decode_ctx, "prefill_context_tokens": prefill_ctx,
            "prefill_attention_pairs": pairs, "swap_out_bytes": 0, "swap_in_bytes": 0}


def _write(tmp_path, steps, engine=ENGINE):
    path = tmp_path / "t.jsonl"
    lines = [{"type": "header", "version": 2, "policy": "fcfs", "engine": engine}]
    for i, (t0, t1, scheduled, finished, features) in enumerate(steps):
        lines.append({"type": "step", "step": i, "t_start": t0, "t_end": t1,
                      "scheduled": scheduled, "finished": finished, "features": features})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_costs_are_the_benchmark_models():
    costs = benchmark_model_costs(ENGINE)
    # 2 x the linears' weights a token, the head included: SmolLM2-135M's 0.269 GFLOP.
    assert costs.body_flops_per_token + costs.head_flops_per_row == 2 * 134_479_872
    assert costs.head_flops_per_row == 2 * 576 * 49152
    assert costs.attention_flops_per_pair == 4 * 9 * 64 * 30
    assert costs.weight_bytes == 2 * shapes.NUM_PARAMETERS
    assert benchmark_model_costs(ENGINE | {"dtype": "float32"}).weight_bytes == \
        4 * shapes.NUM_PARAMETERS


@pytest.mark.parametrize("change, match", [
    ({"num_parameters": 1_000_000}, "num_parameters=1000000"),
    ({"vocab_size": 32000}, "vocab_size=32000"),
    ({"dtype": "int8"}, "dtype 'int8'"),
    ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
])
def test_other_models_and_dtypes_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        benchmark_model_costs(ENGINE | change)


def test_a_prefill_chunk_samples_only_when_it_ends_the_prompt(tmp_path):
    path = _write(tmp_path, [
        # a: two chunks then a decode; b: a one-token request ending in its prefill;
        # c: a chunk, then preempted and recomputed (prefill again), then a decode.
        (0.0, 0.1, [["a", 64, "prefill"], ["b", 10, "prefill"], ["c", 8, "prefill"]],
         [["b", "length"]], _features(prefill=82, prefill_rows=3)),
        (0.1, 0.2, [["a", 36, "prefill"]], [], _features(prefill=36, prefill_rows=1)),
        (0.2, 0.3, [["a", 1, "decode"], ["c", 8, "prefill"]], [],
         _features(prefill=8, prefill_rows=1, decode_rows=1)),
        (0.3, 0.4, [["a", 1, "decode"], ["c", 1, "decode"]], [["a", "length"]],
         _features(decode_rows=2)),
    ])
    assert sampling_prefill_rows(read_trace(path)) == [1, 1, 1, 0]


def test_memory_and_compute_bound_steps(tmp_path):
    costs = benchmark_model_costs(ENGINE)
    decode = _features(decode_rows=4, decode_ctx=4000)
    path = _write(tmp_path, [
        (0.0, 1.0, [["a", 1000, "prefill"]], [], _features(prefill=1000, prefill_rows=1,
                                                              prefill_ctx=1000, pairs=500500)),
        (1.0, 1.1, [["a", 1, "decode"]] * 4, [], decode),
    ])
    rooflines = step_rooflines(read_trace(path), PEAK / 1e9, READ / 1e9)
    floors = [r.floor_seconds for r in rooflines]
    # 1,000 prompt tokens, one sampled row: the linears' arithmetic beats the weights' read.
    linears = costs.body_flops_per_token * 1000 + costs.head_flops_per_row
    attention = costs.attention_flops_per_pair * 500500
    assert linears / PEAK > costs.weight_bytes / READ
    assert floors[0] == pytest.approx(linears / PEAK + max(attention / PEAK,
                                                           1000 * 23040 / READ))
    # Four decode rows: the weights' read and the K/V read bound it.
    work = step_work(read_trace(path).steps[1], 0, costs)
    assert work.linear_flops / PEAK < costs.weight_bytes / READ
    assert floors[1] == pytest.approx(costs.weight_bytes / READ + 4000 * 23040 / READ)
    assert rooflines[1].flops == pytest.approx(work.linear_flops + work.attention_flops)
    assert rooflines[1].bytes == pytest.approx(costs.weight_bytes + 4000 * 23040)
    # Without the rates: the same arithmetic and bytes, no floor.
    bare = step_rooflines(read_trace(path))
    assert [r.floor_seconds for r in bare] == [None, None]
    assert bare[0].flops == pytest.approx(linears + attention)
    with pytest.raises(ValueError, match="must be > 0"):
        step_rooflines(read_trace(path), 0, 40)


def test_step_split_prints_the_floor_columns(tmp_path, capsys):
    path = _write(tmp_path, [
        (0.0, 0.02, [["a", 1, "decode"]] * 4, [], _features(decode_rows=4, decode_ctx=4000)),
    ])
    main([str(path), "--peak-gflops", "400", "--read-gbs", "40", "--json"])
    bins = json.loads(capsys.readouterr().out)["bins"]
    read = 2 * shapes.NUM_PARAMETERS + 4000 * 23040
    assert bins["decode 1-4"]["floor_seconds"] == pytest.approx(read / READ)
    assert bins["decode 1-4"]["x_floor"] == pytest.approx(0.02 / (read / READ))
    assert bins["decode 1-4"]["gb_per_s"] == pytest.approx(read / 0.02 / 1e9)
    main([str(path), "--peak-gflops", "400", "--read-gbs", "40"])
    assert "| GFLOP/s | GB/s | floor s | x floor |" in capsys.readouterr().out
    main([str(path), "--roofline"])
    table = capsys.readouterr().out
    assert "| GFLOP/s | GB/s |" in table and "floor" not in table
    assert f"| {read / 0.02 / 1e9:.1f} |" in table
    with pytest.raises(SystemExit):
        main([str(path), "--peak-gflops", "400"])
    assert "go together" in capsys.readouterr().err
    other = _write(tmp_path, [(0.0, 0.1, [["a", 1, "decode"]], [], _features(decode_rows=1))],
                   engine=ENGINE | {"num_parameters": 7})
    with pytest.raises(SystemExit):
        main([str(other), "--peak-gflops", "400", "--read-gbs", "40"])
    assert "benchmark model" in capsys.readouterr().err
