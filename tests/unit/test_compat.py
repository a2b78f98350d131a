"""Feature combinations are refused in one place (treadle/compat.py), from the KV specs'
and the features' declared capabilities, with one error naming both and why; `LLM(...)`,
`treadle serve` and `treadle serve --replicas` reach it at start (issue 48, item 3)."""

from __future__ import annotations

import pytest

from treadle import compat
from treadle.config import EngineConfig
from treadle.server.config import ServerConfig
from treadle.kv_specs.specs import (CACHE_DTYPES, FullAttentionSpec, H2OSpec, SlidingWindowSpec,
                                   primary_spec)
from treadle.distributed.config import ReplicaConfig

H2O = dict(kv_eviction="h2o", kv_budget_tokens=64)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("options, first, second", [
    (dict(**H2O, distributed_executor_backend="mp", tensor_parallel_size=2),
     "kv_eviction h2o", "tensor_parallel_size"),
    (dict(**H2O, distributed_executor_backend="mp", pipeline_parallel_size=2),
     "kv_eviction h2o", "pipeline_parallel_size"),
    (dict(**H2O, speculative_config=NGRAM), "kv_eviction h2o", "speculative_config"),
    (dict(speculative_config={"method": "self", "draft_layers": 1},
          distributed_executor_backend="mp", tensor_parallel_size=2),
     "method self", "tensor_parallel_size"),
    (dict(kv_cache_dtype="fp8_e4m3", attention_backend="cpu-native"),
     "attention_backend cpu-native", "kv_cache_dtype fp8_e4m3"),
    (dict(kv_cache_dtype="int8", attention_backend="triton"),
     "attention_backend triton", "kv_cache_dtype int8"),
])
def test_the_config_refuses_a_combination_naming_both(options, first, second):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options(**options)
    message = str(info.value)
    assert first in message and second in message and "does not support" in message
    assert message.split(": ", 1)[1]  # and why


def test_what_combines_is_accepted():
    EngineConfig.from_options(speculative_config=NGRAM, distributed_executor_backend="mp",
                              tensor_parallel_size=2)
    EngineConfig.from_options(**H2O, kv_cache_dtype="int8", preemption_mode="swap")
    for dtype, spec in CACHE_DTYPES.items():
        for backend in spec.backends:
            EngineConfig.from_options(kv_cache_dtype=dtype, attention_backend=backend)


def sliding(window: int = 32) -> SlidingWindowSpec:
    return SlidingWindowSpec(16, window=window)


@pytest.mark.parametrize("options, words", [
    (H2O, "kv_eviction h2o"),
    (dict(speculative_config={"method": "draft", "model": "/d", "num_speculative_tokens": 2}),
     "method draft"),
    (dict(speculative_config={"method": "self", "draft_layers": 1}), "method self"),
])
def test_a_sliding_window_group_refuses_what_it_cannot_serve(options, words):
    config = EngineConfig.from_options(**options)
    with pytest.raises(ValueError, match="sliding-window layer group") as info:
        compat.check_kv_specs(config, [primary_spec(config.cache), sliding()])
    assert words in str(info.value)


def test_a_sliding_window_group_serves_ngram_speculation():
    config = EngineConfig.from_options(speculative_config=NGRAM)
    compat.check_kv_specs(config, [FullAttentionSpec(16), sliding()])


@pytest.mark.parametrize("options, specs, words", [
    (H2O, None, "kv_eviction h2o"),
    (dict(speculative_config=NGRAM), None, "speculative_config"),
    (dict(enable_prefix_caching=False), None, "enable_prefix_caching"),
    ({}, [FullAttentionSpec(16), sliding()], "sliding-window layer group"),
])
def test_disaggregation_refuses_what_it_cannot_move(options, specs, words):
    config = EngineConfig.from_options(**options)
    with pytest.raises(ValueError, match="P/D disaggregation") as info:
        compat.check_disaggregation(config, specs)
    assert words in str(info.value)
    compat.check_disaggregation(EngineConfig())  # plain full attention moves


