"""Loading a Hugging Face checkpoint directory into a treadle model.

Owns reading config.json, choosing the dtype (`resolve_dtype`; for `auto` it may build
the C kernels to learn whether bf16 runs fast here), finding the safetensors files
(single file or sharded index) and handing them to the model's `load_weights` as a
WeightSource (models/weights.py: tensors read whole or by slices, cast to the dtype as
they are read). It never downloads anything, never touches the tokenizer and never
allocates the KV cache.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from treadle.models.registry import resolve_model_class
from treadle.models.weights import SafetensorsSource
from treadle.worker.cpu_isa import cpu_flags

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def cpu_supports_bf16() -> bool:
    """True when the CPU does bfloat16 math natively (x86 AVX512-BF16/AMX, ARM BF16).

    False whenever this cannot be established (non-Linux, unreadable /proc/cpuinfo).
    """
    words = cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in words
    return any(flag in words for flag in _BF16_CPU_FLAGS)


def auto_dtype(kernel_isa: str = "auto") -> tuple[torch.dtype, str]:
    """What `dtype=auto` means on this machine, and why (for the log).

    bfloat16 where the CPU does bf16 math natively, or where the C kernels build for an
    AVX-512 or AVX2 level (kernel_isa: ModelConfig.kernel_isa): they keep bf16 weights and
    KV in memory and widen them to fp32 in registers, so a decode step reads half the
    bytes of float32. float32 only where neither holds.
    """
    if cpu_supports_bf16():
        return torch.bfloat16, "the CPU has bf16 instructions"
    from treadle.worker.native import load_kernels

    kernels = load_kernels(kernel_isa)
    if kernels is not None and kernels.simd_width:
        return torch.bfloat16, (f"no bf16 instructions, but the {kernels.isa} C kernels "
                                f"widen bf16 to fp32 in registers")
    return torch.float32, "no bf16 instructions and no AVX-512 or AVX2 C kernels"


def resolve_dtype(name: str, kernel_isa: str = "auto") -> torch.dtype:
    """`float32`, `bfloat16`, or `auto` (`auto_dtype`: bfloat16 unless neither bf16
    instructions nor the AVX-512/AVX2 kernels are there; the choice is logged)."""
    if name == "auto":
        dtype, why = auto_dtype(kernel_isa)
        logger.info("dtype auto -> %s: %s", str(dtype).replace("torch.", ""), why)
        return dtype
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
               device: torch.device | str = "cpu", parallel=None, kernel_isa: str = "auto"
               ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the checkpoint's model with its weights on `device`, in eval mode and without
    gradients. `dtype` is a torch dtype or a name for `resolve_dtype` (with `kernel_isa`,
    ModelConfig.kernel_isa, which matters for `auto` only); `parallel` (a
    worker.parallel_state.ParallelContext) makes it this rank's shard, reading only its
    slices of the files. Returns (model, config dict)."""
    model, config, _ = build_model(model_dir, dtype, device, parallel, kernel_isa)
    return model, config


def build_model(model_dir: str | Path, dtype: str | torch.dtype,
                device: torch.device | str = "cpu", parallel=None, kernel_isa: str = "auto"
                ) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """`load_model`, also returning the bytes read from the checkpoint files.

    Parameters are allocated uninitialized (built on the meta device, then materialized
    empty) since every one of them is overwritten."""
    config = read_config(model_dir)
    model_class = resolve_model_class(config.get("architectures"))
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, kernel_isa)
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
