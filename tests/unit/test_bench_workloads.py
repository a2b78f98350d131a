"""Benchmark workloads are deterministic, honour their parameters, and replay the real trace."""

import json
import math
from pathlib import Path

import pytest

from treadle.measure import report, workloads
from treadle.measure.workloads import azure_conv, cap_lengths, multi_turn, shared_prefix, synthetic

TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / workloads.AZURE_CONV_FILE


def test_synthetic_is_deterministic_per_seed():
    a, b, c = synthetic(seed=0), synthetic(seed=0), synthetic(seed=1)
    assert a.requests == b.requests and a.description == b.description
    assert a.requests != c.requests


def test_synthetic_lengths_ids_and_long_requests():
    w = synthetic(num_requests=50, prompt_len=(5, 9), output_len=(2, 4), num_long=3,
                  long_output_len=100, vocab_size=20, seed=3)
    assert len(w.requests) == 50
    for r in w.requests:
        assert 5 <= len(r.prompt_token_ids) <= 9
        assert r.max_tokens in (2, 3, 4, 100)
        assert all(3 <= t < 20 for t in r.prompt_token_ids)
        assert r.arrival_time == 0.0
    long_idx = [i for i, r in enumerate(w.requests) if r.max_tokens == 100]
    assert long_idx == w.description["long_request_indices"] and len(long_idx) == 3
    assert w.total_output_tokens == sum(r.max_tokens for r in w.requests)
    assert w.total_prompt_tokens == sum(len(r.prompt_token_ids) for r in w.requests)
    # both ends of the inclusive ranges are reached on a large enough draw
    big = synthetic(num_requests=400, prompt_len=(5, 9), output_len=(2, 4), num_long=0)
    assert {len(r.prompt_token_ids) for r in big.requests} == set(range(5, 10))
    assert {r.max_tokens for r in big.requests} == {2, 3, 4}


def test_synthetic_max_model_len_caps():
    w = synthetic(num_requests=30, prompt_len=(50, 60), output_len=(10, 20), num_long=2,
                  long_output_len=500, max_model_len=64)
    for r in w.requests:
        assert len(r.prompt_token_ids) + r.max_tokens <= 64
        assert len(r.prompt_token_ids) >= 1 and r.max_tokens >= 1
    assert w.description["num_capped"] > 0


def test_synthetic_poisson_arrivals():
    w = synthetic(num_requests=20, request_rate=4.0, seed=2)
    times = [r.arrival_time for r in w.requests]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0


def test_cap_lengths_truncates_prompt_first():
    assert cap_lengths(100, 10, None) == (100, 10)
    assert cap_lengths(100, 10, 50) == (40, 10)
    assert cap_lengths(100, 80, 50) == (1, 49)
    assert cap_lengths(3, 4, 50) == (3, 4)
    with pytest.raises(ValueError):
        cap_lengths(1, 1, 1)


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="prompt_len"):
        synthetic(prompt_len=(10, 5))
    with pytest.raises(ValueError, match="num_long"):
        synthetic(num_requests=2, num_long=3)


def test_azure_conv_reads_real_rows():
    w = azure_conv(TRACE, num_requests=5, max_model_len=4096)
    lens = [(len(r.prompt_token_ids), r.max_tokens) for r in w.requests]
    assert lens[:4] == [(374, 44), (396, 109), (879, 55), (91, 16)]
    times = [r.arrival_time for r in w.requests]
    assert times[0] == 0.0
    assert times[1] == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert times == sorted(times)
    assert w.description["token_scale"] == 1.0 and w.description["time_scale"] == 1.0


def test_azure_conv_scaling_and_cap():
    w = azure_conv(TRACE, num_requests=4, token_scale=0.5, time_scale=2.0, max_model_len=4096)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in w.requests] == [
        (187, 22), (198, round(54.5)), (round(439.5), round(27.5)), (round(45.5), 8)]
    assert w.requests[1].arrival_time == pytest.approx((50.9951690 - 46.6805900) / 2, abs=1e-6)
    capped = azure_conv(TRACE, num_requests=200, max_model_len=256)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 256 for r in capped.requests)
    assert all(r.max_tokens >= 1 for r in capped.requests)
    assert capped.description["num_capped"] > 0
    assert azure_conv(TRACE, num_requests=10).requests == azure_conv(TRACE, num_requests=10).requests


