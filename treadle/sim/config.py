"""The simulator's configuration: `SimConfig` (`treadle simulate`: workload, step-time
model, fleet) and `SizingConfig` (`treadle simulate size`: the SLO and where to look).

Owns these two dataclasses, each field a flag with a one-line help text (the command line
is generated from them with treadle.config's add_dataclass_arguments), and their
validation. The engine's own configuration (the scheduler and cache options every
simulated replica takes) stays in treadle/config.py. Must not: import torch, or hold
anything the simulation computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.config import DEFAULT_SCHEDULING_POLICY, SCHEDULING_POLICIES
from treadle.router.routers import ROUTINGS


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class SimConfig:
    """The capacity simulator (`treadle simulate`, treadle/sim): workload, step-time model
    and fleet. The engine's scheduler and cache options apply to every replica."""

    trace: str | None = field(default=None, metadata=_help(
        "Azure-format CSV trace to replay (TIMESTAMP, ContextTokens, GeneratedTokens); the "
        "conversation trace when no workload is given"))
    workload: str | None = field(default=None, metadata=_help(
        "Instead of a trace: azure-conv, synthetic, shared-prefix or mixed-priority "
        "(treadle/measure/workloads.py)"))
    workload_file: str | None = field(default=None, metadata=_help(
        "Instead of a trace: a saved workload JSON (measure/workloads.save_workload)"))
    workload_trace: str | None = field(default=None, metadata=_help(
        "Instead of a trace: replay the arrivals of a treadle per-step trace (--trace FILE "
        "of a real run)"))
    num_requests: int | None = field(default=None, metadata=_help(
        "Replay only the first N requests (all when not given; workloads: their size)"))
    mixed_duration_s: float = field(default=40.0, metadata=_help(
        "mixed-priority workload: seconds of arrivals (both classes)"))
    token_scale: float = field(default=1.0, metadata=_help(
        "Multiply the trace's prompt and output lengths by this"))
    time_scale: float = field(default=1.0, metadata=_help(
        "Divide the arrival gaps by this (2: twice the rate, half the duration)"))
    rate_scale: float = field(default=1.0, metadata=_help(
        "Superpose this many copies of the trace over the same duration (10: ten times the "
        "request rate); fractions thin the last copy"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "Context length of the model (lengths are capped to it); the model shape's or the "
        "fitted trace's when not given"))
    priority_mix: float | None = field(default=None, metadata=_help(
        "Fraction of requests with priority 0 (the rest 1), drawn with the seed"))
    prefix_groups: int = field(default=0, metadata=_help(
        "Synthetic prompts: number of shared prefixes (system prompts); 0: none shared"))
    prefix_len: int = field(default=0, metadata=_help(
        "Synthetic prompts: tokens of each shared prefix"))
    prefix_fraction: float = field(default=1.0, metadata=_help(
        "Synthetic prompts: fraction of requests that start with a shared prefix"))
    prefix_zipf: float = field(default=0.0, metadata=_help(
        "Synthetic prompts: Zipf exponent of the prefixes' popularity (0: uniform)"))
    seed: int = field(default=0, metadata=_help(
        "Seed of everything random in the simulation (prompts, priorities, acceptance)"))
    step_model: str = field(default="roofline", metadata=_help(
        "roofline, fit:TRACE.jsonl (least squares on a real run's trace; "
        "fit:A.jsonl,B.jsonl pools several runs) or linear:FILE.json (a saved fit)"))
    hardware: str = field(default="h200", metadata=_help(
        "roofline: cpu-here, h200, a100 or a YAML file (treadle/sim/presets)"))
    model_shape: str = field(default="llama-3-8b", metadata=_help(
        "roofline: llama-3-8b, smollm2-135m, a YAML file or a HF config.json / checkpoint"))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "roofline: devices per replica (tensor parallelism)"))
    replicas: int = field(default=1, metadata=_help(
        "Colocated replicas (each prefills and decodes)"))
    prefill_replicas: int = field(default=0, metadata=_help(
        "P/D: prefill replicas (with decode_replicas; overrides replicas)"))
    decode_replicas: int = field(default=0, metadata=_help(
        "P/D: decode replicas (with prefill_replicas)"))
    routing: str = field(default="round-robin", metadata=_help(
        "Router (the server's, treadle/router): round-robin, least-load or prefix"))
    kv_transfer_bandwidth: float | None = field(default=None, metadata=_help(
        "P/D: bytes/s of the KV link per device; the hardware's network_bandwidth when not "
        "given"))
    num_spec_tokens: int = field(default=0, metadata=_help(
        "Speculative decoding: tokens proposed per decode step (0: none)"))
    spec_acceptance_rate: float = field(default=0.7, metadata=_help(
        "Speculative decoding: probability each proposed token is accepted"))
    front_end_ms: float = field(default=0.0, metadata=_help(
        "Milliseconds a request spends outside the engine (HTTP, tokenization, its first "
        "token's way back), added before it reaches its replica, so that TTFT and E2E are "
        "what clients measure; `treadle simulate fit TRACE --served-result RESULT.json` "
        "measures it on a served run (0: engine-side latencies)"))
    slo_ttft_ms: float | None = field(default=None, metadata=_help(
        "TTFT SLO in milliseconds for goodput"))
    slo_tpot_ms: float | None = field(default=None, metadata=_help(
        "TPOT SLO in milliseconds for goodput"))
    timeseries_interval: float = field(default=1.0, metadata=_help(
        "Seconds of simulated time between samples of each replica's queues and KV usage"))
    output: str | None = field(default=None, metadata=_help(
        "Folder for the JSON result and the plots (results/simulate when not given)"))

    def __post_init__(self) -> None:
        sources = [x for x in (self.workload, self.workload_file, self.workload_trace) if x]
        if len(sources) > 1 or (sources and self.trace):
            raise ValueError("give at most one of trace, workload, workload_file, "
                             "workload_trace")
        if self.workload is not None and self.workload not in (
                "azure-conv", "synthetic", "shared-prefix", "mixed-priority"):
            raise ValueError("workload must be one of azure-conv, synthetic, shared-prefix, "
                             f"mixed-priority, got {self.workload!r}")
        for name in ("token_scale", "time_scale", "rate_scale", "timeseries_interval",
                     "mixed_duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("num_requests", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("priority_mix", "prefix_fraction", "spec_acceptance_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        for name in ("prefix_groups", "prefix_len", "prefill_replicas", "decode_replicas",
                     "num_spec_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefix_zipf < 0:
            raise ValueError(f"prefix_zipf must be >= 0, got {self.prefix_zipf}")
        if not 0.0 <= self.front_end_ms < 3_600_000:
            raise ValueError(f"front_end_ms must be in [0, 3600000), got {self.front_end_ms}")
        if self.replicas < 1 or self.tensor_parallel_size < 1:
            raise ValueError("replicas and tensor_parallel_size must be >= 1, got "
                             f"{self.replicas}, {self.tensor_parallel_size}")
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ValueError("P/D needs both prefill_replicas and decode_replicas >= 1, got "
                             f"{self.prefill_replicas}, {self.decode_replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, "
                             f"got {self.routing!r}")
        if self.kv_transfer_bandwidth is not None and not self.kv_transfer_bandwidth > 0:
            raise ValueError(f"kv_transfer_bandwidth must be > 0 bytes/s, "
                             f"got {self.kv_transfer_bandwidth}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0


@dataclass(frozen=True)
class SizingConfig:
    """`treadle simulate size`: the smallest fleet that meets an SLO, and where to look."""

    target_ttft_p99_ms: float = field(default=1000.0, metadata=_help(
        "Largest acceptable p99 TTFT in milliseconds"))
    target_tpot_p99_ms: float = field(default=50.0, metadata=_help(
        "Largest acceptable p99 TPOT in milliseconds"))
    target_goodput: float | None = field(default=None, metadata=_help(
        "Smallest acceptable fraction of requests meeting both SLOs (e.g. 0.99)"))
    slo_priority: int | None = field(default=None, metadata=_help(
        "Judge the SLO on requests of at most this priority only (all requests when not "
        "given)"))
    search_policies: str = field(default=DEFAULT_SCHEDULING_POLICY, metadata=_help(
        "Scheduling policies to try, comma-separated (e.g. fcfs,priority)"))
    search_tp: str = field(default="1", metadata=_help(
        "Tensor-parallel degrees to try, comma-separated (e.g. 1,2)"))
    search_chunks: str = field(default="", metadata=_help(
        "Token budgets (max_num_batched_tokens) to try, comma-separated; the engine's "
        "when empty"))
    search_modes: str = field(default="colocated", metadata=_help(
        "colocated, disaggregated, or both comma-separated"))
    max_replicas: int = field(default=64, metadata=_help(
        "Largest replica count (per pool under P/D) the search tries"))

    def __post_init__(self) -> None:
        for name in ("target_ttft_p99_ms", "target_tpot_p99_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.target_goodput is not None and not 0 < self.target_goodput <= 1:
            raise ValueError(f"target_goodput must be in (0, 1], got {self.target_goodput}")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")
        for mode in self.modes:
            if mode not in ("colocated", "disaggregated"):
                raise ValueError(f"search_modes must list colocated and/or disaggregated, "
                                 f"got {self.search_modes!r}")
        for policy in self.policies:
            if policy not in SCHEDULING_POLICIES:
                raise ValueError(f"search_policies: unknown policy {policy!r}")
        try:
            bad = [v for v in self.tp_degrees + self.chunks if v < 1]
        except ValueError:
            raise ValueError("search_tp and search_chunks must be comma-separated integers, "
                             f"got {self.search_tp!r}, {self.search_chunks!r}") from None
        if bad:
            raise ValueError(f"search_tp and search_chunks must be >= 1, got {bad}")

    @staticmethod
    def _split(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    @property
    def policies(self) -> list[str]:
        return self._split(self.search_policies)

    @property
    def modes(self) -> list[str]:
        return self._split(self.search_modes)

    @property
    def tp_degrees(self) -> list[int]:
        return [int(v) for v in self._split(self.search_tp)]

    @property
    def chunks(self) -> list[int]:
        return [int(v) for v in self._split(self.search_chunks)]
