"""Offline prompt scoring: max_tokens=0 with prompt_logprobs generates nothing and returns
the prompt's logprobs; offline structured outputs: every sample matches its grammar
(sampled at temperature 1, beside unconstrained requests in the same steps), and a model
without a tokenizer refuses a grammar instead of running unconstrained."""

from __future__ import annotations

import pytest

from treadle import LLM, SamplingParams
from treadle.models.demo import write_demo_model
from treadle.structured import from_structured_outputs

TINY_DEMO = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.2)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=4,
                            config_overrides=TINY_DEMO)
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm):
    scored, generated = llm.generate(
        ["The quick brown fox jumps", "The quick brown fox jumps"],
        [SamplingParams(max_tokens=0, prompt_logprobs=2),
         SamplingParams(max_tokens=3, prompt_logprobs=2, temperature=0, ignore_eos=True)],
        use_tqdm=False)
    out = scored.outputs[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert scored.prompt_logprobs[0] is None
    assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    for k in range(1, len(scored.prompt_token_ids)):
        token = scored.prompt_token_ids[k]
        assert scored.prompt_logprobs[k][token].logprob == pytest.approx(
            generated.prompt_logprobs[k][token].logprob, abs=1e-5)
    assert len(generated.outputs[0].token_ids) == 3


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_structured_outputs_always_match_offline(llm):
    import re

    regex = from_structured_outputs({"regex": "[0-9]{2,4}-[a-c]{1,3}"})
    choice = from_structured_outputs({"choice": ["alpha", "beta gamma"]})
    params = ([SamplingParams(max_tokens=12, temperature=1.0, seed=i, structured_outputs=regex)
               for i in range(6)]
              + [SamplingParams(max_tokens=12, temperature=1.0, seed=i, structured_outputs=choice,
                                logprobs=2) for i in range(4)]
              + [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True)
                 for i in range(4)])
    outs = llm.generate(["Write:"] * len(params), params, use_tqdm=False)
    for out in outs[:6]:
        assert re.fullmatch("[0-9]{2,4}-[a-c]{1,3}", out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    for out in outs[6:10]:
        assert out.outputs[0].text in ("alpha", "beta gamma")
        assert all(lp for lp in out.outputs[0].logprobs)  # raw logprobs still reported
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs[10:])


def test_structured_request_without_tokenizer_is_refused(tmp_path):
    from conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama")  # weights only, no tokenizer
    llm = LLM(model=path, dtype="float32", num_kv_blocks=16)
    params = SamplingParams(max_tokens=4,
                            structured_outputs=from_structured_outputs({"regex": "[0-9]+"}))
    with pytest.raises(ValueError, match="structured_outputs.*tokenizer"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)


def test_whole_vocabulary_prompt_logprobs_equal_transformers_across_chunks(tmp_path):
    """prompt_logprobs -1 (offline): every position's log-probabilities over the whole
    vocabulary as one float16 array, the same whatever the chunking (what `treadle bench
    quality` compares engines with); row 0 scores nothing."""
    import numpy as np
    import torch
    import transformers
    path = write_demo_model(tmp_path / "m", seed=4, config_overrides=TINY_DEMO)
    ids = list(range(5, 61))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
    for chunk in (16, 512):
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64,
                  max_num_batched_tokens=chunk)
        out, = llm.generate([{"prompt_token_ids": ids}],
                            SamplingParams(max_tokens=0, prompt_logprobs=-1), use_tqdm=False)
        array = out.prompt_logprob_array
        assert array.dtype == np.float16 and array.shape == (len(ids), reference.shape[1])
        assert np.isnan(array[0]).all() and out.prompt_logprobs is None
        assert np.abs(array[1:].astype(np.float32) - reference[:-1]).max() < 0.02
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=-2)
