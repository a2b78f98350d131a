"""treadle's greedy tokens equal transformers' generate, token for token, for every family,
with prompts chunked across steps and requests joining mid-flight."""

from __future__ import annotations

import random

import pytest
import torch

from treadle import LLM, SamplingParams

PROMPT_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 64, 65, 100, 127, 128, 200, 257, 310]


def make_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference_tokens(model_dir: str, prompts, max_tokens) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos keeps generating past EOS without forbidding it; min_new_tokens would
    # mask EOS out of the logits, so switch EOS off instead.
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    family, model_dir = tiny_checkpoint
    prompts = make_prompts(512)
    max_tokens = [32 + 5 * (i % 4) for i in range(len(prompts))]
    return model_dir, prompts, max_tokens, reference_tokens(model_dir, prompts, max_tokens)


NATIVE = dict(max_num_batched_tokens=64, max_num_seqs=5, block_size=16,
              attention_backend="native")
CHUNKED = dict(max_num_batched_tokens=37, max_num_seqs=16, block_size=4,
               enable_prefix_caching=False, attention_backend="torch")


def check_matches_transformers(expected, options):
    model_dir, prompts, max_tokens, reference = expected
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=2048, **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["mean_batch_size"] > 1  # requests really shared steps
    assert stats["num_steps"] < sum(max_tokens)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref, f"prompt {i} (length {len(prompts[i])}) differs"
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 2048


def test_greedy_tokens_match_transformers(expected):
    """A 37-token step budget, 16 sequences, blocks of 4, torch attention: prompts chunked
    over many steps, on both executors."""
    check_matches_transformers(expected, CHUNKED)


@pytest.mark.executors("uni")
def test_greedy_tokens_match_transformers_on_the_native_backend(expected):
    """A 64-token step budget, 5 sequences, blocks of 16, the C kernels' attention. On one
    executor: the mp executor carries the same kind of steps as in the test above, and
    the native backend is its default, which every other engine test under mp runs."""
    check_matches_transformers(expected, NATIVE)
