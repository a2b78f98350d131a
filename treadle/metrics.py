"""Prometheus metrics of a serving engine, named as vLLM names them with a `treadle:` prefix.

Owns one CollectorRegistry per engine (no module-level state), the conversions from
engine stats and request timings to gauges, counters and histograms, so dashboards and
routers built for vLLM read treadle unchanged, and the last minute of TTFT / TPOT
observations for treadle's own dashboard (`LatencyWindow`). vLLM's own names are served
beside these by treadle/metrics_vllm.py, which reads `families`. It never decides anything.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from treadle.metrics_vllm import VLLMMetrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                          0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_FRACTION_BUCKETS = tuple(i / 10 for i in range(1, 11))
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))

# Engine counters (cumulative in EngineCore.stats()) -> Prometheus counter names.
_COUNTER_STATS = {
    "prefix_cache_queried_tokens": ("prefix_cache_queries", "Prefix-cache queries, in tokens"),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "Prefix-cache hits, in tokens"),
    "num_preemptions": ("num_preemptions", "Preemptions (all modes)"),
    "num_preemptions_swap": ("num_preemptions_swap", "Preemptions by swap"),
    "num_admission_preemptions": ("num_admission_preemptions",
                                  "Preemptions made to admit a more urgent waiting request "
                                  "(priority policy; counted in num_preemptions too)"),
    "num_kv_compactions": ("num_kv_compactions",
                           "Heavy-hitter (H2O) evictions: compactions of a request's KV"),
    "num_evicted_tokens": ("num_kv_evicted_tokens", "Tokens of KV evicted by H2O"),
    "swap_bytes_out": ("swap_out_bytes", "Bytes of KV swapped out"),
    "swap_bytes_in": ("swap_in_bytes", "Bytes of KV swapped in"),
    "spec_num_drafts": ("spec_decode_num_drafts",
                        "Speculative drafts verified (one per request per step it ran proposals)"),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Proposed tokens verified"),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                 "Proposed tokens accepted"),
}

# The preemption tax: seconds the engine spent on work a preemption caused, by mode.
# Exposed once the engine's stats carry these keys (seconds, cumulative); until then the
# metric is absent rather than a zero nobody measured.
_PREEMPTION_TAX_STATS = {"time_swap_s": "swap", "time_recompute_s": "recompute"}


class LatencyWindow:
    """The latency observations of the last `window_s` seconds (the same ones the
    histograms get), for percentiles over the last minute (the dashboard). Bounded; the
    engine thread appends, readers copy under a lock held for the copy."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 100_000,
                 clock=time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._samples.append((self._clock(), value))

    def values(self) -> list[float]:
        """The observations of the last window_s seconds, oldest first."""
        cutoff = self._clock() - self.window_s
        with self._lock:
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
            return [v for _, v in self._samples]


