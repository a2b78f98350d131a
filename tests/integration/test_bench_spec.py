"""`treadle bench spec` end to end on a tiny demo model: every system runs both workloads
at each concurrency, the summary has one row per (workload, concurrency, system) with its
ratio to speculation off, the proposers' acceptance figures come from their drafts, and
the JSON result is written."""

from __future__ import annotations

import argparse
import json

from treadle.bench import spec as bench_spec
from treadle.models.demo import write_demo_model


def _tiny_model(path):
    return write_demo_model(path, seed=3, config_overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2))


def test_bench_spec_runs_every_system(tmp_path):
    model = _tiny_model(tmp_path / "m")
    out = tmp_path / "spec.json"
    parser = argparse.ArgumentParser()
    bench_spec.add_arguments(parser)
    args = parser.parse_args([
        "--model", str(model), "--concurrency", "1,3", "--requests", "1,3",
        "--max-tokens", "8", "--repeats", "1", "--draft-layers", "1", "--dtype", "float32",
        "--num-threads", "1", "--no-adaptive", "--kv-cache-memory", "64MiB", "--draft-dir", str(tmp_path),
        "--output", str(out)])
    result = bench_spec.run(args)
    assert bench_spec.report(result, str(out)) == 0
    rows = {(r["workload"], r["concurrency"], r["system"]): r for r in result["summary"]}
    assert set(rows) == {(w, c, s) for w in ("copy", "chat") for c in (1, 3)
                         for s in bench_spec.SYSTEMS}
    for (workload, c, system), row in rows.items():
        assert row["out_tokens"] > 0
        if system == "off":
            assert row["vs_off"] == row["vs_off_paired"] == 1.0 and row["acceptance"] == 0.0
    for run in result["runs"]:
        if run["system"] in ("draft", "self"):  # a model drafts on every decode step
            assert run["drafts"] > 0
            assert run["mean_accepted_length"] == 1.0 + run["accepted_tokens"] / run["drafts"]
    assert (tmp_path / "m-first1" / "model.safetensors").exists()  # the truncated draft
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "spec" and len(saved["runs"]) == len(result["runs"])


def test_systems_stepping_in_turn_do_what_each_does_alone(tmp_path):
    """The lockstep run interleaves the engines' steps; each engine's outputs, steps and
    drafts are those of its run alone, and its time is its own steps only."""
    from treadle import LLM

    model = str(_tiny_model(tmp_path / "m"))
    options = dict(dtype="float32", num_threads=1, kv_cache_memory="64MiB",
                   enable_prefix_caching=False, max_num_seqs=3)
    llms = {"off": LLM(model=model, **options),
            "ngram": LLM(model=model, speculative_config={"method": "ngram",
                                                           "adaptive": False}, **options)}
    prompts = bench_spec.chat_workload(llms["off"].tokenizer, 5)
    alone = {name: bench_spec.run_closed_loop(llm, prompts, 12, 3)
             for name, llm in llms.items()}
    together = bench_spec.run_lockstep(llms, prompts, 12, 3)
    for name in llms:
        for key in ("output_tokens", "steps", "drafts", "accepted_tokens"):
            assert together[name][key] == alone[name][key], (name, key)
        assert 0 < together[name]["busy_s"] < together[name]["wall_s"]
    # Both ran over the same wall time, each timed over its own steps only.
    assert together["off"]["busy_s"] + together["ngram"]["busy_s"] <= max(
        r["wall_s"] for r in together.values())
