"""Which features can run together: every refusal of a combination, in one place.

Each participant in a check is an `Element`: a KV spec (kv_specs/specs.py: full attention,
a sliding-window group, H2O eviction), the KV cache dtype, or a feature of the
configuration (speculative decoding and its method, tensor / pipeline parallelism, a named
attention backend, P/D disaggregation, prefix caching off, KV events, replicas behind the
server, overlapped steps and the executor). An element declares the capabilities it
`needs` of every other element and the ones it `lacks`, each with the reason; two elements
conflict when one needs what the other lacks, and the error names both and says why:
"<lacking> does not support <needing>: <why>". The specs declare their capabilities
themselves (`supports_*`, `why_not`); the features' are declared below. No rule is written
as a pair of names.

Batch invariance (`batch_invariant`, docs/batch_invariance.md) is the element
BATCH_INVARIANT, which needs `batch_invariance`; what cannot give it lacks it: the KV specs
that say so, the attention backends other than cpu-native, float32, a CUDA device, tensor
parallelism, LoRA, and, once the worker knows them (`check_batch_invariant_run`), the
backend `auto` chose, the dtype `auto` chose, a CPU without the C linear kernels and
logit-softcapped layers.

Where the checks run, all at start:
- `check_config`: EngineConfig.__post_init__ (LLM, `treadle serve`, every replica), for
  what the configuration alone tells.
- `check_kv_specs`: core/kv/config.py, once the model's layers (and so its sliding
  group) are known: the engine core when it sizes the KV cache, before any tensor.
- `check_disaggregation`: P/D, before Ray starts (`treadle serve`, and the Ray Serve
  application's engine deployments: integrations/ray_serve/app.py) and on each P/D
  engine once its KV specs are known (PDEngine).
- `check_serving`: `treadle serve` (and `--replicas`), for what the server's and the
  replicas' options add.
- `check_batch_invariant_run`: each worker, once its dtype, kernels and attention backend
  are chosen, before the KV cache is made.

Each config section still validates its own fields (ranges, choices, one section's
fields among themselves: CacheConfig, ParallelConfig, SpeculativeConfig ...); this module
owns combinations across sections and with the model. Pure Python: no torch, and no
import of the config module (it calls in here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from treadle.kv_specs.specs import (ATTENTION_BACKENDS, CACHE_DTYPES, CAPABILITIES, KVSpec,
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
    """A named attention backend: it lacks every cache dtype it cannot read, and batch
    invariance unless it is cpu-native."""
    reads = [d for d, spec in CACHE_DTYPES.items() if backend in spec.backends]
    why = f"it reads {', '.join(reads)}"
    lacks = {f"reads {d}": why for d in CACHE_DTYPES if d not in reads}
    if backend in INVARIANCE_LACKING_BACKENDS:
        lacks["batch_invariance"] = INVARIANCE_LACKING_BACKENDS[backend]
    return Element(f"attention_backend {backend}", lacks=lacks)


BATCH_INVARIANT = Element("batch_invariant", frozenset({"batch_invariance"}))
INVARIANCE_LACKING_BACKENDS = {
    "torch": "its attention runs torch's matmuls, whose kernels change with the step's "
             "shapes (cpu-native is batch-invariant)",
    "reference": "it is the float32 test oracle, on torch's matmuls (cpu-native is "
                 "batch-invariant)",
    "triton": "its decode split and prefill tiles follow the step's shapes (cpu-native, "
              "on the CPU, is batch-invariant)",
}
FLOAT32 = Element("dtype float32", lacks={
    "batch_invariance": "the kernels that fix each sum's order whatever the rows are "
                        "bf16; float32 linears run on torch (MKL), whose kernels change "
                        "with the rows"})
CUDA = Element("device cuda", lacks={
    "batch_invariance": "the GPU's linears (cuBLAS) and Triton attention choose their "
                        "tiling by the step's shapes; it is built for the CPU kernels"})
TENSOR_PARALLEL = Element("tensor_parallel_size > 1", lacks={
    "batch_invariance": "the all-reduce adds the ranks' shares in an order that depends on "
                        "the size of the step (pipeline_parallel_size is supported)"})
LORA = Element("enable_lora", lacks={
    "batch_invariance": "the adapters' terms run torch's matmuls for large segments, "
                        "whose kernels change with the rows"})
SOFTCAP = Element("logit-softcapped attention layers", lacks={
    "batch_invariance": "they run the torch attention path (the C kernels have no "
                        "softcap), whose matmuls change with the step's shapes"})
NO_LINEAR_KERNELS = Element("a CPU without the C linear kernels (AVX-512 or AVX2)", lacks={
    "batch_invariance": "the linears then run on torch, whose kernels change with the "
                        "rows"})


def _invariance_elements(config: Any) -> list[Element]:
    """What the configuration turns on that cannot be batch-invariant (and the mode)."""
    elements = [BATCH_INVARIANT] if config.model.batch_invariant else []
    if config.model.dtype == "float32":
        elements.append(FLOAT32)
    if config.model.device == "cuda":
        elements.append(CUDA)
    if config.parallel.tensor_parallel_size > 1:
        elements.append(TENSOR_PARALLEL)
    if config.lora.enable_lora:
        elements.append(LORA)
    return elements


SHARDING = Element("tensor_parallel_size or pipeline_parallel_size > 1",
                   frozenset({"sharding"}))
DISAGGREGATION = Element("P/D disaggregation", frozenset({"prefix_transfer"}))
PREFIX_CACHING_OFF = Element("enable_prefix_caching off", lacks={
    "prefix_transfer": "P/D lands KV as prefix-cache blocks: enable_prefix_caching must "
                       "be on",
    "prefix_events": "KV events announce the prefix cache's blocks: enable_prefix_caching "
                     "must be on"})
KV_EVENTS = Element("kv_events_endpoint", frozenset({"prefix_events"}))
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
OVERLAP_STEPS = Element("overlap_steps", frozenset({"step_overlap"}), lacks={
    "prefix_transfer": "P/D's KV reads and writes reach the worker between steps, and "
                       "overlap_steps keeps the next step in flight"})


def _executor_element(executor: str) -> Element:
    """The executor: overlap_steps runs the worker on a thread of the engine's process,
    which only the uni executor has."""
    lacks = ({} if executor == "uni" else {
        "step_overlap": "its workers are other processes; overlap_steps runs the one "
                        "worker on a thread of the engine's process (executor uni)"})
    return Element(f"distributed_executor_backend {executor}", lacks=lacks)


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
    if config.kv_events.enabled:
        elements.append(KV_EVENTS)
    elements.append(_policy_element(config.scheduler.scheduling_policy))
    if config.scheduler.slo_reject:
        elements.append(SLO_REJECT)
    if config.scheduler.overlap_steps:
        elements += [OVERLAP_STEPS, _executor_element(config.parallel.executor)]
    return elements + _invariance_elements(config)


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


def check_batch_invariant_run(backend: str, dtype: str, device: str,
                              linear_kernels: bool, softcapped_layers: bool) -> None:
    """What a batch-invariant worker chose or found (`auto` resolved): its attention
    backend, dtype ("bfloat16", "float32") and device ("cpu", "cuda"), whether the C
    linear kernels run here and whether the model has logit-softcapped layers."""
    elements = [BATCH_INVARIANT, _backend_element(backend)]
    if dtype != "bfloat16":
        elements.append(Element(f"dtype {dtype}", lacks=FLOAT32.lacks))
    if device != "cpu":
        elements.append(Element(f"device {device}", lacks=CUDA.lacks))
    if not linear_kernels:
        elements.append(NO_LINEAR_KERNELS)
    if softcapped_layers:
        elements.append(SOFTCAP)
    check(elements)


def backends_reading() -> dict[str, tuple[str, ...]]:
    """Attention backend -> the cache dtypes it reads and writes (from CACHE_DTYPES)."""
    return {b: tuple(d for d, spec in CACHE_DTYPES.items() if b in spec.backends)
            for b in ATTENTION_BACKENDS}
