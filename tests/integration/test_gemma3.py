"""Gemma 3 (text): treadle's greedy tokens equal transformers' on tiny random checkpoints,
with prompts longer than the sliding window, on every CPU attention backend, and from a
gemma3 GGUF file (norms stored as 1 + w) that both load."""

from __future__ import annotations

import random

import pytest
import torch

from treadle import LLM, SamplingParams

WINDOW = 24
PROMPT_LENGTHS = (5, 47, 90)
MAX_TOKENS = (24, 30, 20)


def make_gemma3(path, **overrides) -> str:
    import transformers

    settings = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
        sliding_window_pattern=2, query_pre_attn_scalar=24, rope_local_base_freq=10_000.0,
        rope_theta=1_000_000.0, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    config = transformers.Gemma3TextConfig(**{**settings, **overrides})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():  # (1 + w) norms start at w = 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt_list, max_tokens) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt, n in zip(prompt_list, max_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def hf_tokens(model_dir: str, **kwargs) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # eager: the attention path that applies attn_logit_softcapping
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager", **kwargs).eval()
    return hf_greedy(model, prompts(), MAX_TOKENS)


def treadle_tokens(model: str, **options) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", num_kv_blocks=512, **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    kv = llm.engine.scheduler.kv
    for pool in (kv.pool, kv.sliding.pool) if kv.sliding is not None else (kv.pool,):
        assert pool.num_free_blocks == pool.num_blocks
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model_dir = make_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
    return model_dir, hf_tokens(model_dir)


def test_the_window_changes_the_answer(gemma3):
    """The checkpoint and prompts are such that a model without the window answers
    otherwise: the equality tests below could not pass while ignoring it."""
    import transformers

    model_dir, reference = gemma3
    wide = transformers.AutoConfig.from_pretrained(model_dir)
    wide.sliding_window = 4096
    assert hf_tokens(model_dir, config=wide) != reference


@pytest.mark.parametrize("options", [
    dict(attention_backend="reference", block_size=4, max_num_batched_tokens=32),
    dict(attention_backend="torch", block_size=4, max_num_batched_tokens=29,
         enable_prefix_caching=False),
], ids=["reference-block4", "torch-block4"])  # cpu-native: test_sliding_blocks_are_freed...
def test_greedy_tokens_match_transformers(gemma3, options):
    model_dir, reference = gemma3
    assert max(PROMPT_LENGTHS) > 3 * WINDOW
    got = treadle_tokens(model_dir, **options)
    for i, (out, ref) in enumerate(zip(got, reference)):
        assert out == ref, f"prompt {i} (length {PROMPT_LENGTHS[i]}) differs"


def test_sliding_blocks_are_freed_mid_request(gemma3, monkeypatch):
    """With a sliding pool smaller than the prompts need, the sliding layers' blocks leave
    as the window moves on, and the tokens still equal transformers'."""
    from treadle.core.kv.sliding import SlidingWindowManager

    model_dir, reference = gemma3
    held = []
    allocate = SlidingWindowManager.allocate

    def spy(self, request, num_hit_blocks, hit, num_new_tokens):
        allocate(self, request, num_hit_blocks, hit, num_new_tokens)
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens_after = num_computed + num_new_tokens
        lo = max(0, num_computed - self.window + 1)
        bound = (num_tokens_after - 1) // self.block_size - lo // self.block_size + 1
        held.append((self.num_held_blocks(request_id), bound, len(self._ids[request_id]),
                     self.pool.num_blocks))

    monkeypatch.setattr(SlidingWindowManager, "allocate", spy)
    got = treadle_tokens(model_dir, attention_backend="native", block_size=4,
                         max_num_batched_tokens=16, max_num_seqs=2)
    assert got == reference
    assert all(n <= bound for n, bound, _, _ in held)
    longest = max(length for _, _, length, _ in held)
    pool = held[0][3]
    assert longest > pool  # one request's table outgrew the whole sliding pool
    assert pool < 512  # and the pool is smaller than without the window


def test_gguf_gemma3_matches_transformers_on_the_same_file(tmp_path):
    """A gemma3 GGUF as llama.cpp writes it (every norm + 1, no local RoPE base, layer
    pattern or query scale in the file): transformers (gguf_file=) and treadle agree."""
    from gguf_files import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    # head_dim 256 = transformers' default query_pre_attn_scalar for a GGUF Gemma 3
    model_dir = make_gemma3(tmp_path / "hf", num_hidden_layers=6, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                            sliding_window=20, sliding_window_pattern=6,
                            final_logit_softcapping=None, attn_logit_softcapping=None)
    gguf_path = write_tiny_gguf(model_dir, tmp_path / "tiny-gemma3.gguf", "gemma3")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    assert hf.config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    reference = hf_greedy(hf, prompts(), MAX_TOKENS)
    assert treadle_tokens(str(gguf_path), block_size=8) == reference


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """Mistral's `sliding_window` (every layer) runs past the window instead of capping the
    context there."""
    from conftest import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, "mistral", sliding_window=WINDOW)
    reference = hf_tokens(model_dir)
    llm_tokens = treadle_tokens(model_dir, attention_backend="native", block_size=8,
                                max_num_batched_tokens=40)
    assert llm_tokens == reference


def test_prefix_hits_with_a_sliding_group(gemma3):
    """Requests sharing a prefix longer than the window, on a small KV cache (the sliding
    group's blocks before the window are freed, then hit while still cached-free or cut
    where evicted): tokens still equal transformers' run of the same prompts."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = gemma3
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(70)]
    prompt_list = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 20)]
    max_tokens = [12, 12, 12]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    reference = hf_greedy(hf, prompt_list, max_tokens)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=40, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=4, attention_backend="torch")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt_list[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompt_list[1:]], params,
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == reference
    assert llm.engine.scheduler.kv.prefix_stats.num_hit_tokens >= 2 * 64


def test_sliding_layers_with_an_int8_cache_equal_the_reference_backend(gemma3):
    """Gemma 3's sliding group with a quantized KV cache (issue 18 meets issue 13): the
    cpu-native backend (the torch windowed path for sliding layers, the C int8 kernels for
    the full ones) gives the reference backend's greedy tokens on the same int8 cache."""
    model_dir, _ = gemma3
    options = dict(kv_cache_dtype="int8", block_size=4, max_num_batched_tokens=32)
    native = treadle_tokens(model_dir, attention_backend="native", **options)
    reference = treadle_tokens(model_dir, attention_backend="reference", **options)
    assert native == reference
