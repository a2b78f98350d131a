"""Step-time models: the fit recovers known coefficients from a synthetic trace (through
the trace file format), evaluation reports its errors, and the roofline is sane."""

from __future__ import annotations

import json
import random

import pytest

from treadle.engine.trace import FEATURE_NAMES, read_trace
from treadle.sim.fit import evaluate, fit_trace, nonnegative_lstsq
from treadle.sim.hardware import (Hardware, ModelShape, load_hardware, load_model_shape,
                                  model_shape_from_hf_config)
from treadle.sim.roofline import RooflineStepModel, kv_transfer_seconds, num_kv_blocks
from treadle.sim.simulate import make_step_model
from treadle.sim.step_model import LinearStepModel

TRUE = {"intercept": 0.004, "prefill_tokens": 3e-5, "prefill_rows": 2e-4,
        "decode_tokens": 1.5e-4, "decode_context_tokens": 2e-8,
        "prefill_attention_pairs": 4e-10, "swap": 1e-10}
GAP = (0.0015, 2e-5)


NARROW = {"max_rows": 16, "intercept": 0.002, "decode_tokens": 8e-4}
"""Steps of at most 16 linear rows in a trace with a kink: other kernels, steeper per row."""


def synthetic_trace(path, num_steps=600, noise=0.01, seed=0, kink=False, slowdown=1.0):
    """A version-2 trace whose step durations are TRUE's linear function of its features
    (times `1 + noise * N(0, 1)`, and `slowdown`: a machine that much slower), with busy
    gaps of GAP[0] + GAP[1] per row; with `kink`, steps of at most NARROW's rows cost
    NARROW's function instead."""
    rng = random.Random(seed)
    lines = [{"type": "header", "version": 2, "policy": "fcfs",
              "engine": {"block_size": 16, "num_kv_blocks": 100, "kv_bytes_per_token": 64,
                         "max_model_len": 2048}},
             {"type": "arrival", "request_id": "r", "t": 0.0, "num_prompt_tokens": 10,
              "max_tokens": 10}]
    t = 0.0
    for step in range(num_steps):
        rows = rng.randrange(0, 40)
        prefill = rng.choice([0, 0, rng.randrange(1, 512)])
        prefill_rows = 0 if not prefill else rng.randrange(1, 3)
        context = rows * rng.randrange(10, 2000)
        f = {"prefill_tokens": prefill, "prefill_rows": prefill_rows, "decode_rows": rows,
             "decode_tokens": rows, "decode_context_tokens": context,
             "prefill_context_tokens": prefill,
             "prefill_attention_pairs": prefill * rng.randrange(0, 2000) + prefill ** 2 // 2,
             "swap_out_bytes": rng.choice([0] * 9 + [2 ** 20]), "swap_in_bytes": 0}
        assert set(f) == set(FEATURE_NAMES)
        y = (TRUE["intercept"] + TRUE["prefill_tokens"] * prefill
             + TRUE["prefill_rows"] * prefill_rows + TRUE["decode_tokens"] * rows
             + TRUE["decode_context_tokens"] * context
             + TRUE["prefill_attention_pairs"] * f["prefill_attention_pairs"]
             + TRUE["swap"] * f["swap_out_bytes"])
        if kink and prefill + rows <= NARROW["max_rows"]:
            y = (NARROW["intercept"] + NARROW["decode_tokens"] * rows
                 + TRUE["decode_context_tokens"] * context)
        y *= (1 + noise * rng.gauss(0, 1)) * slowdown
        lines.append({"type": "step", "step": step, "t_start": t, "t_end": t + y,
                      "scheduled": [], "preempted": [], "finished": [], "features": f})
        t += y + GAP[0] + GAP[1] * (rows + prefill_rows)
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_fit_recovers_known_coefficients(tmp_path):
    trace = read_trace(synthetic_trace(tmp_path / "t.jsonl"))
    model = fit_trace(trace, "t.jsonl")
    assert model.intercept == pytest.approx(TRUE["intercept"], rel=0.05)
    c = model.coefficients
    for name in ("prefill_tokens", "prefill_rows", "decode_tokens", "decode_context_tokens",
                 "prefill_attention_pairs"):
        assert c[name] == pytest.approx(TRUE[name], rel=0.1), name
    assert c["swap_out_bytes"] == c["swap_in_bytes"] == pytest.approx(TRUE["swap"], rel=0.1)
    assert model.gap_intercept == pytest.approx(GAP[0], rel=0.02)
    assert model.gap_per_row == pytest.approx(GAP[1], rel=0.02)
    report = model.fit_report
    assert report["mean_abs_pct_error"] < 0.02 and report["r2"] > 0.99
    assert report["busy_time_ratio"] == pytest.approx(1.0, abs=0.01)
    assert report["engine"]["num_kv_blocks"] == 100
    # a held-out trace of the same machine: the same small error
    other = evaluate(model, read_trace(synthetic_trace(tmp_path / "u.jsonl", seed=1)))
    assert other["weighted_abs_pct_error"] < 0.02
    # saved and loaded, the model predicts the same
    saved = LinearStepModel.load(model.save(tmp_path / "m.json"))
    f = trace.steps[3].features
    assert saved.step_seconds(f) == pytest.approx(model.step_seconds(f))
    assert make_step_model(f"linear:{tmp_path / 'm.json'}").step_seconds(f) == \
        pytest.approx(model.step_seconds(f))


