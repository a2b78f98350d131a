"""The offline API: bad prompts fail alone, string prompts, seeds, prefix caching and
preemption leave greedy outputs unchanged, and every block is freed."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from treadle import LLM, SamplingParams
from treadle.models.demo import write_demo_model

TINY_DEMO = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """The demo model's tokenizer and architecture, tiny dimensions (fp32 on disk is fine)."""
    return str(write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=3,
                                config_overrides=dict(TINY_DEMO, initializer_range=0.2)))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def prompts(n, seed=0, lo=1, hi=90, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(llm, token_prompts, max_tokens=20):
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_bad_prompts_fail_alone(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=20, block_size=16)
    good = prompts(3, seed=1)
    batch = [{"prompt_token_ids": good[0]},
             {"prompt_token_ids": []},                        # empty
             {"prompt_token_ids": good[1]},
             {"prompt_token_ids": [5] * 500},                 # 500 + 16 > 512 context
             {"prompt_token_ids": [5] * 400},                 # 400 + 16 > 20 blocks * 16
             {"prompt_token_ids": [5, 99999]},                # outside the vocabulary
             {"prompt_token_ids": good[2]}]
    outs = llm.generate(batch, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == [
        "length", "error", "length", "error", "error", "error", "length"]
    assert "empty" in outs[1].error
    assert "500" in outs[3].error and "512" in outs[3].error and "max_tokens" in outs[3].error
    assert "20 blocks" in outs[4].error
    assert "99999" in outs[5].error
    assert all(len(outs[i].outputs[0].token_ids) == 16 for i in (0, 2, 6))
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 20


@pytest.mark.executors("uni")
def test_mismatched_params_list_is_an_error(llama_dir):
    """Checked in the engine's own process (the params list, the tokenizer a text prompt
    or bad_words need) before anything reaches a worker: one executor."""
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams()] * 3, use_tqdm=False)
    # A text prompt without a tokenizer fails that prompt alone (issue 24), not the call.
    text, ids = llm.generate(["a string prompt", [5, 6]], use_tqdm=False)
    assert text.outputs[0].finish_reason == "error" and "no tokenizer" in text.error
    assert ids.error is None
    # So do words that need a tokenizer to become token ids (bad_words, DRY's breakers).
    words, dry, plain = llm.generate([[5, 6]] * 3, [
        SamplingParams(max_tokens=2, bad_words=["x"]),
        SamplingParams(max_tokens=2, dry_multiplier=0.8), SamplingParams(max_tokens=2)],
        use_tqdm=False)
    assert words.outputs[0].finish_reason == "error" and words.error.startswith("bad_words")
    assert dry.error.startswith("dry_multiplier") and plain.error is None


@pytest.mark.executors("uni")
def test_string_prompts_and_text(tiny_demo):
    """Tokenizing and detokenizing happen in the engine's own process, the worker sees
    token ids either way: one executor (the mp executor's token ids are checked against
    uni's in test_executors.py and by every other test here)."""
    llm = LLM(model=tiny_demo, dtype="float32", num_kv_blocks=256)
    out = llm.generate(["Hello, world!", "日本語 ✓"], SamplingParams(max_tokens=8, temperature=0,
                                                                   ignore_eos=True),
                       use_tqdm=False)
    for o in out:
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)
        completion = o.outputs[0]
        assert len(completion.token_ids) == 8
        assert completion.text == llm.tokenizer.decode(completion.token_ids,
                                                       skip_special_tokens=True)


def test_eos_stops_unless_ignored(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=64)
    p = prompts(1, seed=4)[0]
    first = greedy(llm, [p], max_tokens=10)[0]
    # Make the 4th greedy token a stop token: generation ends right there, reason "stop".
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first[3]])
    out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
    stop_at = first.index(first[3])
    assert out.token_ids == first[:stop_at + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_independent_of_the_batch(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)
    target = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)
    others = [{"prompt_token_ids": p} for p in prompts(6, seed=6)]
    crowded = llm.generate(others[:3] + [{"prompt_token_ids": target}] + others[3:],
                           [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)] * 3
                           + [params]
                           + [SamplingParams(max_tokens=24, temperature=0.7, ignore_eos=True)] * 3,
                           use_tqdm=False)
    assert alone[0].outputs[0].token_ids == crowded[3].outputs[0].token_ids
    different_seed = llm.generate([{"prompt_token_ids": target}],
                                  SamplingParams(max_tokens=24, temperature=1.0, seed=99,
                                                 ignore_eos=True), use_tqdm=False)
    assert different_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_prefix_cache_and_preemption_do_not_change_outputs(llama_dir):
    shared = prompts(1, seed=7, lo=70, hi=70)[0]
    batch = [shared + tail for tail in prompts(8, seed=8, lo=1, hi=40)] + prompts(4, seed=9)
    reference = greedy(LLM(model=llama_dir, dtype="float32", num_kv_blocks=512,
                           enable_prefix_caching=False), batch)

    cached = LLM(model=llama_dir, dtype="float32", num_kv_blocks=512)
    # Blocks are shared once computed: warm the cache with one request, then every
    # request with the 70-token prefix reuses its 4 full blocks (64 tokens).
    assert greedy(cached, batch[:1]) == reference[:1]
    hits_before = cached.get_stats()["prefix_cache_hit_tokens"]
    assert greedy(cached, batch) == reference
    assert cached.get_stats()["prefix_cache_hit_tokens"] - hits_before >= 8 * 64

    # A cache a few blocks larger than the largest request (110 + 20 tokens = 9 blocks).
    tight = LLM(model=llama_dir, dtype="float32", num_kv_blocks=12, block_size=16,
                max_num_batched_tokens=64, admission_lookahead_tokens=0, kv_watermark=0.0)
    assert greedy(tight, batch) == reference
    assert tight.get_stats()["num_preemptions"] > 0
    assert tight.engine.scheduler.kv.pool.num_free_blocks == 12


