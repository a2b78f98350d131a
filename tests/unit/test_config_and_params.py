"""Config and SamplingParams validation: every bad value names its field and limit."""

from __future__ import annotations

import argparse

import pytest

from treadle.config import (CacheConfig, EngineConfig, SchedulerConfig, add_config_arguments,
                            options_from_args, parse_size)
from treadle.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-3), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
    (dict(n=0), "n"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_sampling_params():
    p = SamplingParams(max_tokens=5, temperature=0, top_p=0.5, top_k=3, seed=7,
                       stop_token_ids=(4, 5))
    assert p.is_greedy and p.stop_token_ids == [4, 5]


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 1024**3), ("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9), ("1000", 1000),
    (123, 123), ("1.5KiB", 1536),
])
def test_parse_size(text, expected):
    assert parse_size(text, "kv_cache_memory") == expected


@pytest.mark.parametrize("bad", ["4 parsecs", "-1", "GiB", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size(bad, "kv_cache_memory")


def test_engine_config_from_flat_options():
    cfg = EngineConfig.from_options(model="/m", block_size=8, max_num_seqs=3,
                                    kv_cache_memory="1MiB")
    assert cfg.model.model == "/m"
    assert cfg.cache == CacheConfig(block_size=8, kv_cache_memory=1024**2)
    assert cfg.scheduler.max_num_seqs == 3
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineConfig.from_options(max_num_sequences=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_options(dtype="float16x")


def test_cli_flags_are_generated_from_config():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--block-size", "32", "--no-enable-prefix-caching",
                              "--kv-cache-memory", "3GiB"])
    options = options_from_args(args)
    assert options == {"block_size": 32, "enable_prefix_caching": False,
                       "kv_cache_memory": "3GiB"}
    assert EngineConfig.from_options(**options).cache.kv_cache_memory == 3 * 1024**3
