"""What the roofline step-time model is told about the machine and the model.

Owns two descriptions and where they come from: `Hardware` (peak FLOP/s, memory bandwidth
and capacity, interconnect between tensor-parallel ranks, host link for swap, network for
a P/D KV transfer, per-step overhead) and `ModelShape` (layers, widths, heads, vocabulary:
what parameters, FLOPs and KV bytes follow from). Presets are YAML files in
treadle/sim/presets/ (`cpu-here`, `h200`, `a100`; `llama-3-8b`, `smollm2-135m`); a FILE.yaml
of the same fields, or a Hugging Face config.json for a shape, may be given instead.
`measure_cpu_here` writes the measured preset of the machine it runs on (the only code
here that imports torch, lazily). Nothing here simulates or decides anything.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
HARDWARE_PRESETS = ("cpu-here", "h200", "a100")
MODEL_PRESETS = ("llama-3-8b", "smollm2-135m")


@dataclass(frozen=True)
class Hardware:
    """One device (a GPU, or a whole CPU) and its links. Rates per device, per direction."""

    name: str
    peak_flops: float
    """Dense bf16 matmul FLOP/s of one device (published, or measured for a CPU)."""
    memory_bandwidth: float
    """Bytes/s between the device and its memory."""
    memory_bytes: float
    """Memory of one device (weights + KV cache + activations)."""
    flops_efficiency: float = 1.0
    """Fraction of peak_flops a large matmul reaches (1 for a measured peak)."""
    bandwidth_efficiency: float = 1.0
    """Fraction of memory_bandwidth a streaming kernel reaches (1 for a measured rate)."""
    interconnect_bandwidth: float = 0.0
    """Bytes/s one device sends to its tensor-parallel peers (NVLink per direction)."""
    interconnect_latency: float = 0.0
    """Seconds per hop of an all-reduce ring."""
    host_bandwidth: float = 0.0
    """Bytes/s between device and host memory (swap copies); 0: same memory."""
    network_bandwidth: float = 0.0
    """Bytes/s of the link a P/D KV transfer crosses (RDMA NIC per device)."""
    network_latency: float = 0.0
    """Seconds of fixed cost per KV transfer."""
    step_overhead: float = 0.0
    """Seconds every step costs outside the model (scheduling, launch, sampling)."""
    memory_utilization: float = 0.9
    """Fraction of memory_bytes the engine may use for weights, KV and activations."""
    activation_reserve_bytes: float = 0.0
    """Memory per device kept for activations and workspace (not KV)."""
    kv_cache_bytes: float = 0.0
    """KV-cache memory per device the engine is given; 0: whatever the usable memory
    leaves after the weights and the activation reserve (a GPU engine's way)."""
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name}: {name} must be > 0, "
                                 f"got {getattr(self, name)}")
        for name in ("flops_efficiency", "bandwidth_efficiency", "memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name}: {name} must be in (0, 1], "
                                 f"got {getattr(self, name)}")
        for name in ("interconnect_bandwidth", "interconnect_latency", "host_bandwidth",
                     "network_bandwidth", "network_latency", "step_overhead",
                     "activation_reserve_bytes", "kv_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware {self.name}: {name} must be >= 0, "
                                 f"got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Llama family: fused attention and gated MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2
    """Bytes per weight and per KV element (bf16: 2)."""
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"model shape {self.name}: {f.name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model shape {self.name}: num_heads ({self.num_heads}) must be "
                             f"a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def layer_parameters(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and gate, up, down."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        return q + kv + o + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_parameters + self.lm_head_parameters + embed

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (the whole model, every TP rank)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _from_dict(cls, data: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _preset_path(name: str, presets: tuple[str, ...], kind: str) -> Path:
    if name in presets:
        return PRESETS_DIR / f"{name}.yaml"
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"{kind} must be one of {', '.join(presets)} or a YAML file, "
                         f"got {name!r}")
    return path


def load_hardware(name: str) -> Hardware:
    """A preset name (cpu-here, h200, a100) or a YAML file of Hardware's fields."""
    path = _preset_path(name, HARDWARE_PRESETS, "hardware")
    data = yaml.safe_load(path.read_text()) or {}
    data = {k: (float(v) if isinstance(v, (int, float, str)) and k not in ("name", "description")
                else v) for k, v in data.items()}
    data.setdefault("name", path.stem)
    return _from_dict(Hardware, data, str(path))


def model_shape_from_hf_config(config: dict, name: str = "model") -> ModelShape:
    """A ModelShape from a Hugging Face config.json (Llama, Mistral, Qwen2/3 keys)."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            name=name, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_model_len=int(config.get("max_position_embeddings", 4096)),
            dtype_bytes=4 if config.get("torch_dtype") == "float32" else 2,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise ValueError(f"config.json of {name}: missing {exc}") from None


def load_model_shape(name: str) -> ModelShape:
    """A preset name (llama-3-8b, smollm2-135m), a YAML file of ModelShape's fields, a
    Hugging Face config.json, or a checkpoint folder holding one."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if name not in MODEL_PRESETS and path.suffix == ".json" and path.is_file():
        return model_shape_from_hf_config(json.loads(path.read_text()), path.parent.name)
    path = _preset_path(name, MODEL_PRESETS, "model shape")
    data = yaml.safe_load(path.read_text()) or {}
    data.setdefault("name", path.stem)
    return _from_dict(ModelShape, data, str(path))


def measure_cpu_here(dtype: str = "bfloat16", repeats: int = 10) -> dict:
    """Measure this machine's preset: the peak matmul rate on the benchmark model's shapes
    (treadle.measure.peak) and the memory bandwidth of a large copy. Returns Hardware's
    fields as a dict (write it as YAML)."""
    import os

    from treadle.measure.peak import measure_memory_bandwidth, measure_peak_matmul

    # Best over 1 thread and all cores: on a shared machine a team of threads can stall
    # on the slowest one, and a preset is what the machine can do.
    threads = sorted({1, os.cpu_count() or 1})
    peak = max((measure_peak_matmul(dtype, rows=(64, 256, 512), repeats=repeats,
                                    num_threads=t) for t in threads),
               key=lambda r: r["gflops"])
    bandwidth = max((measure_memory_bandwidth(repeats=repeats, num_threads=t)
                     for t in threads), key=lambda r: r["bytes_per_s"])
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        total = 16 * 1024**3
    return {"name": "cpu-here", "peak_flops": peak["gflops"] * 1e9,
            "memory_bandwidth": bandwidth["bytes_per_s"], "memory_bytes": float(total),
            "flops_efficiency": 1.0, "bandwidth_efficiency": 1.0,
            "description": (f"measured: F.linear {dtype} on the benchmark model's shapes "
                            f"(best of rows 64/256/512: {peak['best_rows']}), "
                            f"{peak['num_threads']} threads; copy of "
                            f"{bandwidth['size_bytes'] // 2**20} MiB, "
                            f"{bandwidth['num_threads']} threads")}