def test_cli_generate_and_demo_model(tiny_demo, tmp_path):
    out = subprocess.run([sys.executable, "-m", "treadle.cli", "--log-level", "WARNING",
                          "generate", "--prompt", "Once upon a time", "--max-tokens", "5",
                          "--ignore-eos", "--model", tiny_demo, "--dtype", "float32",
                          "--num-kv-blocks", "64"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time")
    assert "5 generated" in out.stderr and "finish_reason=length" in out.stderr

    bad = subprocess.run([sys.executable, "-m", "treadle.cli", "generate", "--prompt", "x",
                          "--model", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "config.json" in bad.stderr


HEAVY_BATCH = prompts(10, seed=11, lo=20, hi=100)


@pytest.fixture(scope="module")
def heavy_reference(llama_dir):
    """HEAVY_BATCH's greedy tokens from an engine with room for all of it, made once for
    the three modes and both executors (each engine gives the same greedy tokens, which
    the other modules check, and an engine under the mp executor takes ~3 s to start)."""
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=512)
    tokens = greedy(llm, HEAVY_BATCH, max_tokens=24)
    assert llm.get_stats()["num_preemptions"] == 0
    llm.engine.shutdown()
    return tokens


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_heavy_preemption_keeps_outputs_in_every_mode(llama_dir, heavy_reference, mode):
    batch, reference = HEAVY_BATCH, heavy_reference
    # The largest request needs ceil((100 + 24) / 16) = 8 blocks; the cache has 10.
    tight = LLM(model=llama_dir, dtype="float32", num_kv_blocks=10, block_size=16,
                max_num_batched_tokens=64, preemption_mode=mode, swap_space="8MiB",
                preemption_cooldown_steps=2, admission_lookahead_tokens=0, kv_watermark=0.0)
    assert greedy(tight, batch, max_tokens=24) == reference
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0
    if mode == "recompute":
        assert stats["num_preemptions_swap"] == 0 and stats["swap_bytes_out"] == 0
    if mode == "swap":
        assert stats["num_preemptions_recompute"] == 0 or stats["num_preemptions_swap"] > 0
    if mode in ("swap", "auto"):  # on CPU a copy is far cheaper than a recompute
        assert stats["num_preemptions_swap"] > 0
        assert stats["swap_bytes_in"] == stats["swap_bytes_out"] > 0
    assert stats["num_swapped"] == 0
    assert tight.engine.scheduler.kv.pool.num_free_blocks == 10
    assert tight.engine.scheduler.kv.swap_pool is None or \
        tight.engine.scheduler.kv.swap_pool.num_free_blocks == \
        tight.engine.scheduler.kv.swap_pool.num_blocks


@pytest.mark.executors("uni")
def test_priority_and_tenant_reach_the_engine(llama_dir):
    """The request's fields reach the engine core, in the engine's own process: one
    executor."""
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, scheduling_policy="priority",
              max_num_seqs=1)
    seen = {}
    original = llm.engine.add_request

    def spy(request):
        seen[request.request_id] = (request.priority, request.tenant, request.length_hint)
        return original(request)

    llm.engine.add_request = spy
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, n=2, seed=1),
                        priority=[3, 0], tenant=["a", "b"], length_hint=7, use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    assert sorted(seen.values()) == [(0, "b", 7), (0, "b", 7), (3, "a", 7), (3, "a", 7)]
    assert llm.driver.processor.num_requests == 0
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[5], [6]], priority=[1, 2, 3], use_tqdm=False)


@pytest.mark.executors("uni")
def test_offline_step_budget_default_and_override(llama_dir):
    """LLM takes a 1024-token step budget unless given one (the server keeps 512): the
    configuration, the same whatever the executor, checked on one."""
    from treadle.config import SchedulerConfig

    assert LLM(model=llama_dir).config.scheduler.max_num_batched_tokens == 1024
    assert LLM(model=llama_dir, max_num_batched_tokens=64).config.scheduler \
        .max_num_batched_tokens == 64
    assert SchedulerConfig().max_num_batched_tokens == 512
