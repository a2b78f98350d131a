"""The engine with a quantized KV cache (`kv_cache_dtype`): greedy outputs of the C
kernels (cpu-native) equal those of the `reference` backend implementing the same
quantization; prefix-cache hits and swap preemption leave them unchanged (values and
scales travel in the blocks); fp8 on the torch backend equals the reference too; the
same memory holds more blocks."""

from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.models.demo import write_demo_model

# head_dim 64 and 3 query heads per KV head: the kernels' vector paths run.
TINY = dict(hidden_size=192, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512,
            initializer_range=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("kvq") / "m", seed=5,
                                config_overrides=TINY))


def prompts(n, seed, lo=20, hi=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def greedy(llm, batch, max_tokens=16):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def kv_caches(llm):
    return llm.engine.executor.worker.runner.kv_caches


def test_int8_greedy_matches_reference_and_survives_prefix_hits_and_swaps(model_dir):
    shared = prompts(1, seed=1, lo=70, hi=70)[0]
    batch = [shared + tail for tail in prompts(4, seed=2, lo=1, hi=30)] + prompts(2, seed=3)
    common = dict(model=model_dir, dtype="float32", kv_cache_dtype="int8", block_size=16)
    reference = LLM(attention_backend="reference", num_kv_blocks=256,
                    enable_prefix_caching=False, **common)
    expected = greedy(reference, batch, 10)
    assert kv_caches(reference)[0].dtype == torch.int8

    native = LLM(attention_backend="cpu-native", num_kv_blocks=256, **common)
    assert greedy(native, batch[:1], 10) == expected[:1]
    hits = native.get_stats()["prefix_cache_hit_tokens"]
    assert greedy(native, batch, 10) == expected
    assert native.get_stats()["prefix_cache_hit_tokens"] - hits >= 4 * 64

    # a cache a little larger than the largest request: swaps out and back in
    tight = LLM(attention_backend="cpu-native", num_kv_blocks=9, max_num_batched_tokens=64,
                preemption_mode="swap", swap_space="4MiB", preemption_cooldown_steps=2,
                admission_lookahead_tokens=0, kv_watermark=0.0, **common)
    assert greedy(tight, batch, 10) == expected
    stats = tight.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["swap_bytes_in"] > 0

    # the quantization is real: the unquantized cache gives other logprobs
    dense = LLM(model=model_dir, dtype="float32", num_kv_blocks=256, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    a = native.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)[0]
    b = dense.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)[0]
    lp = lambda o: [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]  # noqa: E731
    assert lp(a) != lp(b)


def test_bf16_int8_native_matches_reference(model_dir):
    """bf16: the fused rope + quantized write in C and the bf16 decode/prefill kernels
    against the reference backend (same quantized cache bit for bit; greedy tokens)."""
    batch = prompts(4, seed=4)
    common = dict(model=model_dir, dtype="bfloat16", kv_cache_dtype="int8", num_kv_blocks=128,
                  enable_prefix_caching=False)
    ref = LLM(attention_backend="reference", **common)
    nat = LLM(attention_backend="cpu-native", **common)
    assert greedy(nat, batch, 8) == greedy(ref, batch, 8)


def test_fp8_torch_matches_reference(model_dir):
    batch = prompts(3, seed=6)
    common = dict(model=model_dir, dtype="float32", kv_cache_dtype="fp8_e4m3",
                  num_kv_blocks=128, max_num_batched_tokens=32)  # chunked prompts
    ref = LLM(attention_backend="reference", **common)
    assert kv_caches(ref)[0].dtype == torch.uint8
    assert greedy(LLM(attention_backend="torch", **common), batch, 8) == greedy(ref, batch, 8)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_same_memory_holds_more_blocks_and_more_requests(model_dir, kind):
    memory = 4 * 1024 * 1024
    llms = {k: LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=k, kv_cache_memory=memory,
                   block_size=16, attention_backend="torch") for k in ("auto", kind)}
    blocks = {k: llm.engine.num_kv_blocks for k, llm in llms.items()}
    # bf16 rows are 128 bytes per (token, head); quantized ones 64 values + a 2-byte scale
    assert blocks[kind] == memory // (2 * 2 * 1 * 66 * 16)
    assert blocks["auto"] == memory // (2 * 2 * 1 * 128 * 16)
    assert blocks[kind] / blocks["auto"] > 1.9
    assert kv_caches(llms[kind])[0].numel() * kv_caches(llms[kind])[0].element_size() * 2 <= \
        memory


def test_bad_kv_cache_dtype_is_named(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=model_dir, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=model_dir, kv_cache_dtype="fp8_e4m3", attention_backend="cpu-native")


def test_scheduler_runs_more_requests_at_once_in_the_same_memory(model_dir):
    """Admission counts blocks of the real size: with int8 the same kv_cache_memory runs
    about twice the requests at once (12 requests of 2 blocks each)."""
    batch = prompts(12, seed=7, lo=20, hi=20)
    most = {}
    for kind in ("auto", "int8"):
        llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=kind,
                  kv_cache_memory=64 * 1024, block_size=16, enable_prefix_caching=False,
                  admission_lookahead_tokens=0, kv_watermark=0.0)
        scheduler, running = llm.engine.scheduler, []
        schedule = scheduler.schedule

        def recorded():
            out = schedule()
            running.append(len(scheduler.running))
            return out

        scheduler.schedule = recorded
        greedy(llm, batch, max_tokens=8)
        most[kind] = max(running)
    assert most["auto"] == 4  # 8 blocks of 512-byte tokens (bf16), 2 per request
    assert most["int8"] == 7  # 15 blocks of 264-byte tokens
