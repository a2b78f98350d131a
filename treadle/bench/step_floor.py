"""How close a traced run came to the machine's floor, step by step.

Per step: the arithmetic it does and the bytes it reads (so a run's achieved GFLOP/s and
GB/s follow from its step times alone), and its floor. A step's floor is a roofline in two
phases that do not overlap each other: the linears
(their arithmetic at the measured peak, or streaming the weights at the measured read
rate, whichever is longer) and then attention (its arithmetic, or reading the cached K/V
it attends to, whichever is longer). Per step, from the trace's features
(treadle/engine/trace.py):

    linears   = body x (prefill + decode tokens) + head x (rows that sample)
    attention = 4 x q_width x layers x (prefill pairs + decode context x tokens per row)
    K/V bytes = (prefill + decode context tokens) x kv_bytes_per_token
    floor     = max(linears / peak, weight_bytes / read) + max(attention / peak, K/V / read)

`body` is 2 x the weights of the linears below the LM head, `head` 2 x the LM head's; a row
samples when it decodes (each of its tokens) or when its prefill chunk is the request's
last before it decodes or finishes (a chunk that leaves more of the prompt for later steps
skips the head). The costs are the benchmark model's (measure/benchmark_shapes.py; the demo
model and SmolLM2-135M have them), with its weights in the trace's dtype; a trace of
another model is refused rather than priced wrong. Must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.measure import benchmark_shapes as shapes
from treadle.engine.trace import Trace, TraceStep

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class StepCosts:
    """What the floor prices, per unit."""

    body_flops_per_token: float
    head_flops_per_row: float
    attention_flops_per_pair: float
    weight_bytes: float
    """Bytes of weights every step streams (the LM head / embedding once)."""
    kv_bytes_per_token: float


def benchmark_model_costs(engine: dict) -> StepCosts:
    """The benchmark model's costs for a trace header's engine facts; ValueError when the
    trace is of another model or a dtype without a known width."""
    params, vocab = engine.get("num_parameters"), engine.get("vocab_size")
    if params != shapes.NUM_PARAMETERS or vocab != shapes.VOCAB:
        raise ValueError(
            f"the floor knows the benchmark model's shapes only ({shapes.NUM_PARAMETERS} "
            f"parameters, vocab {shapes.VOCAB}); this trace's engine has num_parameters="
            f"{params}, vocab_size={vocab}")
    dtype = engine.get("dtype")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: the floor prices weights in "
                         f"{sorted(_DTYPE_BYTES)} only")
    kv = engine.get("kv_bytes_per_token")
    if not kv:
        raise ValueError("the trace's header has no kv_bytes_per_token (a version-1 trace?)")
    return StepCosts(
        body_flops_per_token=2.0 * shapes.linear_parameters(with_lm_head=False),
        head_flops_per_row=2.0 * shapes.HIDDEN * shapes.VOCAB,
        attention_flops_per_pair=4.0 * shapes.NUM_HEADS * shapes.HEAD_DIM * shapes.NUM_LAYERS,
        weight_bytes=float(_DTYPE_BYTES[dtype] * shapes.NUM_PARAMETERS),
        kv_bytes_per_token=float(kv))


def sampling_prefill_rows(trace: Trace) -> list[int]:
    """Per step of the trace: its prefill rows that sample a token (the request decodes
    next, or finishes in that step)."""
    next_kind: dict[str, str] = {}
    counts = [0] * len(trace.steps)
    for i in range(len(trace.steps) - 1, -1, -1):
        step = trace.steps[i]
        finished = {rid for rid, _ in step.finished}
        for rid, _, kind in step.scheduled:  # a request runs at most once a step
            if kind == "prefill" and (rid in finished or next_kind.get(rid) == "decode"):
                counts[i] += 1
            next_kind[rid] = kind
    return counts


@dataclass(frozen=True)
class StepWork:
    """One step's work as the floor counts it."""

    linear_flops: float
    attention_flops: float
    kv_bytes: float

    def floor_seconds(self, costs: StepCosts, peak_flops_per_s: float,
                      read_bytes_per_s: float) -> float:
        return (max(self.linear_flops / peak_flops_per_s,
                    costs.weight_bytes / read_bytes_per_s)
                + max(self.attention_flops / peak_flops_per_s,
                      self.kv_bytes / read_bytes_per_s))


def step_work(step: TraceStep, sampling_prefill: int, costs: StepCosts) -> StepWork:
    """The work of one step with features (a version-2 trace)."""
    f = step.features
    if f is None:
        raise ValueError(f"step {step.step} has no features (a version-1 trace)")
    tokens = f["prefill_tokens"] + f["decode_tokens"]
    per_row = f["decode_tokens"] / f["decode_rows"] if f["decode_rows"] else 0.0
    pairs = f["prefill_attention_pairs"] + f["decode_context_tokens"] * per_row
    return StepWork(
        linear_flops=(costs.body_flops_per_token * tokens
                      + costs.head_flops_per_row * (f["decode_tokens"] + sampling_prefill)),
        attention_flops=costs.attention_flops_per_pair * pairs,
        kv_bytes=costs.kv_bytes_per_token
        * (f["prefill_context_tokens"] + f["decode_context_tokens"]))


@dataclass(frozen=True)
class StepRoofline:
    """One step as the roofline sees it."""

    flops: float
    """The linears' and attention's arithmetic."""
    bytes: float
    """The weights and the K/V the step reads."""
    floor_seconds: float | None
    """The floor at the given peak and read rate; None when they were not given."""


def step_rooflines(trace: Trace, peak_gflops: float | None = None,
                   read_gbs: float | None = None) -> list[StepRoofline]:
    """Each step's arithmetic and bytes, and its floor at `peak_gflops` GFLOP/s and
    `read_gbs` GB/s when both are given. ValueError for a trace of another model, a
    version-1 trace or rates that are not positive."""
    with_floor = peak_gflops is not None and read_gbs is not None
    if with_floor and (peak_gflops <= 0 or read_gbs <= 0):
        raise ValueError(f"peak_gflops and read_gbs must be > 0, got {peak_gflops}, "
                         f"{read_gbs}")
    costs = benchmark_model_costs(trace.engine)
    result = []
    for step, n in zip(trace.steps, sampling_prefill_rows(trace)):
        work = step_work(step, n, costs)
        floor = (work.floor_seconds(costs, peak_gflops * 1e9, read_gbs * 1e9)
                 if with_floor else None)
        result.append(StepRoofline(work.linear_flops + work.attention_flops,
                                   costs.weight_bytes + work.kv_bytes, floor))
    return result