def test_fit_keeps_the_stalls_time_but_not_their_shape(tmp_path):
    """Steps that stalled (here every 25th, 4x as long) are left out of the regression but
    their time is not: the model's total over the run is the run's total (`level`)."""
    path = synthetic_trace(tmp_path / "s.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    stalled = 0.0
    for line in lines:
        if line["type"] == "step" and line["step"] % 25 == 0:
            extra = 3 * (line["t_end"] - line["t_start"])
            line["t_end"] += extra
            stalled += extra
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = read_trace(path)
    model = fit_trace(trace)
    report = model.fit_report
    assert report["num_outliers"] >= 20
    measured = sum(s.t_end - s.t_start for s in trace.steps)
    assert report["level"] == pytest.approx(measured / (measured - stalled), rel=0.02)
    assert report["level"] > 1.05
    assert report["step_time_ratio"] == pytest.approx(1.0, abs=1e-6)
    # The shape is the clean steps' one, scaled by the level.
    assert model.coefficients["decode_tokens"] == pytest.approx(
        TRUE["decode_tokens"] * report["level"], rel=0.05)


def test_pooled_fit_takes_the_runs_together(tmp_path):
    """Two runs of one engine, the second on a machine 20% slower: fitted together (a list
    of traces, or fit:A,B), the model sits between them and says so on each run."""
    fast = synthetic_trace(tmp_path / "fast.jsonl")
    slow = synthetic_trace(tmp_path / "slow.jsonl", seed=1, slowdown=1.2)
    pooled = fit_trace([read_trace(fast), read_trace(slow)], f"{fast},{slow}")
    assert pooled.fit_report["num_traces"] == 2
    assert pooled.fit_report["num_steps"] == 1200
    assert pooled.name == "fit(fast.jsonl,slow.jsonl)"
    assert pooled.coefficients["decode_tokens"] == pytest.approx(1.1 * TRUE["decode_tokens"],
                                                                 rel=0.05)
    assert evaluate(pooled, read_trace(fast))["step_time_ratio"] == pytest.approx(1.1, abs=0.03)
    assert evaluate(pooled, read_trace(slow))["step_time_ratio"] == pytest.approx(0.92, abs=0.03)
    assert pooled.fit_report["step_time_ratio"] == pytest.approx(1.0, abs=0.02)
    by_spec = make_step_model(f"fit:{fast},{slow}")
    f = _features(decode=8, context=3000)
    assert by_spec.step_seconds(f) == pytest.approx(pooled.step_seconds(f))
    alone = make_step_model(f"fit:{fast}")
    assert alone.step_seconds(f) < by_spec.step_seconds(f)


def test_fit_splits_where_few_row_steps_cost_otherwise(tmp_path):
    linear = fit_trace(read_trace(synthetic_trace(tmp_path / "l.jsonl")))
    assert linear.narrow_max_rows == 0  # one set of coefficients fits a linear machine
    trace = read_trace(synthetic_trace(tmp_path / "k.jsonl", kink=True))
    single = fit_trace(trace)
    assert single.narrow_max_rows == NARROW["max_rows"]
    assert single.narrow_intercept == pytest.approx(NARROW["intercept"], rel=0.1)
    assert single.narrow_coefficients["decode_tokens"] == pytest.approx(
        NARROW["decode_tokens"], rel=0.05)
    assert single.coefficients["decode_tokens"] == pytest.approx(TRUE["decode_tokens"],
                                                                 rel=0.1)
    assert single.fit_report["mean_abs_pct_error"] < 0.03
    assert single.fit_report["split_abs_error_s"]["16"] < \
        0.5 * single.fit_report["split_abs_error_s"]["none"]
    held_out = read_trace(synthetic_trace(tmp_path / "h.jsonl", seed=1, kink=True))
    assert evaluate(single, held_out)["mean_abs_pct_error"] < 0.03
    saved = LinearStepModel.load(single.save(tmp_path / "m.json"))
    for f in (_features(decode=4, context=800), _features(decode=30, context=9000),
              _features(prefill=200, prefill_rows=1, decode=3)):
        assert saved.step_seconds(f) == pytest.approx(single.step_seconds(f))
    assert saved.step_seconds(_features(decode=16)) == pytest.approx(
        NARROW["intercept"] + 16 * NARROW["decode_tokens"], rel=0.05)
    assert saved.step_seconds(_features(decode=17)) == pytest.approx(
        TRUE["intercept"] + 17 * TRUE["decode_tokens"], rel=0.05)


def test_nonnegative_fit_drops_what_noise_makes_negative():
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.uniform(0, 100, 200), rng.uniform(0, 1, 200)])
    y = 2.0 + 0.5 * x[:, 1] - 0.3 * x[:, 2]  # a negative cost is not physics
    coef = nonnegative_lstsq(x, y)
    assert (coef >= 0).all() and coef[2] == 0.0
    assert coef[1] == pytest.approx(0.5, rel=0.05)


