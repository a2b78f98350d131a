"""Which features can run together: every refusal of a combination, in one place.

Each participant in a check is an `Element`: a KV spec (core/kv/specs.py: full
attention, a sliding-window group, H2O eviction), the KV cache dtype, or a feature of the
configuration (speculative decoding and its method, tensor / pipeline parallelism, a
named attention backend, P/D disaggregation, prefix caching off, replicas behind the
server). An element declares the capabilities it `needs` of every other element and the
ones it `lacks`, each with the reason; two elements conflict when one needs what the
other lacks, and the error names both and says why: "<lacking> does not support
<needing>: <why>". The specs declare their capabilities themselves (`supports_*`,
`why_not`); the features' are declared below. No rule is written as a pair of names.

Where the checks run, all at start:
- `check_config`: EngineConfig.__post_init__ (LLM, `treadle serve`, every replica), for
  what the configuration alone tells.
- `check_kv_specs`: core/kv/config.py, once the model's layers (and so its sliding
  group) are known: the engine core when it sizes the KV cache, before any tensor.
- `check_disaggregation`: P/D, before Ray starts (ReplicaSet) and on each P/D engine
  once its KV specs are known (PDEngine).
- `check_serving`: `treadle serve` (and `--replicas`), for what the server's and the
  replicas' options add.

Each config section still validates its own fields (ranges, choices, one section's
fields among themselves: CacheConfig, ParallelConfig, SpeculativeConfig ...); this module
owns combinations across sections and with the model. Pure Python: no torch, and no
import of the config module (it calls in here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from treadle.core.kv.specs import (ATTENTION_BACKENDS, CACHE_DTYPES, CAPABILITIES, KVSpec,
                                   primary_spec)


@dataclass(frozen=True)
class Element:
    """One participant in a combination check."""

    name: str
    """How the error message names it, as the user set it ("kv_eviction h2o")."""
    needs: frozenset[str] = frozenset()
    lacks: dict[str, str] = field(default_factory=dict)
    """capability -> why it lacks it."""


def spec_element(spec: KVSpec) -> Element:
    """A KV spec's declared capabilities as an element."""
    lacks = {c: spec.why_not[c] for c in CAPABILITIES if not spec.supports(c)}
    needs = frozenset({"eviction"} if spec.eviction is not None else ())
    return Element(spec.name, needs, lacks)


def _cache_dtype_element(name: str) -> Element:
    return Element(f"kv_cache_dtype {name}", frozenset({f"reads {name}"}))


def _backend_element(backend: str) -> Element:
    """A named attention backend: it lacks every cache dtype it cannot read."""
    reads = [d for d, spec in CACHE_DTYPES.items() if backend in spec.backends]
    why = f"it reads {', '.join(reads)}"
    return Element(f"attention_backend {backend}",
                   lacks={f"reads {d}": why for d in CACHE_DTYPES if d not in reads})


SHARDING = Element("tensor_parallel_size or pipeline_parallel_size > 1",
                   frozenset({"sharding"}))
DISAGGREGATION = Element("P/D disaggregation", frozenset({"prefix_transfer"}))
PREFIX_CACHING_OFF = Element("enable_prefix_caching off", lacks={
    "prefix_transfer": "P/D lands KV as prefix-cache blocks: enable_prefix_caching must "
                       "be on"})
PIPELINE = Element("pipeline_parallel_size > 1", lacks={
    "prefix_transfer": "P/D's KV reads and writes reach the workers between steps, and "
                       "pipeline stages keep steps in flight (tensor_parallel_size is "
                       "supported)"})
REPLICAS = Element("replicas", frozenset({"one_engine_steps"}))
STEP_RECORDER = Element("the dashboard, request timelines and OTLP spans", lacks={
    "one_engine_steps": "they read one engine's steps: with replicas, serve with "
                        "--no-dashboard --request-timelines 0 and no "
                        "--otlp-traces-endpoint"})
SERVED_ADAPTERS = Element("lora_modules and enable_lora_runtime_updates",
                          frozenset({"lora"}))
LORA_OFF = Element("enable_lora off", lacks={
    "lora": "adapters are served only with enable_lora (lora_modules and "
            "enable_lora_runtime_updates need enable_lora)"})
SLO_REJECT = Element("slo_reject", frozenset({"deadline_prediction"}))


