"""The offline API: a prompt that is not a prompt fails alone, with an error output.

Each of these used to raise out of the whole `generate()` call (OverflowError for ids
beyond int64, TypeError for floats in a dict or an unencodable string, ValueError for a
float in a list), losing every other prompt's output."""

from __future__ import annotations

import numpy as np
import pytest

from treadle import LLM, SamplingParams
from treadle.models.demo import write_demo_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=3,
                            config_overrides=TINY)
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64)


BAD = [
    ([5, -1], "-1"),
    ([5, 1.5], "1.5"),
    ([5, 2**70], str(2**70)),
    ({"prompt_token_ids": [1.5, 2]}, "1.5"),
    ({"prompt_token_ids": [2**64]}, str(2**64)),
    ({"prompt_token_ids": [7, True]}, "True"),
    ({"prompt_token_ids": [5, 49152]}, "49152"),  # one past the vocabulary
    ({"prompt_token_ids": "abc"}, "list of token ids"),
    ("lone \ud800 surrogate", "surrogate"),
    ({"prompt": "\udfff"}, "surrogate"),
    ({"neither": 1}, "prompt_token_ids"),
    (None, "NoneType"),
]


@pytest.mark.parametrize("bad, says", BAD, ids=[repr(b)[:24] for b, _ in BAD])
def test_a_bad_prompt_fails_alone(llm, bad, says):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([[10, 11, 12], bad, "a good text prompt"], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert says in outs[1].error
    assert outs[1].finished and outs[1].outputs[0].token_ids == []
    assert len(outs[0].outputs[0].token_ids) == len(outs[2].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


def test_numpy_token_ids_are_token_ids(llm):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": np.array([10, 11, 12])}], params,
                          use_tqdm=False)
    (plain,) = llm.generate([[10, 11, 12]], params, use_tqdm=False)
    assert out.error is None and out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.prompt_token_ids == [10, 11, 12]