def _features(prefill=0, prefill_rows=0, decode=0, context=0, pairs=0, swap=0):
    return {"prefill_tokens": prefill, "prefill_rows": prefill_rows, "decode_rows": decode,
            "decode_tokens": decode, "decode_context_tokens": context,
            "prefill_context_tokens": prefill, "prefill_attention_pairs": pairs,
            "swap_out_bytes": swap, "swap_in_bytes": 0}


def test_roofline_sanity():
    h200, a100 = load_hardware("h200"), load_hardware("a100")
    llama = load_model_shape("llama-3-8b")
    assert llama.num_parameters == pytest.approx(8.03e9, rel=0.01)
    assert llama.kv_bytes_per_token == 131072
    m1 = RooflineStepModel(h200, llama, 1)
    # a decode step of one short request is the weights read once at the bandwidth
    weights_s = (llama.num_parameters - llama.vocab_size * llama.hidden_size) * 2 / (
        h200.memory_bandwidth * h200.bandwidth_efficiency)
    one = m1.step_seconds(_features(decode=1, context=100))
    assert one == pytest.approx(weights_s + h200.step_overhead, rel=0.02)
    # decode is memory-bound: 32 rows cost far less than 32 times one row
    assert m1.step_seconds(_features(decode=32, context=3200)) < 1.5 * one
    # long prefill is compute-bound: doubling tokens nearly doubles the time
    p = lambda n: m1.step_seconds(_features(prefill=n, prefill_rows=1, pairs=n * n // 2))  # noqa: E731
    assert 1.8 < (p(8192) - h200.step_overhead) / (p(4096) - h200.step_overhead) < 2.3
    expected = 2 * llama.num_parameters * 8192 / (h200.peak_flops * h200.flops_efficiency)
    assert p(8192) == pytest.approx(expected, rel=0.25)
    # tensor parallelism: faster, but less than linearly (all-reduces per layer)
    m2 = RooflineStepModel(h200, llama, 2)
    assert 0.5 * p(4096) < RooflineStepModel(h200, llama, 2).step_seconds(
        _features(prefill=4096, prefill_rows=1, pairs=4096 ** 2 // 2)) < p(4096)
    assert m2.step_seconds(_features(decode=1, context=100)) < one
    # the older GPU is slower at both
    ma = RooflineStepModel(a100, llama, 1)
    assert ma.step_seconds(_features(decode=8, context=800)) > m1.step_seconds(
        _features(decode=8, context=800))
    # KV capacity: memory less weights, over 128 KiB per token
    blocks = num_kv_blocks(h200, llama, 1, 16)
    usable = h200.memory_bytes * h200.memory_utilization - llama.weight_bytes \
        - h200.activation_reserve_bytes
    assert blocks == int(usable // (131072 * 16))
    assert num_kv_blocks(h200, llama, 2, 16) > 2 * blocks
    assert kv_transfer_seconds(h200, llama, 1000) == pytest.approx(
        h200.network_latency + 1000 * 131072 / h200.network_bandwidth)
    with pytest.raises(ValueError, match="does not fit"):
        num_kv_blocks(Hardware("tiny", 1e12, 1e11, 8e9), llama, 1, 16)
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        RooflineStepModel(h200, llama, 3)


def test_presets_and_files(tmp_path):
    for name in ("cpu-here", "h200", "a100"):
        hw = load_hardware(name)
        assert hw.peak_flops > 0 and hw.memory_bandwidth > 0
    path = tmp_path / "gpu.yaml"
    path.write_text("name: x\npeak_flops: 1.0e14\nmemory_bandwidth: 1.0e12\n"
                    "memory_bytes: 4.0e10\n")
    assert load_hardware(str(path)).peak_flops == 1e14
    path.write_text("name: x\npeak_flop: 1\n")
    with pytest.raises(ValueError, match="unknown field"):
        load_hardware(str(path))
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}
    shape = model_shape_from_hf_config(cfg, "smol")
    assert shape == ModelShape(**{**load_model_shape("smollm2-135m").__dict__, "name": "smol"})
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    assert load_model_shape(str(tmp_path / "ckpt")).num_layers == 30


def test_version_1_trace_fits_on_what_it_has(tmp_path):
    lines = [{"type": "header", "version": 1, "policy": "fcfs"}]
    rng = random.Random(2)
    t = 0.0
    for step in range(200):
        p, d = rng.choice([0, rng.randrange(1, 300)]), rng.randrange(0, 20)
        y = 0.01 + 1e-4 * p + 5e-4 * d
        sched = ([["a", p, "prefill"]] if p else []) + [[f"d{i}", 1, "decode"] for i in range(d)]
        lines.append({"type": "step", "step": step, "t_start": t, "t_end": t + y,
                      "scheduled": sched, "preempted": [], "finished": []})
        t += y
    path = tmp_path / "v1.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    model = fit_trace(read_trace(path))
    assert model.intercept == pytest.approx(0.01, rel=0.01)
    assert model.coefficients["prefill_tokens"] == pytest.approx(1e-4, rel=0.01)
    assert model.coefficients["decode_tokens"] == pytest.approx(5e-4, rel=0.01)
    assert model.coefficients["decode_context_tokens"] == 0.0


def test_arrivals_of_a_trace_replay(tmp_path):
    from treadle.engine.trace import TraceRecorder
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams
    from treadle.sim.workload import from_engine_trace

    now = [100.0]
    rec = TraceRecorder(tmp_path / "t.jsonl", clock=lambda: now[0])
    for i, (t, p, o, prio) in enumerate([(100.5, 30, 4, 1), (101.0, 12, 9, 0)]):
        rec.record_arrival(Request(str(i), [5] * p, SamplingParams(max_tokens=o),
                                   arrival_time=t, priority=prio))
    rec.close()
    reqs = from_engine_trace(read_trace(tmp_path / "t.jsonl"))
    assert [(r.arrival, r.prompt_len, r.output_len, r.priority) for r in reqs] == \
        [(0.0, 30, 4, 1), (0.5, 12, 9, 0)]


def _served_trace(path, requests):
    """A trace of `requests` (id, arrival t, prompt tokens, prefill chunks as (t_end,
    tokens), then decode step ends) as the engine writes it."""
    lines = [{"type": "header", "version": 2, "policy": "fcfs", "engine": {}}]
    steps = []
    for rid, t, prompt, chunks, decodes in requests:
        lines.append({"type": "arrival", "request_id": rid, "t": t, "num_prompt_tokens": prompt,
                      "max_tokens": 4})
        steps += [(end, [rid, n, "prefill"]) for end, n in chunks]
        steps += [(end, [rid, 1, "decode"]) for end in decodes]
    for i, (end, entry) in enumerate(sorted(steps, key=lambda s: s[0])):
        lines.append({"type": "step", "step": i, "t_start": end - 0.001, "t_end": end,
                      "scheduled": [entry], "preempted": [], "finished": []})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return read_trace(path)


def test_front_end_is_the_client_ttft_beyond_the_engines(tmp_path):
    from treadle.sim.front_end import engine_ttfts, front_end_seconds

    # Engine TTFTs: a (two chunks, first token at the second's end) 0.30 - 0.10 = 0.20;
    # b (a one-token prompt, scheduled as a decode at once) 0.25 - 0.20 = 0.05; c 0.45 -
    # 0.30 = 0.15, its later decodes not counted.
    trace = _served_trace(tmp_path / "t.jsonl", [
        ("a", 0.10, 40, [(0.2, 20), (0.3, 20)], [0.4]),
        ("b", 0.20, 1, [], [0.25, 0.35]),
        ("c", 0.30, 8, [(0.45, 8)], [0.5, 0.6])])
    assert engine_ttfts(trace) == pytest.approx([0.20, 0.05, 0.15])
    # The client sent them 9, 9 and 12 ms before they reached the engine and saw their
    # first tokens 2, 1 and 3 ms after the steps ended: 11, 10, 15 ms of front end.
    client = [{"start_s": 5.0, "ttft_s": 0.211, "error": None},
              {"start_s": 5.1, "ttft_s": 0.060, "error": None},
              {"start_s": 5.2, "ttft_s": 0.165, "error": None},
              {"start_s": 5.3, "ttft_s": None, "error": "HTTP 400"}]  # never reached it
    got = front_end_seconds(trace, client)
    assert got["front_end_s"] == pytest.approx(0.011) and got["num_requests"] == 3
    with pytest.raises(ValueError, match="same run"):
        front_end_seconds(trace, client[:2])
