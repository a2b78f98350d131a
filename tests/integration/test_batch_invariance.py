"""`batch_invariant` end to end (docs/batch_invariance.md): a request's output logprobs,
bit for bit in bf16, are the same alone and in batches of 2, 5 and 16 with other random
requests (other lengths, sampled with seeds, penalties), after a prefix-cache miss, a
whole hit and a partial one, at chunk sizes (max_num_batched_tokens) 16, 64 and 512, and
over KV computed during decode reused from the prefix cache against the same tokens
prefilled; for the dense bf16 model and a GGUF of its Q8_0 (attention, LM head) and Q4_1
(MLP) blocks, on every kernel ISA level this CPU executes. The same checks fail without
the mode on an AMX Xeon (the kernels change with the rows there). The kernels alone:
test_invariant_kernels.py; the refusals: tests/unit/test_compat.py."""

from __future__ import annotations

import random

import pytest

from conftest import KERNEL_LEVELS, make_tiny_checkpoint
from gguf_files import write_tiny_gguf
from treadle import LLM, SamplingParams

SHAPE = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=768, num_hidden_layers=2)
"""head_dim 64 (the decode kernel's vector path) and K of 256 and 768 (long enough sums
that the default kernels' orders differ by rows)."""
GGUF_TYPES = {"self_attn.": "Q8_0", "mlp.": "Q4_1", "lm_head": "Q8_0"}
"""Both formats of the issue in one file (a fused group takes one format)."""
PROMPT_LEN = 309
"""19 full blocks and 5 tokens: a whole prefix-cache hit recomputes 5 (a short row)."""
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The dense checkpoint and its GGUF; the GGUF's conversion cached once for the module
    (in a cache directory of its own that shares the built kernels)."""
    from conftest import use_fresh_cache_dir

    root = tmp_path_factory.mktemp("invariance")
    dense = make_tiny_checkpoint(root / "dense", "llama", **SHAPE)
    gguf = write_tiny_gguf(dense, root / "tiny.gguf", "llama", GGUF_TYPES)
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_fresh_cache_dir(root / "cache", monkeypatch)
        yield {"dense": dense, "gguf": str(gguf)}


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def other_params(i: int) -> SamplingParams:
    """The other requests of a batch: sampled, seeded, penalized, some greedy."""
    return [SamplingParams(max_tokens=5, temperature=1.0, seed=i, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, seed=i,
                           repetition_penalty=1.2, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)][i % 3]


def logprobs(output) -> list[tuple]:
    """Each output position's top logprobs as (token, float32 logprob) pairs: equality is
    bit equality."""
    return [tuple(sorted((t, e.logprob) for t, e in step.items()))
            for step in output.outputs[0].logprobs]


def generate(llm: LLM, prompt: list[int], others: list[list[int]] = (),
             params: SamplingParams = GREEDY):
    """The first request's output, run together with `others`."""
    batch = [{"prompt_token_ids": p} for p in [prompt, *others]]
    outs = llm.generate(batch, [params] + [other_params(i) for i in range(len(others))],
                        use_tqdm=False)
    return outs[0]


def engine(model: str, level: str, quantized: bool, **options) -> LLM:
    return LLM(model=model, dtype="bfloat16", kernel_isa=level, batch_invariant=True,
               quantization="gguf" if quantized else "none", num_kv_blocks=512,
               distributed_executor_backend="uni", **options)


@pytest.mark.parametrize("weights", ["dense", "gguf"])
@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_logprobs_are_bit_identical_whatever_else_runs(models, level, weights):
    model, quantized = models[weights], weights == "gguf"
    prompt = random_prompts(1, seed=1, lo=PROMPT_LEN, hi=PROMPT_LEN)[0]
    others = random_prompts(15, seed=2)
    cached = engine(model, level, quantized, max_num_batched_tokens=512)
    kernels = cached.engine.info.kernels
    assert "batch-invariant" in kernels and ("quantization gguf" in kernels) == quantized
    reference = logprobs(generate(cached, prompt))  # a prefix-cache miss, one 309-row chunk
    assert len(reference) == GREEDY.max_tokens

    # A whole hit (5 tokens recomputed), in batches of 2, 5 and 16 with other requests.
    assert logprobs(generate(cached, prompt)) == reference, "prefix-cache hit"
    for n in (2, 5, 16):
        assert logprobs(generate(cached, prompt, others[:n - 1])) == reference, f"batch of {n}"
    # A partial hit: a prompt sharing its first 4 blocks with the cached one.
    partial = prompt[:64] + random_prompts(1, seed=3, lo=60, hi=60)[0]
    partial_hit = logprobs(generate(cached, partial, others[:4]))

    # KV computed during decode, reused from the prefix cache: a request decodes 27 tokens
    # after 40 of the prompt; the same tokens as a prompt hit its 4 full blocks (positions
    # 40 to 63 computed by decode steps), then predict position 66 as its 27th step did.
    first = generate(cached, prompt[:40], params=SamplingParams(
        max_tokens=27, temperature=0.0, ignore_eos=True, logprobs=5))
    continued = prompt[:40] + first.outputs[0].token_ids[:26]
    reused = logprobs(generate(cached, continued))
    assert reused[0] == logprobs(first)[26], "decode step vs prefill over its KV"

    # Chunk sizes 16 and 64, no prefix cache: the same bits, alone and in a batch.
    for budget in (16, 64):
        chunked = engine(model, level, quantized, max_num_batched_tokens=budget,
                         enable_prefix_caching=False)
        assert logprobs(generate(chunked, prompt)) == reference, f"chunks of {budget}"
        assert logprobs(generate(chunked, prompt, others[:4])) == reference
        if budget == 64:
            assert logprobs(generate(chunked, partial)) == partial_hit, "partial hit vs none"
            assert logprobs(generate(chunked, continued, others[:1])) == reused, \
                "decode-computed KV vs prefilled"
