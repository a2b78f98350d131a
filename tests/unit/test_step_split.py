"""bench/step_split.py: a trace's steps binned by kind, with their time and share."""

from __future__ import annotations

import json

import pytest

from treadle.bench.step_split import format_split, main, split, step_bin
from treadle.engine.trace import read_trace


def _step(i, t0, t1, scheduled, prefill, rows):
    return {"type": "step", "step": i, "t_start": t0, "t_end": t1, "scheduled": scheduled,
            "features": {"prefill_tokens": prefill, "prefill_rows": 1 if prefill else 0,
                         "decode_rows": rows, "decode_tokens": rows}}


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"type": "header", "version": 2, "policy": "fcfs", "engine": {}},
             _step(0, 0.0, 0.5, [["a", 100, "prefill"]], 100, 0),
             _step(1, 0.5, 0.6, [["a", 1, "decode"]], 0, 1),
             _step(2, 0.7, 0.8, [["a", 1, "decode"]] * 4, 0, 4),
             _step(3, 0.8, 1.0, [["a", 1, "decode"]] * 5, 0, 5),
             _step(4, 1.0, 1.4, [["a", 1, "decode"]] * 70, 0, 70)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_bins_edges_and_shares(trace_file):
    assert step_bin({"prefill_tokens": 3, "decode_rows": 9}, (4, 16)) == "prefill"
    assert step_bin({"prefill_tokens": 0, "decode_rows": 4}, (4, 16)) == "decode 1-4"
    assert step_bin({"prefill_tokens": 0, "decode_rows": 5}, (4, 16)) == "decode 5-16"
    assert step_bin({"prefill_tokens": 0, "decode_rows": 17}, (4, 16)) == "decode 17+"
    result = split(read_trace(trace_file))
    bins = result["bins"]
    assert list(bins) == ["prefill", "decode 1-4", "decode 5-16", "decode 65+"]
    assert bins["decode 1-4"]["steps"] == 2
    assert bins["decode 1-4"]["seconds"] == pytest.approx(0.2)
    assert bins["prefill"]["ms_per_step"] == pytest.approx(500.0)
    assert result["step_seconds"] == pytest.approx(1.3)
    assert result["between_steps_seconds"] == pytest.approx(0.1)  # 0.6 -> 0.7
    assert sum(b["share"] for b in bins.values()) == pytest.approx(1.0)
    assert "| decode 65+ | 1 | 0.40 | 31% | 400.0 |" in format_split(result)


def test_command_line_edges_and_json(trace_file, capsys):
    main([str(trace_file), "--edges", "1,8", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert list(result["bins"]) == ["prefill", "decode 1-1", "decode 2-8", "decode 9+"]
    with pytest.raises(ValueError, match="--edges"):
        main([str(trace_file), "--edges", "0,4"])
