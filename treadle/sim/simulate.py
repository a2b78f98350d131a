"""One simulation from its configuration: requests, step-time model, replicas, fleet, figures.

Owns resolving a SimConfig plus the engine's scheduler and cache options into what the
fleet runs: the request list (source, scaling, priorities), the step-time model
(`--step-model`, `make_step_model`: above sim/fit.py, sim/roofline.py and
sim/step_model.py, which import none of it), each replica's memory (the fitted trace's
engine facts, the roofline hardware's capacity, or --num-kv-blocks / --kv-cache-memory
given explicitly), and the routers (the production ones); then runs it and summarizes.
The scheduler configuration of a replica is the engine's: a fitted trace's own settings
(its header), overridden by any option given.
Must not: contain scheduling logic (that is treadle.core's) or read the wall clock other
than through the fleet's report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from treadle.config import AUTO, CacheConfig, SchedulerConfig
from treadle.core.policy import PreemptionCosts
from treadle.router.routers import PrefixRouterOptions, Router, make_router
from treadle.sim import workload as wl
from treadle.sim.clock import SimClock
from treadle.sim.config import SimConfig
from treadle.sim.fit import fit_trace_file
from treadle.sim.fleet import Fleet, FleetResult
from treadle.sim.hardware import load_hardware, load_model_shape
from treadle.sim.replica import Replica, ReplicaSpec
from treadle.sim.results import summarize_fleet
from treadle.sim.roofline import RooflineStepModel, kv_transfer_seconds, num_kv_blocks
from treadle.sim.step_model import LinearStepModel

_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}


@dataclass
class SimSetup:
    """Everything a simulation runs with, resolved."""

    config: SimConfig
    requests: list
    step_model: Any
    replica_spec: ReplicaSpec
    hardware: Any = None
    shape: Any = None
    description: dict = dataclasses.field(default_factory=dict)


def make_step_model(spec: str, hardware=None, shape=None, tensor_parallel_size: int = 1):
    """The model a `--step-model` spec names:

        fit:TRACE.jsonl   least squares on a real run's trace (treadle/sim/fit.py);
                          fit:A.jsonl,B.jsonl pools the steps of several runs
        linear:FILE.json  a linear model saved by `treadle simulate fit --save`
        roofline          peak FLOP/s and bandwidth of a `--hardware` preset
                          (treadle/sim/roofline.py)
    """
    kind, _, arg = spec.partition(":")
    if kind == "fit":
        if not arg:
            raise ValueError("--step-model fit:TRACE.jsonl needs the trace file (or "
                             "several, comma-separated: fit:A.jsonl,B.jsonl)")
        return fit_trace_file(arg)
    if kind == "linear":
        if not arg:
            raise ValueError("--step-model linear:FILE.json needs the file")
        return LinearStepModel.load(arg)
    if kind == "roofline":
        if hardware is None or shape is None:
            raise ValueError("--step-model roofline needs --hardware and --model-shape")
        return RooflineStepModel(hardware, shape, tensor_parallel_size)
    raise ValueError(f"--step-model must be fit:TRACE.jsonl, linear:FILE.json or roofline, "
                     f"got {spec!r}")


def load_requests(config: SimConfig, max_model_len: int | None) -> tuple[list, dict]:
    """The requests a SimConfig names, scaled, with priorities; and how they were made."""
    desc: dict = {}
    if config.workload_trace:
        from treadle.engine.trace import read_trace

        requests = wl.from_engine_trace(read_trace(config.workload_trace))
        desc = {"source": "treadle trace", "file": config.workload_trace}
    elif config.workload_file:
        from treadle.measure.workloads import load_workload

        w = load_workload(config.workload_file)
        requests = wl.from_workload(w)
        desc = {"source": "workload file", "file": config.workload_file, **w.description}
    elif config.workload == "mixed-priority":
        from treadle.measure.workloads import mixed_priority_workload

        requests = wl.from_replay(mixed_priority_workload(duration_s=config.mixed_duration_s,
                                                          seed=config.seed))
        desc = {"source": "mixed-priority (treadle.measure.workloads defaults)",
                "seed": config.seed, "mixed_duration_s": config.mixed_duration_s}
    elif config.workload is not None and config.workload != "azure-conv":
        from treadle.measure import workloads

        n = config.num_requests or 64
        w = (workloads.synthetic(num_requests=n, seed=config.seed, max_model_len=max_model_len)
             if config.workload == "synthetic"
             else workloads.shared_prefix(num_requests=n, seed=config.seed))
        requests = wl.from_workload(w)
        desc = {"source": config.workload, **w.description}
    else:
        requests = wl.from_azure_csv(config.trace, config.num_requests, config.token_scale,
                                     max_model_len)
        desc = {"source": "azure csv", "file": config.trace or "AzureLLMInferenceTrace_conv.csv",
                "token_scale": config.token_scale}
    if config.num_requests and len(requests) > config.num_requests:
        requests = requests[:config.num_requests]
    requests = wl.scale_times(requests, config.time_scale)
    requests = wl.scale_rate(requests, config.rate_scale, config.seed)
    if config.priority_mix is not None:
        requests = wl.assign_priorities(requests, config.priority_mix, config.seed)
    desc |= {"num_requests": len(requests), "time_scale": config.time_scale,
             "rate_scale": config.rate_scale, "priority_mix": config.priority_mix,
             "duration_s": requests[-1].arrival if requests else 0.0,
             "prefix": {"groups": config.prefix_groups, "len": config.prefix_len,
                        "fraction": config.prefix_fraction, "zipf": config.prefix_zipf}}
    return requests, desc


def build(config: SimConfig, engine_options: dict | None = None) -> SimSetup:
    """Resolve a SimConfig and the given scheduler/cache options (flat names)."""
    engine_options = dict(engine_options or {})
    unknown = sorted(set(engine_options) - _SCHEDULER_FIELDS - _CACHE_FIELDS)
    if unknown:
        raise ValueError(f"unknown scheduler/cache option(s) for the simulator: {unknown}")
    hardware = shape = None
    facts: dict = {}
    if config.step_model.startswith(("fit:", "linear:")):
        step_model = make_step_model(config.step_model)
        facts = (step_model.fit_report or {}).get("engine") or {}
    else:
        hardware = load_hardware(config.hardware)
        shape = load_model_shape(config.model_shape)
        step_model = make_step_model(config.step_model, hardware, shape,
                                     config.tensor_parallel_size)
    scheduler_options = {k: v for k, v in (facts.get("scheduler") or {}).items()
                         if k in _SCHEDULER_FIELDS and k != "trace"}
    scheduler_options |= {k: v for k, v in engine_options.items() if k in _SCHEDULER_FIELDS}
    scheduler_options["trace"] = None
    cache_options = {k: facts[k] for k in ("block_size", "enable_prefix_caching") if k in facts}
    cache_options |= {k: v for k, v in engine_options.items() if k in _CACHE_FIELDS}
    scheduler = SchedulerConfig(**scheduler_options)
    cache = CacheConfig(**cache_options)
    if shape is not None:
        kv_bytes = shape.kv_bytes_per_token
        max_model_len = config.max_model_len or shape.max_model_len
        vocab = shape.vocab_size
    else:
        if "kv_bytes_per_token" not in facts:
            raise ValueError(f"{config.step_model}: the fitted trace has no engine facts "
                             "(a version-1 trace): give --step-model roofline, or refit on "
                             "a version-2 trace")
        kv_bytes = int(facts["kv_bytes_per_token"])
        max_model_len = config.max_model_len or int(facts["max_model_len"])
        vocab = int(facts.get("vocab_size", 49152))
    block_bytes = kv_bytes * cache.block_size
    if "num_kv_blocks" in engine_options:
        blocks = int(engine_options["num_kv_blocks"])
    elif engine_options.get("kv_cache_memory", AUTO) != AUTO:
        blocks = int(cache.kv_cache_memory // block_bytes)
    elif shape is not None:
        blocks = num_kv_blocks(hardware, shape, config.tensor_parallel_size, cache.block_size)
    else:
        blocks = int(facts["num_kv_blocks"])
        if facts.get("block_size", cache.block_size) != cache.block_size:
            blocks = blocks * int(facts["block_size"]) // cache.block_size
    if blocks < 1:
        raise ValueError(f"the KV cache holds no block of {cache.block_size} tokens")
    if cache.swap_space == AUTO and ("swap_space" in engine_options or shape is not None):
        swap_blocks = blocks // 2  # the engine's auto: half the KV cache (docs/memory.md)
    elif "swap_space" in engine_options or shape is not None:
        swap_blocks = int(cache.swap_space // block_bytes)
    else:
        swap_blocks = int(facts.get("num_swap_blocks", 0))
    if shape is not None:
        costs = PreemptionCosts(2.0 * shape.num_parameters,
                                hardware.peak_flops * hardware.flops_efficiency
                                * config.tensor_parallel_size, kv_bytes,
                                hardware.host_bandwidth or hardware.memory_bandwidth)
    else:
        costs = (PreemptionCosts(**facts["preemption_costs"])
                 if facts.get("preemption_costs") else None)
    spec = ReplicaSpec(scheduler, cache, blocks, swap_blocks, max_model_len, vocab, kv_bytes,
                       costs, config.num_spec_tokens, config.spec_acceptance_rate,
                       config.timeseries_interval)
    requests, desc = load_requests(config, max_model_len)
    return SimSetup(config, requests, step_model, spec, hardware, shape, desc)


def run(setup: SimSetup, monitor=None) -> FleetResult:
    """Build the fleet of a SimSetup and replay its requests (until `monitor`, a
    fleet.SloMonitor, says the SLO is missed)."""
    config, spec = setup.config, setup.replica_spec
    clock = SimClock()
    maker = wl.PromptMaker(len(setup.requests), config.prefix_groups, config.prefix_len,
                           config.prefix_fraction, config.prefix_zipf, config.seed)
    if config.disaggregated:
        prefill = [Replica(i, spec, setup.step_model, clock, config.seed, "prefill")
                   for i in range(config.prefill_replicas)]
        decode = [Replica(i, spec, setup.step_model, clock, config.seed, "decode")
                  for i in range(config.decode_replicas)]
        transfer = _transfer_model(setup)
        fleet = Fleet(prefill, fleet_router(config, spec), clock, maker, decode,
                      fleet_router(config, spec), transfer, monitor,
                      config.front_end_ms / 1000.0)
    else:
        replicas = [Replica(i, spec, setup.step_model, clock, config.seed)
                    for i in range(config.replicas)]
        fleet = Fleet(replicas, fleet_router(config, spec), clock, maker, monitor=monitor,
                      front_end_s=config.front_end_ms / 1000.0)
    return fleet.run(setup.requests)


def fleet_router(config: SimConfig, spec: ReplicaSpec) -> Router:
    """The production router `--routing` names (treadle/router), with the parameters the
    server gives it for engines of this block size and KV size (the route_* defaults of
    `treadle serve --replicas`); one per pool (under P/D, the decode pool gets its own)."""
    block_size = spec.cache.block_size
    options = PrefixRouterOptions(chunk_size=block_size,
                                  capacity_tokens=max(spec.num_kv_blocks * block_size, block_size),
                                  min_match_tokens=block_size)
    return make_router(config.routing, options)


def _transfer_model(setup: SimSetup):
    config, spec = setup.config, setup.replica_spec
    if setup.hardware is not None:
        hardware, shape, tp = setup.hardware, setup.shape, config.tensor_parallel_size
        bandwidth = config.kv_transfer_bandwidth
        kv_transfer_seconds(hardware, shape, 1, tp, bandwidth)  # fails early without a link
        return lambda num_tokens: kv_transfer_seconds(hardware, shape, num_tokens, tp, bandwidth)
    if config.kv_transfer_bandwidth is None:
        raise ValueError("P/D with a fitted step model needs --kv-transfer-bandwidth")
    per_token = spec.kv_bytes_per_token / config.kv_transfer_bandwidth
    return lambda num_tokens: num_tokens * per_token


def simulate(config: SimConfig, engine_options: dict | None = None,
             with_requests: bool = True) -> dict:
    """Build, run and summarize one simulation (the bench-serve-shaped result)."""
    setup = build(config, engine_options)
    result = run(setup)
    summary = summarize_fleet(result, config.slo_ttft_ms, config.slo_tpot_ms, with_requests)
    summary["workload"] = setup.description
    spec = setup.replica_spec
    summary["simulation"] |= {
        "step_model": setup.step_model.describe(),
        "config": dataclasses.asdict(config),
        "replica": {"scheduler": dataclasses.asdict(spec.scheduler),
                    "cache": dataclasses.asdict(spec.cache), "num_kv_blocks": spec.num_kv_blocks,
                    "num_swap_blocks": spec.num_swap_blocks, "max_model_len": spec.max_model_len,
                    "kv_bytes_per_token": spec.kv_bytes_per_token}}
    return summary
