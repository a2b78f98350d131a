"""Trace version 2: each step records the features a step-time model is fitted on, computed
from the SchedulerOutput alone, and the header the engine facts; version-1 files still read."""

from __future__ import annotations

import json

from treadle.core.outputs import ScheduledRequest, SchedulerOutput
from treadle.engine.trace import (FEATURE_NAMES, TRACE_VERSION, TraceRecorder, read_trace,
                                  step_features)


def _output() -> SchedulerOutput:
    return SchedulerOutput(scheduled=[
        ScheduledRequest("d1", num_computed_tokens=40, num_scheduled_tokens=1, sample=True,
                         is_decoding=True),
        ScheduledRequest("d2", num_computed_tokens=9, num_scheduled_tokens=3, sample=True,
                         is_decoding=True, spec_token_ids=[5, 5]),
        ScheduledRequest("p1", num_computed_tokens=0, num_scheduled_tokens=4),
        ScheduledRequest("p2", num_computed_tokens=16, num_scheduled_tokens=2, sample=True),
    ], swap_out=[(1, 0), (2, 1)], swap_in=[(3, 7)])


def test_step_features_by_hand():
    f = step_features(_output(), swap_block_bytes=100)
    assert f == {
        "prefill_tokens": 6, "prefill_rows": 2, "decode_rows": 2, "decode_tokens": 4,
        "decode_context_tokens": 41 + 12,
        "prefill_context_tokens": 4 + 18,
        # p1: 4 queries over 1..4 keys = 10; p2: 2 queries at 16 context + (1 + 2) = 35
        "prefill_attention_pairs": 10 + 35,
        "swap_out_bytes": 200, "swap_in_bytes": 100}
    assert tuple(f) == FEATURE_NAMES


def test_recorder_writes_version_2_and_reader_keeps_it(tmp_path):
    path = tmp_path / "t.jsonl"
    ticks = iter(range(100))
    rec = TraceRecorder(path, "fcfs", clock=lambda: float(next(ticks)),
                        engine={"block_size": 4, "kv_bytes_per_token": 25, "num_kv_blocks": 9})
    rec.record_step(0, 1.0, 2.5, _output(), [])
    rec.close()
    header = json.loads(path.read_text().splitlines()[0])
    assert header["version"] == TRACE_VERSION == 2
    trace = read_trace(path)
    assert trace.version == 2 and trace.engine["num_kv_blocks"] == 9
    # swap bytes priced by the header's block size x KV bytes per token
    assert trace.steps[0].features == step_features(_output(), swap_block_bytes=100)


def test_version_1_still_reads(tmp_path):
    path = tmp_path / "v1.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"type": "header", "version": 1, "policy": "fcfs"},
        {"type": "arrival", "request_id": "a", "t": 0.0, "num_prompt_tokens": 5, "max_tokens": 2},
        {"type": "step", "step": 0, "t_start": 0.1, "t_end": 0.2,
         "scheduled": [["a", 5, "prefill"]], "preempted": [], "finished": []},
    ]) + "\n")
    trace = read_trace(path)
    assert trace.version == 1 and trace.engine == {} and trace.steps[0].features is None
    assert trace.tokens_by_request() == {"a": 5}
