"""The roofline step-time model: a step's seconds from its FLOPs and bytes on given hardware.

Owns `RooflineStepModel`, priced from a `Hardware` and a `ModelShape` at a tensor-parallel
degree p, and the KV capacity a replica of that shape has on that hardware. Per step
(features from treadle.engine.trace.step_features):

    linear    = max(2 * P_layers * T + 2 * P_head * S  over  p * F,
                    (P_layers + P_head) * bytes  over  p * B)
    attention = max(4 * L * H * d * pairs  over  p * F,  KV bytes read + written  over  p * B)
    comm      = L * 2 all-reduces of T * hidden * bytes (ring: 2 (p-1)/p * size / link
                + 2 (p-1) hops of latency), when p > 1
    swap      = swap bytes / host link;   step = linear + attention + comm + swap + overhead

with T the step's tokens, S the rows that produce logits (decode tokens, prefill rows),
F and B the peak FLOP/s and bandwidth times their efficiencies. It never looks at the
request mix beyond those features: no kernel launch pattern, no batch-size-dependent
efficiency, no overlap of communication with compute (docs/simulator.md lists the
caveats). No torch here.
"""

from __future__ import annotations

import dataclasses

from treadle.sim.hardware import Hardware, ModelShape


class RooflineStepModel:
    """Seconds of a step of `shape` on `tensor_parallel_size` devices of `hardware`."""

    def __init__(self, hardware: Hardware, shape: ModelShape,
                 tensor_parallel_size: int = 1) -> None:
        p = tensor_parallel_size
        if p < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {p}")
        if shape.num_kv_heads % p and p % shape.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {p} does not divide the "
                             f"{shape.num_kv_heads} KV heads of {shape.name} "
                             "(nor is it a multiple of them)")
        if p > 1 and hardware.interconnect_bandwidth <= 0:
            raise ValueError(f"hardware {hardware.name} has no interconnect_bandwidth: "
                             f"tensor_parallel_size {p} needs one")
        self.hardware, self.shape, self.tensor_parallel_size = hardware, shape, p
        hw, s = hardware, shape
        self._flops = p * hw.peak_flops * hw.flops_efficiency
        bandwidth = p * hw.memory_bandwidth * hw.bandwidth_efficiency
        self._weight_seconds = ((s.num_layers * s.layer_parameters + s.lm_head_parameters)
                                * s.dtype_bytes / bandwidth)
        self._kv_seconds_per_token = s.kv_bytes_per_token / bandwidth
        self._attention_flops_per_pair = 4 * s.num_layers * s.num_heads * s.head_dim
        self._layer_flops_per_token = 2 * s.num_layers * s.layer_parameters
        self._head_flops_per_row = 2 * s.lm_head_parameters
        if p > 1:
            ring = 2 * (p - 1) / p * s.hidden_size * s.dtype_bytes / hw.interconnect_bandwidth
            self._comm_per_token = 2 * s.num_layers * ring
            self._comm_fixed = 2 * s.num_layers * 2 * (p - 1) * hw.interconnect_latency
        else:
            self._comm_per_token = self._comm_fixed = 0.0
        self._host_bandwidth = hw.host_bandwidth or hw.memory_bandwidth
        self._overhead = hw.step_overhead

    @property
    def name(self) -> str:
        return (f"roofline({self.hardware.name}, {self.shape.name}, "
                f"tp={self.tensor_parallel_size})")

    def step_seconds(self, f: dict) -> float:
        decode_tokens = f["decode_tokens"]
        tokens = f["prefill_tokens"] + decode_tokens
        swap = (f["swap_out_bytes"] + f["swap_in_bytes"]) / self._host_bandwidth
        if tokens == 0:
            return swap + self._overhead
        linear_flops = (self._layer_flops_per_token * tokens
                        + self._head_flops_per_row * (decode_tokens + f["prefill_rows"]))
        linear = max(linear_flops / self._flops, self._weight_seconds)
        decode_rows = f["decode_rows"]
        decode_pairs = (f["decode_context_tokens"] * decode_tokens / decode_rows
                        if decode_rows else 0)
        pairs = f["prefill_attention_pairs"] + decode_pairs
        kv_tokens = f["decode_context_tokens"] + f["prefill_context_tokens"] + tokens
        attention = max(pairs * self._attention_flops_per_pair / self._flops,
                        kv_tokens * self._kv_seconds_per_token)
        comm = self._comm_fixed + tokens * self._comm_per_token
        return linear + attention + comm + swap + self._overhead

    def gap_seconds(self, f: dict) -> float:
        """Time between the end of a step and the next one's start (in step_overhead)."""
        return 0.0

    def describe(self) -> dict:
        hw, s = self.hardware, self.shape
        return {"kind": "roofline", "name": self.name, "hardware": dataclasses.asdict(hw),
                "model_shape": dataclasses.asdict(s) | {
                    "num_parameters": s.num_parameters,
                    "kv_bytes_per_token": s.kv_bytes_per_token},
                "tensor_parallel_size": self.tensor_parallel_size}


def num_kv_blocks(hardware: Hardware, shape: ModelShape, tensor_parallel_size: int,
                  block_size: int) -> int:
    """KV blocks a replica of `shape` on `tensor_parallel_size` devices holds: the usable
    memory of each device less its weight shard and activation reserve (at most the
    hardware's kv_cache_bytes when it sets one), over the KV bytes of a block (each
    device holds its share of every block's heads)."""
    p = tensor_parallel_size
    per_device = (hardware.memory_bytes * hardware.memory_utilization - shape.weight_bytes / p
                  - hardware.activation_reserve_bytes)
    if hardware.kv_cache_bytes and per_device > 0:
        per_device = min(per_device, hardware.kv_cache_bytes)
    if per_device <= 0:
        raise ValueError(f"{shape.name} ({shape.weight_bytes / 1e9:.1f} GB of weights) does "
                         f"not fit on {p} x {hardware.name} "
                         f"({hardware.memory_bytes / 1e9:.0f} GB each)")
    return int(per_device * p // (shape.kv_bytes_per_token * block_size))


def kv_transfer_seconds(hardware: Hardware, shape: ModelShape, num_tokens: int,
                        tensor_parallel_size: int = 1, bandwidth: float | None = None) -> float:
    """P/D: seconds to move the KV of `num_tokens` from a prefill replica to a decode
    replica, each of the p devices sending its shard over its own link."""
    link = bandwidth if bandwidth is not None else hardware.network_bandwidth
    if link <= 0:
        raise ValueError(f"hardware {hardware.name} has no network_bandwidth for the KV "
                         "transfer; give --kv-transfer-bandwidth")
    return (hardware.network_latency
            + num_tokens * shape.kv_bytes_per_token / (tensor_parallel_size * link))
