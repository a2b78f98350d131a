"""SamplingParams validation: each bad value is a ValueError that starts with the field's
name and states the allowed range; good values are normalized."""

from __future__ import annotations

import pytest

from treadle.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field, allowed", [
    (dict(temperature=-0.1), "temperature", "[0.0, 100.0]"),
    (dict(top_p=0.0), "top_p", "(0.0, 1.0]"),
    (dict(top_k=-1), "top_k", ">= 0"),
    (dict(min_p=1.5), "min_p", "[0.0, 1.0]"),
    (dict(min_p=float("nan")), "min_p", "number"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "(0.0, 100.0]"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "[-2.0, 2.0]"),
    (dict(seed=2**63), "seed", "[0, 9223372036854775807]"),
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "[0, 4]"),
    (dict(stop=""), "stop", "non-empty"),
    (dict(stop=["ok", 3]), "stop", "non-empty strings"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids", ">= 0"),
    (dict(ignore_eos=1), "ignore_eos", "bool"),
    (dict(skip_special_tokens="no"), "skip_special_tokens", "bool"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output", "bool"),
    (dict(logprobs=21), "logprobs", "[0, 20]"),
    (dict(prompt_logprobs=-2), "prompt_logprobs", "[0, 20]"),
    (dict(n=0), "n", "[1, 128]"),
    (dict(logit_bias={5: 101.0}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", ">= 0"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias", "at most 300"),
    (dict(logit_bias=[1, 2]), "logit_bias", "dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "non-empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids", ">= 0"),
    (dict(bad_words=["ok", ""]), "bad_words", "non-empty"),
    (dict(spaces_between_special_tokens=0), "spaces_between_special_tokens", "bool"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens", ">= 1"),
    (dict(cache_salt=""), "cache_salt", "1 to 1024"),
    (dict(dry_multiplier=-0.5), "dry_multiplier", "[0.0, 100.0]"),
    (dict(dry_base=0.9), "dry_base", "[1.0, 100.0]"),
    (dict(dry_allowed_length=-1), "dry_allowed_length", "[0, 1000000]"),
    (dict(dry_penalty_last_n=-1), "dry_penalty_last_n", ">= 0"),
    (dict(dry_sequence_breakers=[]), "dry_sequence_breakers", "1 to 64"),
    (dict(dry_sequence_breakers=["x" * 41]), "dry_sequence_breakers", "1 to 40 characters"),
    (dict(xtc_probability=1.5), "xtc_probability", "[0.0, 1.0]"),
    (dict(xtc_threshold=-0.1), "xtc_threshold", "[0.0, 1.0]"),
    (dict(temperature=0, xtc_probability=0.5), "xtc_probability", "greedy"),
])
def test_bad_values_name_the_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.split(" ", 1)[0] == field  # the server reports this as the parameter
    assert allowed in message


def test_good_values_are_normalized():
    p = SamplingParams(stop="###", stop_token_ids=(4, 5), logit_bias={"7": 1, 8: -2.5},
                       logprobs=0, prompt_logprobs=20, n=4, seed=2**63 - 2, min_tokens=16)
    assert p.stop == ["###"] and p.stop_token_ids == [4, 5]
    assert p.logit_bias == {7: 1.0, 8: -2.5}
    assert SamplingParams().stop == [] and SamplingParams(temperature=0).is_greedy


def test_samples_of_an_n_request_get_consecutive_seeds():
    p = SamplingParams(n=3, seed=2**63 - 2, stop=["x"])
    samples = [p.for_sample(i) for i in range(3)]
    assert [s.seed for s in samples] == [2**63 - 2, 2**63 - 1, 0]
    assert all(s.n == 1 and s.stop == ["x"] for s in samples)
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_token_ids_are_checked_against_the_vocabulary():
    assert SamplingParams(logit_bias={10: 1.0}).token_id_error(11) is None
    error = SamplingParams(logit_bias={3: 1.0, 11: 1.0}).token_id_error(11)
    assert error.startswith("logit_bias") and "11" in error and "[0, 11)" in error


def test_xtc_opts_a_request_out_of_speculation():
    assert SamplingParams().allows_speculation
    assert not SamplingParams(xtc_probability=0.5).allows_speculation
    assert SamplingParams(xtc_probability=0.5, xtc_threshold=0.6).allows_speculation  # off
    assert not SamplingParams(speculative=False).allows_speculation