def test_azure_conv_default_path_and_env(monkeypatch):
    monkeypatch.delenv(workloads.TRACES_DIR_ENV, raising=False)
    assert workloads.default_traces_dir() / workloads.AZURE_CONV_FILE == TRACE  # shipped
    assert len(azure_conv(num_requests=3).requests) == 3
    assert "CC-BY 4.0" in (TRACE.parent / "README.md").read_text()
    monkeypatch.setenv(workloads.TRACES_DIR_ENV, str(TRACE.parent))
    assert len(azure_conv(num_requests=3).requests) == 3
    monkeypatch.setenv(workloads.TRACES_DIR_ENV, "/nonexistent-dir")
    with pytest.raises(FileNotFoundError, match="TREADLE_TRACES_DIR"):
        azure_conv(num_requests=3)


def test_shared_prefix_requests_share_prefixes():
    w = shared_prefix(num_requests=20, num_prefixes=3, prefix_len=16, suffix_len=(2, 5),
                      output_len=7, vocab_size=100, seed=1)
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in w.requests}
    assert len(prefixes) <= 3
    for r in w.requests:
        assert 18 <= len(r.prompt_token_ids) <= 21 and r.max_tokens == 7
    assert w.requests == shared_prefix(num_requests=20, num_prefixes=3, prefix_len=16,
                                       suffix_len=(2, 5), output_len=7, vocab_size=100, seed=1).requests


def test_percentiles_exact():
    p = report.percentiles(list(range(1, 11)))
    assert p["mean"] == 5.5 and p["median"] == 5.5
    assert p["p90"] == pytest.approx(9.1) and p["p99"] == pytest.approx(9.91)
    assert all(math.isnan(v) for v in report.percentiles([]).values())


def test_write_json_and_table(tmp_path):
    import numpy as np
    path = report.write_json(tmp_path / "a" / "b.json",
                             {"x": np.float32(1.5), "y": np.arange(3), "z": math.nan})
    assert json.loads(path.read_text()) == {"x": 1.5, "y": [0, 1, 2], "z": None}
    table = report.format_table([{"name": "a", "v": 1.5}, {"name": "bbb", "v": 10}], ["name", "v"])
    lines = table.splitlines()
    assert lines[0].split() == ["name", "v"] and len(lines) == 4
    assert len({len(line) for line in lines[1:]}) == 1


def test_multi_turn_prompts_extend_their_conversations_previous_turn():
    """Each turn re-sends its conversation's history: its prompt starts with the previous
    turn's prompt (then that turn's stand-in reply, then a new user message); turns are
    ordered turn by turn across conversations; conversations share nothing."""
    w = multi_turn(num_conversations=3, turns=4, system_len=16, user_len=(4, 8),
                   reply_len=5, vocab_size=1000, seed=1)
    conv = w.description["conversation_of_request"]
    assert len(w.requests) == 12 and conv == [0, 1, 2] * 4
    for c in range(3):
        turns = [r for r, k in zip(w.requests, conv) if k == c]
        for earlier, later in zip(turns, turns[1:]):
            grown = len(later.prompt_token_ids) - len(earlier.prompt_token_ids)
            assert later.prompt_token_ids[:len(earlier.prompt_token_ids)] == \
                earlier.prompt_token_ids
            assert 5 + 4 <= grown <= 5 + 8
        assert all(r.max_tokens == 5 for r in turns)
    firsts = [w.requests[c].prompt_token_ids[:16] for c in range(3)]
    assert firsts[0] != firsts[1] != firsts[2]
    assert multi_turn(num_conversations=3, turns=4, system_len=16, user_len=(4, 8),
                      reply_len=5, vocab_size=1000, seed=1).requests == w.requests
