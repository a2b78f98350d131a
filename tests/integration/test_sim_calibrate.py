"""`treadle simulate calibrate` on a tiny demo model, in process and through a server
(`--served`): the sweep's batches thin out one request at a time, so its trace holds
decode steps of every row count up to the largest batch (served, where a batch's requests
arrive up to a step apart, all but at most one), prefill chunks within the step budget,
and a fit on it runs; bad sweep ranges are refused with the field named."""

from __future__ import annotations

import pytest

from treadle.cli import main as cli_main
from treadle.engine.trace import read_trace
from treadle.models.demo import write_demo_model
from treadle.sim.calibrate import calibration_batches
from treadle.sim.fit import fit_trace


def _tiny_model(path):
    return write_demo_model(path, seed=3, config_overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2))


@pytest.mark.parametrize("served", [False, True], ids=["in-process", "served"])
def test_calibration_covers_every_row_count_up_to_its_largest_batch(tmp_path, capsys, served):
    model = _tiny_model(tmp_path / "m")
    trace_path = tmp_path / "cal.jsonl"
    rc = cli_main(["simulate", "calibrate", "--trace", str(trace_path), "--model", str(model),
                   "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB",
                   "--max-num-seqs", "6", "--max-num-batched-tokens", "64",
                   "--rows", "1,3,6,9", "--prompt-len", "4", "90", "--max-tokens", "2", "12",
                   *(["--served"] if served else [])])
    assert rc == 0
    assert '"num_requests": 10' in capsys.readouterr().out  # 9 is above max_num_seqs
    trace = read_trace(trace_path)
    assert len(trace.arrivals) == 10
    assert sum(len(s.finished) for s in trace.steps) == 10
    decode_rows = {s.features["decode_rows"] for s in trace.steps
                   if s.features["prefill_rows"] == 0}
    assert 6 in decode_rows  # the largest batch decodes all at once
    # In process the batch thins out one request at a time. Served, its requests reach
    # the engine up to a step apart, so two of them may end in one step: one row count
    # may be skipped.
    assert len(set(range(1, 7)) - decode_rows) <= (1 if served else 0), decode_rows
    # The budget, and the 64 // 8 tokens a prompt may pass it by to finish.
    assert max(s.features["prefill_tokens"] + s.features["decode_tokens"]
               for s in trace.steps) <= 72
    assert any(s.features["prefill_rows"] and s.features["decode_rows"] for s in trace.steps)
    model_fit = fit_trace(trace, str(trace_path))
    assert model_fit.fit_report["num_steps"] == len(trace.steps)
    assert model_fit.step_seconds(trace.steps[-1].features) > 0


def test_calibration_batches_fit_the_context_and_refuse_bad_ranges():
    batches = calibration_batches((2, 5), (10, 60), (3, 20), vocab_size=100,
                                  max_model_len=128, step_budget=32, seed=1)
    assert [len(b) for b in batches] == [2, 5]
    for batch in batches:
        prefill_steps = -(-sum(len(ids) for ids, _ in batch) // 32)
        for ids, n in batch:
            assert len(ids) + n <= 128 and all(3 <= t < 100 for t in ids)
            assert prefill_steps + 3 <= n <= prefill_steps + 20 or len(ids) + n == 128
    assert batches == calibration_batches((2, 5), (10, 60), (3, 20), 100, 128, 32, seed=1)
    staggered = calibration_batches((2, 5), (10, 60), (3, 20), 100, 128, 32, seed=1,
                                    staggered=True)
    for batch, later in zip(batches, staggered):  # a step more per request of the batch
        assert [ids for ids, _ in later] == [ids for ids, _ in batch]
        assert [n for _, n in later] == [n + len(batch) for _, n in batch]
    (long_batch,) = calibration_batches((4,), (100, 120), (3, 5), 100, 128, 512)
    assert all(len(ids) + n <= 128 and len(ids) >= 1 for ids, n in long_batch)
    with pytest.raises(ValueError, match="prompt_len"):
        calibration_batches((1,), (0, 5), (1, 2), 100, 128, 64)
    with pytest.raises(ValueError, match="max_tokens"):
        calibration_batches((1,), (1, 5), (3, 2), 100, 128, 64)
    with pytest.raises(ValueError, match="max_model_len 128"):
        calibration_batches((1,), (1, 5), (1, 128), 100, 128, 64)
    with pytest.raises(ValueError, match="step_budget"):
        calibration_batches((1,), (1, 5), (1, 2), 100, 128, 0)
