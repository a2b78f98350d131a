"""Speculation's Prometheus metrics under vLLM's names with the treadle: prefix, fed from
the engine's cumulative stats."""

from __future__ import annotations

from treadle.metrics import EngineMetrics


def stats(drafts, tokens, accepted, per_pos):
    return {"kv_usage": 0.1, "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
            "num_preemptions": 0, "num_preemptions_swap": 0, "swap_bytes_out": 0,
            "swap_bytes_in": 0, "spec_num_drafts": drafts, "spec_num_draft_tokens": tokens,
            "spec_num_accepted_tokens": accepted, "spec_accepted_per_position": per_pos}


def value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed:\n{text}")


def test_counters_follow_the_engine_stats():
    m = EngineMetrics("tiny")
    m.record_step(stats(2, 8, 5, [2, 2, 1]), 1, 0, 0, 1, 8)
    m.record_step(stats(3, 11, 7, [3, 2, 1, 1]), 1, 0, 0, 1, 8)
    text = m.exposition().decode()
    assert value(text, "treadle:spec_decode_num_drafts_total") == 3
    assert value(text, "treadle:spec_decode_num_draft_tokens_total") == 11
    assert value(text, "treadle:spec_decode_num_accepted_tokens_total") == 7
    per_pos = {line.split('position="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines()
               if line.startswith("treadle:spec_decode_num_accepted_tokens_per_pos_total")}
    assert per_pos == {"0": 3, "1": 2, "2": 1, "3": 1}


def test_engines_without_speculation_expose_no_spec_counts():
    m = EngineMetrics("tiny")
    plain = {k: v for k, v in stats(0, 0, 0, []).items() if not k.startswith("spec")}
    m.record_step(plain, 0, 0, 0, 0, 8)
    assert "spec_decode_num_accepted_tokens_per_pos_total{" not in m.exposition().decode()
