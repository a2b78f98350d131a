"""Speculative decoding end to end on tiny random models (fp32): greedy outputs are
identical with and without speculation for each proposer (ngram, draft, self), with
chunked prefill, preemption by recompute and by swap, and prefix caching in play; every
block comes back; the per-request opt-out; target logprobs; a seeded sampled request
gives the same tokens with ngram speculation on and off; sampled outputs follow the same
distribution with a draft proposer (two-sample chi-square); tensor and pipeline
parallelism; the step trace and the stats carry the acceptance figures; structured
outputs' grammars hold under each proposer."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_checkpoint
from treadle import LLM, SamplingParams
from treadle.engine.trace import read_trace

NUM_REQUESTS = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec-target"), "llama",
                                num_hidden_layers=4)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target with noise on every weight: a draft that agrees often, not always."""
    out = tmp_path_factory.mktemp("spec-draft")
    for name in ("config.json", "generation_config.json"):
        if (Path(target) / name).exists():
            shutil.copy(Path(target) / name, out / name)
    weights = load_file(str(Path(target) / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 else v
             for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def prompts():
    """Shared prefixes (prefix-cache hits) and repeated spans (prompt lookup matches)."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    items = []
    for i in range(NUM_REQUESTS):
        span = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 9))]
        body = span * rng.randrange(2, 5) + [rng.randrange(3, 500)]
        items.append({"prompt_token_ids": (shared if i % 2 else []) + body})
    return items


def spec_config(method, draft_dir, **extra):
    base = {"ngram": {"method": "ngram", "prompt_lookup_min": 1},
            "draft": {"method": "draft", "model": draft_dir},
            "self": {"method": "self", "draft_layers": 3}}[method]
    return {**base, "num_speculative_tokens": 3, **extra}


def run(target, params=None, speculative=None, items=None, **options):
    # One thread: tiny shapes gain nothing from two, and on a loaded machine every
    # parallel region of a tiny op can wait for a descheduled thread.
    settings = dict(dtype="float32", block_size=4, num_kv_blocks=512,
                    max_num_batched_tokens=256, num_threads=1) | options
    llm = LLM(model=target, speculative_config=speculative, **settings)
    params = params or SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(items or prompts(), params, use_tqdm=False)
    stats = llm.get_stats()
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.num_kv_blocks
    llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats, outs


@pytest.fixture(scope="module")
def reference(target):
    tokens, stats, _ = run(target)
    assert stats["num_preemptions"] == 0
    return tokens


TIGHT = dict(num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=6,
             admission_lookahead_tokens=0, kv_watermark=0.0)
"""30 blocks of 4 tokens for 12 requests of up to ~65 tokens: preemption (admission
reserves no headroom for the running requests' growth, so they outgrow the cache); a
budget of 16 tokens: prompts are chunked."""


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_greedy_outputs_identical_under_pressure(target, draft, reference, method, mode):
    tokens, stats, _ = run(target, speculative=spec_config(method, draft, adaptive=False),
                           preemption_mode=mode, swap_space="1MiB", **TIGHT)
    assert tokens == reference
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_preemptions_swap"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0
    # Rollback was exercised: some proposals were rejected.
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_adaptive_policy_keeps_outputs(target, draft, reference, method):
    tokens, stats, _ = run(target, speculative=spec_config(method, draft))
    assert tokens == reference
    assert "spec_acceptance_rate" in stats and "spec_mean_accepted_length" in stats


@pytest.mark.parametrize("method", ["draft", "self"])
def test_the_cost_probe_measures_a_catch_up_only_for_a_draft_with_its_own_kv(
        target, draft, method):
    llm = LLM(model=target, speculative_config=spec_config(method, draft), dtype="float32",
              block_size=4, num_kv_blocks=512, num_threads=1)
    costs = llm.engine.info.spec_costs
    llm.engine.shutdown()
    assert costs.has_draft_model
    if method == "draft":
        assert costs.catchup_seconds_per_token > 0
    else:  # self reads the target's KV: nothing to catch up
        assert costs.catchup_seconds_per_token == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["draft", "self"])
def test_a_draft_equal_to_the_target_is_always_accepted(target, reference, method, mode):
    """The draft's KV is right through its whole lifecycle: with the target itself as the
    draft (its own cache for `draft`, all of the target's layers for `self`), every
    proposal is accepted — through prompt chunks, prefix-cache hits, rollbacks of cut
    proposals, and preemption by recompute or swap."""
    config = ({"method": "draft", "model": target} if method == "draft"
              else {"method": "self", "draft_layers": 4})
    tokens, stats, _ = run(target, speculative={**config, "num_speculative_tokens": 3,
                                                "adaptive": False},
                           preemption_mode=mode, swap_space="1MiB",
                           **{**TIGHT, "num_kv_blocks": 26})
    assert tokens == reference
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0


def test_requests_that_opt_out_run_no_proposals(target, draft, reference, tmp_path):
    trace = tmp_path / "trace.jsonl"
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             speculative=i % 2 == 0) for i in range(NUM_REQUESTS)]
    tokens, stats, outs = run(target, params=params, trace=str(trace),
                              speculative=spec_config("draft", draft, adaptive=False))
    assert tokens == reference
    assert stats["spec_num_drafts"] > 0
    opted_out = {o.request_id for i, o in enumerate(outs) if i % 2 == 1}
    decodes = [entry for step in read_trace(trace).steps for entry in step.scheduled
               if entry[2] == "decode"]
    assert all(n == 1 for rid, n, _ in decodes if rid in opted_out)
    assert any(n > 1 for rid, n, _ in decodes if rid not in opted_out)


def test_trace_records_acceptance(target, draft, tmp_path):
    trace = tmp_path / "trace.jsonl"
    _, stats, _ = run(target, trace=str(trace),
                      speculative=spec_config("draft", draft, adaptive=False))
    steps = read_trace(trace).steps
    drafts = sum(s.spec["drafts"] for s in steps if s.spec)
    accepted = sum(s.spec["accepted"] for s in steps if s.spec)
    assert drafts == stats["spec_num_drafts"] and accepted == stats["spec_num_accepted_tokens"]
    summary = read_trace(trace).spec_summary()
    assert summary["acceptance_rate"] == pytest.approx(stats["spec_acceptance_rate"])
    assert summary["mean_accepted_length"] == pytest.approx(stats["spec_mean_accepted_length"])


def test_logprobs_are_the_target_s(target, draft):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    _, _, plain = run(target, params=params)
    _, stats, spec = run(target, params=params,
                         speculative=spec_config("draft", draft, adaptive=False))
    assert stats["spec_num_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for token in la:
                assert la[token].logprob == pytest.approx(lb[token].logprob, abs=1e-4)


def test_seeded_sampling_is_the_same_with_ngram_speculation(target):
    items = prompts()
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=100 + i,
                             ignore_eos=True) for i in range(NUM_REQUESTS)]
    plain, _, _ = run(target, params=params, items=items)
    spec, stats, _ = run(target, params=params, items=items,
                         speculative=spec_config("ngram", None, adaptive=False))
    assert stats["spec_num_accepted_tokens"] > 0
    assert spec == plain


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    keys = sorted(set(a) | set(b))
    ca = {k: a.count(k) for k in keys}
    cb = {k: b.count(k) for k in keys}
    big = [k for k in keys if ca[k] + cb[k] >= 10]
    rest_a = sum(ca[k] for k in keys if k not in big)
    rest_b = sum(cb[k] for k in keys if k not in big)
    pairs = [(ca[k], cb[k]) for k in big] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in pairs:
        stat += (x * math.sqrt(nb / na) - y * math.sqrt(na / nb)) ** 2 / (x + y)
    return stat, len(pairs) - 1


def test_sampled_outputs_follow_the_target_distribution_with_a_draft(target, draft):
    """The second and third tokens come out of verification (the first follows the
    prompt): their distribution with a sampling draft equals the one without."""
    item = [{"prompt_token_ids": [7, 8, 9, 7, 8]}]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, top_p=0.9,
                            ignore_eos=True, n=128)
    items = item * 4  # 512 samples
    _, _, plain = run(target, params=params, items=items, max_num_seqs=256)
    _, stats, spec = run(target, params=params, items=items, max_num_seqs=256,
                         speculative=spec_config("draft", draft, adaptive=False))
    assert stats["spec_num_drafts"] > 0
    for position in (1, 2):
        a = [c.token_ids[position] for o in plain for c in o.outputs]
        b = [c.token_ids[position] for o in spec for c in o.outputs]
        stat, dof = two_sample_chi_square(a, b)
        bound = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
        assert stat < bound, (position, stat, dof)


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        LLM(model=target, dtype="float32",
            speculative_config={"method": "draft", "model": other})
    with pytest.raises(ValueError, match="draft_layers"):
        LLM(model=target, dtype="float32",
            speculative_config={"method": "self", "draft_layers": 9})


@pytest.mark.parametrize("method, options", [
    ("draft", dict(tensor_parallel_size=2)),
    ("ngram", dict(pipeline_parallel_size=2)),
    ("draft", dict(pipeline_parallel_size=2)),
])
def test_tensor_and_pipeline_parallel(target, draft, reference, method, options):
    tokens, stats, _ = run(target, speculative=spec_config(method, draft, adaptive=False),
                           distributed_executor_backend="mp", **options)
    assert tokens == reference
    assert stats["spec_num_accepted_tokens"] > 0


def test_speculative_config_reaches_the_json_stats(target):
    _, stats, _ = run(target, speculative=spec_config("ngram", None))
    json.dumps(stats)  # every figure is plain data


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny random model with a real tokenizer (structured outputs need one)."""
    from treadle.models.demo import write_demo_model
    return str(write_demo_model(tmp_path_factory.mktemp("spec-demo") / "m", seed=11,
                                config_overrides=dict(
                                    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, initializer_range=0.2)))


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_structured_outputs_hold_under_speculation(demo, method):
    """The grammar's masks are part of the target's distribution in verification: a
    proposal the grammar forbids is rejected, greedy outputs are those without
    speculation, and sampled ones (a draft's stochastic path, or the coupled one) always
    match the grammar."""
    pytest.importorskip("llguidance")
    import re

    from treadle.structured import from_structured_outputs

    regex = r"(ab|cd|ef){4,12}\."
    spec = from_structured_outputs({"regex": regex})
    items = ["abcdab abcd abcdef " * 3, "efef cdcd abab " * 3, "ab cd ef " * 4, "x y z"]
    config = {"ngram": {"method": "ngram", "prompt_lookup_min": 1},
              "draft": {"method": "draft", "model": demo},
              "self": {"method": "self", "draft_layers": 2}}[method]
    speculative = {**config, "num_speculative_tokens": 3, "adaptive": False}

    def generate(params, speculative):
        llm = LLM(model=demo, dtype="float32", num_threads=1, num_kv_blocks=256,
                  speculative_config=speculative)
        outs = llm.generate(items, params, use_tqdm=False)
        stats = llm.get_stats()
        llm.engine.shutdown()
        return outs, stats

    greedy = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=spec)
    plain, _ = generate(greedy, None)
    spec_outs, stats = generate(greedy, speculative)
    assert [o.outputs[0].token_ids for o in spec_outs] == [o.outputs[0].token_ids
                                                           for o in plain]
    if method != "ngram":  # the draft proposes on every step; prompt lookup may not match
        assert stats["spec_num_drafts"] > 0
    sampled = SamplingParams(max_tokens=30, temperature=1.0, seed=5, n=4,
                             structured_outputs=spec)
    outs, stats = generate(sampled, speculative)
    for o in outs + plain:
        for c in o.outputs:
            if c.finish_reason == "stop":
                assert re.fullmatch(regex, c.text), c.text
            else:
                assert re.fullmatch(r"(ab|cd|ef)*(a|c|e)?", c.text), c.text