def test_serving_options_are_checked_with_the_engine_and_the_replicas():
    config = EngineConfig()
    with pytest.raises(ValueError, match="enable_lora"):
        compat.check_serving(config, ServerConfig(lora_modules=["a=/x"]))
    recorder = ServerConfig(dashboard=True)
    with pytest.raises(ValueError, match="--no-dashboard") as info:
        compat.check_serving(config, recorder, ReplicaConfig(replicas=2))
    assert "replicas" in str(info.value)
    compat.check_serving(config, recorder)  # one engine: it reads its steps
    quiet = ServerConfig(dashboard=False, request_timelines=0)
    compat.check_serving(config, quiet, ReplicaConfig(replicas=2))
    with pytest.raises(ValueError, match="P/D disaggregation"):
        compat.check_serving(EngineConfig.from_options(**H2O), quiet,
                             ReplicaConfig(prefill_replicas=1, decode_replicas=1))


def test_specs_declare_why_they_lack_each_capability():
    for spec in (FullAttentionSpec(16), sliding(), H2OSpec(16, budget=primary_spec(
            EngineConfig.from_options(**H2O).cache).budget)):
        for capability in compat.CAPABILITIES:
            assert spec.supports(capability) or spec.why_not[capability]


def test_every_entry_point_reaches_the_check_at_start(monkeypatch, capsys):
    """LLM(...) and `treadle serve` (with or without replicas) refuse before any model is
    loaded or Ray is started."""
    from treadle import LLM
    from treadle.cli import main
    from treadle.server import serve as serve_module

    with pytest.raises(ValueError, match="kv_eviction h2o does not support"):
        LLM(model="/nowhere", **H2O, speculative_config=NGRAM)

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started before the check")

    monkeypatch.setattr(serve_module, "make_engine", no_engine)
    for argv in (["serve", "--model", "/nowhere", "--kv-eviction", "h2o",
                  "--kv-budget-tokens", "64", "--speculative-config", '{"method": "ngram"}'],
                 ["serve", "--model", "/nowhere", "--replicas", "2", "--dashboard"],
                 ["serve", "--model", "/nowhere", "--prefill-replicas", "1",
                  "--decode-replicas", "1", "--no-enable-prefix-caching"]):
        assert main(argv) == 2
        assert "does not support" in capsys.readouterr().err


BATCH_INVARIANT = dict(batch_invariant=True)


@pytest.mark.parametrize("options, lacking", [
    (dict(attention_backend="torch"), "attention_backend torch"),
    (dict(attention_backend="reference"), "attention_backend reference"),
    (dict(attention_backend="triton"), "attention_backend triton"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(device="cuda"), "device cuda"),
    (dict(distributed_executor_backend="mp", tensor_parallel_size=2),
     "tensor_parallel_size > 1"),
    (dict(enable_lora=True), "enable_lora"),
    (H2O, "kv_eviction h2o"),
])
def test_batch_invariance_is_refused_with_what_cannot_give_it(options, lacking):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options(**BATCH_INVARIANT, **options)
    message = str(info.value)
    assert message.startswith(f"{lacking} does not support batch_invariant: ")
    EngineConfig.from_options(**options)  # alone it runs


def test_batch_invariance_combines_with_the_rest():
    EngineConfig.from_options(**BATCH_INVARIANT, attention_backend="cpu-native",
                              dtype="bfloat16", kv_cache_dtype="int8", speculative_config=NGRAM,
                              distributed_executor_backend="mp", pipeline_parallel_size=2,
                              max_num_batched_tokens=16, enable_prefix_caching=False)
    config = EngineConfig.from_options(**BATCH_INVARIANT)
    with pytest.raises(ValueError, match="a sliding-window layer group .* does not support "
                                         "batch_invariant"):
        compat.check_kv_specs(config, [FullAttentionSpec(16), sliding()])


@pytest.mark.parametrize("run, lacking", [
    (dict(backend="torch"), "attention_backend torch"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(device="cuda", backend="triton"), "attention_backend triton"),
    (dict(device="cuda"), "device cuda"),
    (dict(linear_kernels=False), "without the C linear kernels"),
    (dict(softcapped_layers=True), "logit-softcapped attention layers"),
])
def test_what_a_worker_chose_under_auto_is_checked_too(run, lacking):
    """`auto` (backend, dtype, device) resolved on the worker, and what only the model and
    the CPU tell: refused at load, before the KV cache."""
    facts = dict(backend="cpu-native", dtype="bfloat16", device="cpu", linear_kernels=True,
                 softcapped_layers=False)
    compat.check_batch_invariant_run(**facts)
    with pytest.raises(ValueError, match=f"{lacking}.* does not support batch_invariant: "):
        compat.check_batch_invariant_run(**{**facts, **run})
