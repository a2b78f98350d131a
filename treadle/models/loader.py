"""Loading a Hugging Face checkpoint directory into a treadle model.

Owns reading config.json, choosing the dtype (`resolve_dtype`), finding the safetensors
files (single file or sharded index) and handing them to the model's `load_weights` as a
WeightSource (models/weights.py: tensors read whole or by slices, cast to the dtype as
they are read). It never downloads anything, never
touches the tokenizer and never allocates the KV cache.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from treadle.models.registry import resolve_model_class
from treadle.models.weights import SafetensorsSource

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def cpu_supports_bf16() -> bool:
    """True when the CPU does bfloat16 math natively (x86 AVX512-BF16/AMX, ARM BF16).

    False whenever this cannot be established (non-Linux, unreadable /proc/cpuinfo).
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in words
    return any(flag in words for flag in _BF16_CPU_FLAGS)


def resolve_dtype(name: str) -> torch.dtype:
    """`float32`, `bfloat16`, or `auto` (bfloat16 where the CPU supports it, else float32)."""
    if name == "auto":
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, got {name!r}")
    return _DTYPES[name]


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the sharded index's shards, or model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"checkpoint shard {shard} listed in {index} is missing")
        if not shards:
            raise ValueError(f"{index} has an empty weight_map")
        return shards
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no weights in {model_dir}: looked for {SINGLE_FILE} and {INDEX_FILE}")


def iterate_weights(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the files, each cast to dtype as it is read."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor if tensor.dtype == dtype else tensor.to(dtype)


def load_model(model_dir: str | Path, dtype: str | torch.dtype,
               device: torch.device | str = "cpu", parallel=None
               ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the checkpoint's model with its weights on `device`, in eval mode and without
    gradients. `dtype` is a torch dtype or a name for `resolve_dtype`; `parallel` (a
    worker.parallel_state.ParallelContext) makes it this rank's shard, reading only its
    slices of the files. Returns (model, config dict)."""
    model, config, _ = build_model(model_dir, dtype, device, parallel)
    return model, config


def build_model(model_dir: str | Path, dtype: str | torch.dtype,
                device: torch.device | str = "cpu", parallel=None
                ) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """`load_model`, also returning the bytes read from the checkpoint files.

    Parameters are allocated uninitialized (built on the meta device, then materialized
    empty) since every one of them is overwritten."""
    config = read_config(model_dir)
    model_class = resolve_model_class(config.get("architectures"))
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = (model_class(config, torch_dtype) if parallel is None
                 else model_class(config, torch_dtype, parallel))
    model.to_empty(device=device)
    source = SafetensorsSource(files, torch_dtype)
    model.load_weights(source)
    model.eval()
    model.requires_grad_(False)
    return model, config, source.num_bytes_read
