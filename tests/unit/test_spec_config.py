"""`speculative_config`: parsing (dict, JSON, flag, environment), and errors that name the
key and its limit."""

from __future__ import annotations

import argparse

import pytest

from treadle.config import (EngineConfig, SpeculativeConfig, add_config_arguments,
                            options_from_args)
from treadle.sampling_params import SamplingParams
from treadle.server.protocol import ChatCompletionRequest, CompletionRequest


def test_off_by_default():
    config = EngineConfig.from_options()
    assert not config.speculative.enabled


def test_dict_and_json_give_the_same_config():
    a = EngineConfig.from_options(speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 3})
    b = EngineConfig.from_options(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert a.speculative == b.speculative
    assert a.speculative.prompt_lookup_min == 2 and a.speculative.prompt_lookup_max == 4


def test_command_line_flag_and_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "self", "draft_layers": 2}'])
    config = EngineConfig.from_options(**options_from_args(args))
    assert config.speculative.method == "self" and config.speculative.draft_layers == 2
    monkeypatch.setenv("TREADLE_SPECULATIVE_CONFIG", '{"method": "ngram"}')
    assert EngineConfig.from_options().speculative.method == "ngram"


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa"}, "method must be one of ngram, draft, self"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "[1, 16]"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "draft_layers": 2}, "draft_layers is a key of method self"),
    ({"method": "draft"}, "method draft needs model"),
    ({"method": "self"}, "method self needs draft_layers"),
    ({"method": "self", "draft_layers": 0}, "draft_layers"),
    ({"method": "ngram", "acceptance_prior": 1.5}, "acceptance_prior"),
    ({"num_speculative_tokens": 3}, "without a method"),
    ({"method": "ngram", "lookahead": 3}, "unknown key 'lookahead'"),
    ("{not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
])
def test_errors_name_the_key(value, words):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(value)
    assert words in str(info.value)
    assert "speculative_config" in str(info.value)


def test_self_refuses_tensor_and_pipeline_parallelism():
    for option in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ValueError, match="does not support tensor_parallel_size"):
            EngineConfig.from_options(speculative_config={"method": "self", "draft_layers": 2},
                                      distributed_executor_backend="mp", **{option: 2})
    # ngram and draft do
    EngineConfig.from_options(speculative_config={"method": "ngram"},
                              distributed_executor_backend="mp", tensor_parallel_size=2)


def test_per_request_opt_out_is_a_validated_field():
    assert SamplingParams().speculative is True
    assert SamplingParams(speculative=False).speculative is False
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative="no")
    assert CompletionRequest(prompt="x", speculative=False).speculative is False
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).speculative
