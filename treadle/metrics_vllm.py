"""vLLM's metric names, served beside treadle's own on /metrics (docs/metrics.md).

Routers and autoscalers built for vLLM (the Gateway API Inference Extension's endpoint
picker, llm-d, KServe, Grafana dashboards) read `vllm:*` names with the labels
`model_name` and `engine`. `VLLMMetrics` is a collector registered in an engine's
registry (treadle/metrics.py): at scrape time it copies each mirrored `treadle:*` family
under its vLLM name, the values unchanged (the same observations, units and buckets),
with `engine="0"` added; and it makes the three vLLM has no twin for here:
`vllm:num_requests_waiting` (treadle's waiting plus swapped-out requests: vLLM counts a
preempted request as waiting), `vllm:cache_config_info` (a gauge of 1 whose labels are
the KV cache's configuration: block_size, num_gpu_blocks, ...) and
`vllm:lora_requests_info` (with LoRA on: the time of the last update, labelled with
max_lora and the adapters of the running and waiting requests, only the current set).

Nothing is recorded twice and nothing is computed on the engine thread but the adapter
names (AsyncEngine, with LoRA on). Owns the name table; never decides anything.
"""

from __future__ import annotations

import threading
import time

from prometheus_client.core import GaugeMetricFamily, Metric

ENGINE = "0"
"""The `engine` label: one engine core per server (replicas add their own `replica`)."""

MIRRORS: tuple[tuple[str, str], ...] = (
    ("vllm:num_requests_running", "treadle:num_requests_running"),
    ("vllm:kv_cache_usage_perc", "treadle:kv_cache_usage_perc"),
    ("vllm:gpu_cache_usage_perc", "treadle:kv_cache_usage_perc"),
    ("vllm:num_preemptions", "treadle:num_preemptions"),
    ("vllm:prompt_tokens", "treadle:prompt_tokens"),
    ("vllm:generation_tokens", "treadle:generation_tokens"),
    ("vllm:request_success", "treadle:request_success"),
    ("vllm:prefix_cache_queries", "treadle:prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "treadle:prefix_cache_hits"),
    ("vllm:iteration_tokens_total", "treadle:iteration_tokens_total"),
    ("vllm:time_to_first_token_seconds", "treadle:time_to_first_token_seconds"),
    ("vllm:inter_token_latency_seconds", "treadle:inter_token_latency_seconds"),
    ("vllm:time_per_output_token_seconds", "treadle:inter_token_latency_seconds"),
    ("vllm:request_time_per_output_token_seconds", "treadle:time_per_output_token_seconds"),
    ("vllm:e2e_request_latency_seconds", "treadle:e2e_request_latency_seconds"),
    ("vllm:request_queue_time_seconds", "treadle:request_queue_time_seconds"),
    ("vllm:request_inference_time_seconds", "treadle:request_inference_time_seconds"),
    ("vllm:request_prefill_time_seconds", "treadle:request_prefill_time_seconds"),
    ("vllm:request_decode_time_seconds", "treadle:request_decode_time_seconds"),
    ("vllm:request_prompt_tokens", "treadle:request_prompt_tokens"),
    ("vllm:request_generation_tokens", "treadle:request_generation_tokens"),
    ("vllm:spec_decode_num_drafts", "treadle:spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "treadle:spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "treadle:spec_decode_num_accepted_tokens"),
    ("vllm:spec_decode_num_accepted_tokens_per_pos",
     "treadle:spec_decode_num_accepted_tokens_per_pos"),
)
"""vLLM name -> the treadle family it copies. vllm:time_per_output_token_seconds is the
name vLLM used for the gaps between tokens until it renamed it
inter_token_latency_seconds (older dashboards still read it); vLLM's per-request TPOT is
request_time_per_output_token_seconds. The spec_decode names appear with speculation."""


def cache_config_labels(config, core) -> dict[str, object]:
    """vllm:cache_config_info's labels for an engine: its EngineConfig and EngineCore
    (num_gpu_blocks: the KV cache's blocks on whichever device; num_cpu_blocks: its swap
    blocks, as vLLM's swap space was counted; swap_space in GiB, as vLLM gives it: the
    size the engine settled on when the option is `auto`)."""
    cache = config.cache
    swap_bytes = (cache.swap_space if isinstance(cache.swap_space, (int, float)) else
                  core.num_swap_blocks * cache.block_size * getattr(core, "kv_bytes_per_token", 0))
    return {"block_size": cache.block_size, "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "num_gpu_blocks": core.num_kv_blocks, "num_cpu_blocks": core.num_swap_blocks,
            "prefix_caching_hash_algo": "blake2b", "swap_space": swap_bytes / 1024**3}


def lora_adapters(scheduler) -> tuple[list[str], list[str]]:
    """The adapter names of the running requests and of the waiting or swapped-out ones,
    each once, in queue order (read on the engine thread)."""
    def names(requests) -> list[str]:
        return list(dict.fromkeys(r.lora_request.lora_name for r in requests
                                  if r.lora_request is not None))
    return names(scheduler.running), names([*scheduler.waiting, *scheduler.swapped])


def _copy(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        out.add_sample(name + sample.name[len(family.name):],
                       {**sample.labels, "engine": ENGINE}, sample.value, sample.timestamp,
                       sample.exemplar)
    return out


class VLLMMetrics:
    """The vLLM-named view of one engine's metrics (a prometheus_client collector)."""

    def __init__(self, families: dict, model_name: str) -> None:
        """`families`: treadle family name -> its metric object (EngineMetrics.families)."""
        self._families = families
        self._model = model_name
        self._cache_info: dict[str, str] | None = None
        self._max_lora: int | None = None
        self._lora: tuple[str, str, float] = ("", "", time.time())
        self._lock = threading.Lock()

    def set_cache_config(self, **labels: object) -> None:
        """The KV cache's configuration, as vllm:cache_config_info's labels."""
        self._cache_info = {k: str(v) for k, v in labels.items()}

    def set_max_lora(self, max_lora: int) -> None:
        """LoRA is on with this many adapter slots: vllm:lora_requests_info appears."""
        self._max_lora = max_lora

    def set_lora_adapters(self, running: list[str], waiting: list[str]) -> None:
        """The adapters of the running and of the waiting requests, after a step."""
        value = (",".join(running), ",".join(waiting), time.time())
        with self._lock:
            self._lora = value

    def describe(self) -> list:
        return []  # names depend on what is configured: collected at scrape time only

    def collect(self):
        labels = ["model_name", "engine"]
        for name, source in MIRRORS:
            family = self._families.get(source)
            if family is not None:
                for collected in family.collect():
                    yield _copy(collected, name)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Requests waiting to be processed (treadle: waiting "
                                    "and swapped out)", labels=labels)
        waiting.add_metric([self._model, ENGINE], sum(
            self._value(f) for f in ("treadle:num_requests_waiting",
                                     "treadle:num_requests_swapped")))
        yield waiting
        if self._cache_info is not None:
            info = GaugeMetricFamily("vllm:cache_config_info",
                                     "Information of the engine's cache configuration",
                                     labels=[*self._cache_info, "engine"])
            info.add_metric([*self._cache_info.values(), ENGINE], 1.0)
            yield info
        if self._max_lora is not None:
            with self._lock:
                running, waiting_adapters, updated = self._lora
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on LoRA requests (the time of "
                "the last update)",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(self._max_lora), waiting_adapters, running], updated)
            yield lora

    def _value(self, name: str) -> float:
        family = self._families.get(name)
        if family is None:
            return 0.0
        return sum(s.value for m in family.collect() for s in m.samples)