class EngineMetrics:
    """The metrics of one engine, exposed at /metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds
        r, labels = self.registry, ["model_name"]
        self._model = model_name
        self.families: dict = {}
        """treadle family name -> its metric (what metrics_vllm.py copies)."""

        def family(name, metric):
            self.families[name] = metric
            return metric

        def gauge(name, doc):
            name = f"treadle:{name}"
            return family(name, Gauge(name, doc, labels, registry=r)).labels(model_name)

        def counter(name, doc):
            name = f"treadle:{name}"
            return family(name, Counter(name, doc, labels, registry=r)).labels(model_name)

        def histogram(name, doc, buckets):
            name = f"treadle:{name}"
            return family(name, Histogram(name, doc, labels, buckets=buckets,
                                          registry=r)).labels(model_name)

        self.running = gauge("num_requests_running", "Requests holding KV and scheduled")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is swapped out")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV cache's bytes in use "
                              "(0-1; blocks in use over all, each of its dtype's real size)")
        self.batch_efficiency = gauge(
            "batch_slot_efficiency", "Scheduled requests over max_num_seqs, last step")
        self.batch_efficiency_hist = histogram(
            "iteration_batch_slot_efficiency", "Scheduled requests over max_num_seqs per step",
            _FRACTION_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self._success = family("treadle:request_success", Counter(
            "treadle:request_success", "Finished requests by reason",
            ["model_name", "finished_reason"], registry=r))
        self._engine_counters = {key: counter(name, doc)
                                 for key, (name, doc) in _COUNTER_STATS.items()}
        self._accepted_per_pos = family("treadle:spec_decode_num_accepted_tokens_per_pos", Counter(
            "treadle:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by position in their draft (0: the first)",
            ["model_name", "position"], registry=r))
        self._last_per_pos: list[int] = []
        self._last_stats: dict[str, float] = {}
        self._preemption_tax: Counter | None = None
        self._add_request_histograms(histogram)
        self.vllm = VLLMMetrics(self.families, model_name)
        """vLLM's names for these (treadle/metrics_vllm.py), in the same registry."""
        r.register(self.vllm)
        self.recent_ttft = LatencyWindow()
        """The TTFT observations of the last minute (also in the histogram)."""
        self.recent_tpot = LatencyWindow()
        """The TPOT observations of the last minute (also in the histogram)."""
        self.engine_stalls = counter(
            "engine_stalls", "Times the engine stalled: work queued and no step for "
            "stall_timeout seconds (engine/watchdog.py; GET /ready answers 503 meanwhile)")

    def _add_request_histograms(self, histogram) -> None:
        """The per-request latency and size histograms (vLLM's set, under treadle's names)."""
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens",
                             _TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "(E2E - TTFT) / (output tokens - 1) per request",
                              _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled to first token", _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish",
                                     _LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step",
                                          _STEP_TOKEN_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "First scheduled to finish", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens per finished request",
                                               _REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request",
                                                   _REQUEST_TOKEN_BUCKETS)

    def record_step(self, stats: dict, num_running: int, num_waiting: int, num_swapped: int,
                    num_scheduled: int, max_num_seqs: int) -> None:
        """Gauges after a step, and the engine's cumulative counters as increments."""
        self.record_gauges(num_running, num_waiting, num_swapped, stats["kv_usage"])
        if num_scheduled:
            efficiency = num_scheduled / max_num_seqs
            self.batch_efficiency.set(efficiency)
            self.batch_efficiency_hist.observe(efficiency)
        for key, metric in self._engine_counters.items():
            if key not in stats:  # speculation's counters exist only with a proposer
                continue
            increment = stats[key] - self._last_stats.get(key, 0)
            if increment > 0:
                metric.inc(increment)
            self._last_stats[key] = stats[key]
        per_pos = stats.get("spec_accepted_per_position", ())
        for position, total in enumerate(per_pos):
            before = self._last_per_pos[position] if position < len(self._last_per_pos) else 0
            if total > before:
                self._accepted_per_pos.labels(self._model, str(position)).inc(total - before)
        self._last_per_pos = list(per_pos)
        self._record_preemption_tax(stats)
        tokens = stats.get("num_scheduled_tokens", 0) - self._last_stats.get(
            "num_scheduled_tokens", 0)
        if tokens > 0:
            self.iteration_tokens.observe(tokens)
            self._last_stats["num_scheduled_tokens"] = stats["num_scheduled_tokens"]

    def record_gauges(self, num_running: int, num_waiting: int, num_swapped: int,
                      kv_usage: float) -> None:
        """The request and KV gauges (after a step, or while idle after aborts)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.swapped.set(num_swapped)
        self.kv_usage.set(kv_usage)

    def _record_preemption_tax(self, stats: dict) -> None:
        present = [key for key in _PREEMPTION_TAX_STATS if key in stats]
        if not present:
            return
        if self._preemption_tax is None:
            self._preemption_tax = Counter(
                "treadle:preemption_tax_seconds",
                "Seconds spent swapping KV out and in, and recomputing preempted tokens",
                ["model_name", "mode"], registry=self.registry)
        for key in present:
            increment = stats[key] - self._last_stats.get(key, 0)
            if increment > 0:
                self._preemption_tax.labels(self._model, _PREEMPTION_TAX_STATS[key]).inc(
                    increment)
            self._last_stats[key] = stats[key]

    def record_new_tokens(self, num_tokens: int, ttft: float | None = None,
                          gap: float | None = None) -> None:
        """Tokens streamed to a request; its TTFT on the first, else the gap since the last."""
        self.generation_tokens.inc(num_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            self.recent_ttft.add(ttft)
        elif gap is not None:
            self.itl.observe(gap)

    def record_finished(self, finish_reason: str, num_prompt_tokens: int,
                        num_output_tokens: int, arrival: float, first_scheduled: float | None,
                        first_token: float | None, finished: float) -> None:
        """A request's counters and latency histograms (monotonic-clock timestamps)."""
        self._success.labels(self._model, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        self.e2e.observe(finished - arrival)
        if first_scheduled is not None:
            self.queue_time.observe(first_scheduled - arrival)
            self.inference_time.observe(finished - first_scheduled)
        if first_token is not None:
            if first_scheduled is not None:
                self.prefill_time.observe(first_token - first_scheduled)
            self.decode_time.observe(finished - first_token)
            if num_output_tokens > 1:
                tpot = (finished - first_token) / (num_output_tokens - 1)
                self.tpot.observe(tpot)
                self.recent_tpot.add(tpot)

    def record_stall(self) -> None:
        """A stall began (engine/watchdog.py)."""
        self.engine_stalls.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """Every `treadle:` sample as /metrics shows it, in one pass over the registry:
        {name without the prefix (e.g. "generation_tokens_total"): value}, samples of
        one name summed over their labels (request_success_total: every finish reason);
        histogram buckets left out."""
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            if not metric.name.startswith("treadle:"):
                continue
            for sample in metric.samples:
                if "le" in sample.labels:
                    continue
                name = sample.name[len("treadle:"):]
                out[name] = out.get(name, 0.0) + sample.value
        return out


class ServerMetrics:
    """The server's own metrics, beside its engine's (/metrics serves both): requests
    refused before they reached the engine, by reason (server/admission.py)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        self._rejections = Counter(
            "treadle:request_rejections", "Requests refused before any work on them, by "
            "reason: queue_delay, queue_requests, queue_tokens, engine_stalled (503); "
            "tenant_concurrency, tenant_tokens (429)",
            ["model_name", "reason"], registry=self.registry)

    def record_rejection(self, reason: str) -> None:
        self._rejections.labels(self._model, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