def _policy_element(policy: str) -> Element:
    """The scheduling policy: only `slo` predicts when a request's first token comes."""
    lacks = ({} if policy == "slo" else {
        "deadline_prediction": "only the slo policy predicts a request's first token from "
                               "the measured step costs (scheduling_policy slo)"})
    return Element(f"scheduling_policy {policy}", lacks=lacks)


SPECULATION_LACKS = {
    "prefix_transfer": "the prefill engine's proposals and a draft's KV are not transferred",
}
SELF_SPECULATION_LACKS = {
    "sharding": "it runs the target's first layers on the output rank alone, which holds "
                "only its shard of them (method ngram and method draft do)",
}


def _speculation_element(method: str) -> Element:
    """Speculative decoding: every method needs room to roll back proposed tokens; a
    draft model's (or the target's first layers') KV rides on the target's block ids."""
    needs = {"speculation"} | ({"draft_kv"} if method in ("draft", "self") else set())
    lacks = dict(SPECULATION_LACKS)
    if method == "self":
        lacks.update(SELF_SPECULATION_LACKS)
    return Element(f"speculative_config (method {method})", frozenset(needs), lacks)


def config_elements(config: Any) -> list[Element]:
    """The features an EngineConfig turns on, as elements (its KV specs excluded)."""
    elements = [_cache_dtype_element(config.cache.kv_cache_dtype)]
    if config.speculative.enabled:
        elements.append(_speculation_element(config.speculative.method))
    if config.parallel.world_size > 1:
        elements.append(SHARDING)
    if config.parallel.pipeline_parallel_size > 1:
        elements.append(PIPELINE)
    backend = config.model.attention_backend
    if backend in ATTENTION_BACKENDS:  # auto (and an alias) is the worker's choice
        elements.append(_backend_element(backend))
    if not config.cache.enable_prefix_caching:
        elements.append(PREFIX_CACHING_OFF)
    elements.append(_policy_element(config.scheduler.scheduling_policy))
    if config.scheduler.slo_reject:
        elements.append(SLO_REJECT)
    return elements


def check(elements: Sequence[Element]) -> None:
    """Raise ValueError naming the first two elements that cannot run together, and why."""
    for lacking in elements:
        if not lacking.lacks:
            continue
        for needing in elements:
            if needing is lacking:
                continue
            for capability in sorted(needing.needs):
                if capability in lacking.lacks:
                    raise ValueError(f"{lacking.name} does not support {needing.name}: "
                                     f"{lacking.lacks[capability]}")


def check_config(config: Any) -> None:
    """What the configuration alone tells (EngineConfig.__post_init__)."""
    check([spec_element(primary_spec(config.cache)), *config_elements(config)])


def check_kv_specs(config: Any, specs: Iterable[KVSpec]) -> None:
    """The KV specs the model's layers give, with the configured features."""
    check([*(spec_element(s) for s in specs), *config_elements(config)])


def check_disaggregation(config: Any, specs: Iterable[KVSpec] | None = None) -> None:
    """P/D with this configuration (and, once known, the model's KV specs)."""
    specs = [primary_spec(config.cache)] if specs is None else list(specs)
    check([*(spec_element(s) for s in specs), *config_elements(config), DISAGGREGATION])


def check_serving(config: Any, server_config: Any, replica_config: Any = None) -> None:
    """What `treadle serve`'s options add: adapters named without LoRA, the step recorder
    with replicas, and P/D's rules when the replicas are disaggregated."""
    elements = []
    if server_config.lora_modules or server_config.enable_lora_runtime_updates:
        elements.append(SERVED_ADAPTERS)
    if not config.lora.enable_lora:
        elements.append(LORA_OFF)
    if replica_config is not None and replica_config.on_ray:
        elements.append(REPLICAS)
    if (server_config.dashboard or server_config.request_timelines
            or server_config.otlp_traces_endpoint):
        elements.append(STEP_RECORDER)
    check(elements)
    if replica_config is not None and replica_config.on_ray and replica_config.disaggregated:
        check_disaggregation(config)


def check_attention_backend(backend: str, kv_cache_dtype: str) -> None:
    """A backend named for a cache dtype (worker/attention's `make_attention_backend`)."""
    check([_cache_dtype_element(kv_cache_dtype), _backend_element(backend)])


def backends_reading() -> dict[str, tuple[str, ...]]:
    """Attention backend -> the cache dtypes it reads and writes (from CACHE_DTYPES)."""
    return {b: tuple(d for d, spec in CACHE_DTYPES.items() if b in spec.backends)
            for b in ATTENTION_BACKENDS}
