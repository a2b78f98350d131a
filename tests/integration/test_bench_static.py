"""The static-batching baseline runs a tiny random Llama, ignores EOS, and counts padding."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from treadle.bench.static import batches_in_order, generate_batch, load_model, run_static  # noqa: E402
from treadle.measure.workloads import synthetic  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, initializer_range=0.2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_run_static_counts(tiny_llama):
    workload = synthetic(num_requests=6, prompt_len=(3, 12), output_len=(2, 10), num_long=0,
                         vocab_size=512, seed=0)
    result = run_static(str(tiny_llama), workload, batch_size=4, dtype="float32", progress=False)
    expected_generated = sum(len(b) * max(r.max_tokens for r in b)
                             for b in batches_in_order(workload.requests, 4))
    assert result["num_batches"] == 2
    assert result["useful_output_tokens"] == workload.total_output_tokens
    assert result["generated_tokens"] == expected_generated
    assert result["prompt_tokens"] == workload.total_prompt_tokens
    assert [b["num_requests"] for b in result["per_batch"]] == [4, 2]
    for key in ("wall_s", "output_tokens_per_s", "total_tokens_per_s", "requests_per_s",
                "generated_tokens_per_s"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["predicted_continuous_gain"] >= 1.0
    for b in result["per_batch"]:
        assert b["predicted_continuous_gain"] >= 1.0 and b["wall_s"] > 0


def test_generate_ignores_eos(tiny_llama, tmp_path):
    model = load_model(str(tiny_llama), "float32")
    prompt = [5, 17, 42, 99]
    first = generate_batch(model, [prompt], 1, pad_id=0)[0, 0].item()
    # Make the greedy first token the EOS: plain generate would stop after one token.
    model.generation_config.eos_token_id = first
    model.config.eos_token_id = first
    plain = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                           pad_token_id=0)
    assert plain.shape[1] == len(prompt) + 1
    new = generate_batch(model, [prompt, prompt[:2]], 8)
    assert tuple(new.shape) == (2, 8)
    assert (new != first).all()  # EOS is suppressed, never merely padded over
