"""Sampling end to end: logprobs against transformers, seeds through preemption, n > 1
sharing the prompt's blocks, stop strings, min_tokens and logit_bias."""

from __future__ import annotations

import random

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.models.demo import write_demo_model

TINY_DEMO = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def demo_llm(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=3,
                            config_overrides=TINY_DEMO)
    return LLM(model=str(path), dtype="float32", num_kv_blocks=256)


def prompts(n, seed=0, lo=5, hi=60, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_logprobs_match_transformers(llama_dir):
    from transformers import AutoModelForCausalLM

    # A small token budget chunks the prompt, so prompt logprobs come from several steps.
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=24)
    batch = prompts(3, seed=1, lo=30, hi=50)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=4,
                            prompt_logprobs=2)
    llm.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)  # warm the cache
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for prompt, out in zip(batch, outs):
        completion = out.outputs[0]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.inference_mode():
            ref = model(input_ids=ids).logits[0].log_softmax(-1)
        for k, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + k]
            assert token == int(row.argmax())
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert entry[token].rank == 1
            top = row.topk(4)
            assert list(entry) == top.indices.tolist()  # the chosen token is the top one
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))
        # Every prompt position is scored, even for the prompt already in the prefix cache.
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            entry = out.prompt_logprobs[j]
            assert entry[prompt[j]].logprob == pytest.approx(float(ref[j - 1, prompt[j]]),
                                                             abs=1e-4)
            assert entry[prompt[j]].rank == int((ref[j - 1] >= ref[j - 1, prompt[j]]).sum())
            assert len(entry) in (2, 3)


MIXED = [SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True),
         SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=12, ignore_eos=True),
         SamplingParams(max_tokens=20, temperature=1.2, top_k=20, min_p=0.05, seed=13,
                        repetition_penalty=1.2, ignore_eos=True),
         SamplingParams(max_tokens=20, temperature=1.0, presence_penalty=0.5,
                        frequency_penalty=0.5, seed=14, ignore_eos=True),
         SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.5, ignore_eos=True)]


def test_seeded_sampling_survives_batching_and_preemption(llama_dir):
    """Each of five seeded requests alone (one engine, one request per generate call: a
    request's seed drives its own generator, so nothing of an earlier call carries over;
    an engine per request cost ~3 s each to start under the mp executor) gives the tokens
    it gets in a batch of ten that preempts, by recompute and by swap."""
    batch = prompts(10, seed=2, lo=20, hi=90)
    params = [MIXED[i % len(MIXED)] for i in range(len(batch))]
    single = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256)
    alone = [single.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0].outputs[0].token_ids
             for p, q in zip(batch[:5], params[:5])]
    assert single.get_stats()["mean_batch_size"] == 1  # each request really ran alone
    single.engine.shutdown()
    for mode in ("recompute", "swap"):
        tight = LLM(model=llama_dir, dtype="float32", num_kv_blocks=9, block_size=16,
                    max_num_batched_tokens=48, preemption_mode=mode, swap_space="4MiB",
                    preemption_cooldown_steps=1, admission_lookahead_tokens=0,
                    kv_watermark=0.0)
        outs = tight.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert tight.get_stats()["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outs[:5]] == alone, mode


def test_n_samples_share_the_prompt_blocks(llama_dir):
    prompt = prompts(1, seed=3, lo=70, hi=70)[0]  # 4 full blocks of 16, 6 tokens over
    # Four samples alone would need 4 x 5 blocks; sharing the 4 full prompt blocks, 8.
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=9, block_size=16)
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=100, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    stats = llm.get_stats()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert stats["prefix_cache_hit_tokens"] == 3 * 64 and stats["num_preemptions"] == 0
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 9
    # Sample i is the n=1 request with seed + i.
    single = LLM(model=llama_dir, dtype="float32", num_kv_blocks=64).generate(
        [{"prompt_token_ids": prompt}] * 4,
        [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True)
         for i in range(4)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in single]


def test_stop_strings_end_the_request(demo_llm):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    (full,) = demo_llm.generate(["Once upon a time"], greedy, use_tqdm=False)
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    tok = demo_llm.tokenizer
    # A stop string that spans a token boundary: the end of token 9's text + token 10's.
    left, right = tok.decode(ids[:10]), tok.decode(ids[:11])
    stop = left[-2:] + right[len(left):len(left) + 2]
    assert len(stop) >= 3 and stop in text
    cut = text.index(stop)
    for include in (False, True):
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        (out,) = demo_llm.generate(["Once upon a time"], params, use_tqdm=False)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == text[:cut + (len(stop) if include else 0)]
        assert c.token_ids == ids[:len(c.token_ids)] and len(c.token_ids) < 30
    assert demo_llm.engine.scheduler.kv.pool.num_free_blocks == 256


def test_min_tokens_and_logit_bias(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=64)
    p = prompts(1, seed=4)[0]
    greedy = llm.generate([{"prompt_token_ids": p}], SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[1]
    (out,) = llm.generate([{"prompt_token_ids": p}], SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=[stop_id], min_tokens=4), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) >= 4 and stop_id not in c.token_ids[:4]
    assert c.finish_reason == "length" or (c.token_ids[-1] == stop_id
                                           and c.stop_reason == stop_id)
    outs = llm.generate([{"prompt_token_ids": p}] * 2, [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={77: 100}),
        SamplingParams(max_tokens=5, logit_bias={512: 1.0})], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [77] * 5
    assert outs[1].outputs[0].finish_reason == "error" and "logit_bias" in outs[1].error
