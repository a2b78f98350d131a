"""Loading a Hugging Face checkpoint directory into a treadle model.

Owns reading config.json, the dtype a name means (`resolve_dtype`; what `auto` means is
the platform's answer, handed in: worker/cpu/platform.py), finding the safetensors files
(single file or sharded index) and handing them to the model's `load_weights` as a
WeightSource (models/weights.py: tensors read whole or by slices, cast to the dtype as
they are read). It never downloads anything, never touches the tokenizer and never
allocates the KV cache.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open

from treadle.models.registry import resolve_model_class
from treadle.models.weights import SafetensorsSource

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


AutoDtype = Callable[[], "tuple[torch.dtype, str]"]
"""What `dtype=auto` means where the model runs, and why (for the log): the platform's
answer (worker/cpu/platform.py `auto_dtype` on the CPU), asked only for `auto`."""


def resolve_dtype(name: str | torch.dtype, auto: AutoDtype | None = None) -> torch.dtype:
    """A torch dtype as it is; `float32`, `bfloat16`; or `auto`: what `auto()` chooses
    (the choice is logged). `auto` without a chooser is a ValueError: only the platform
    knows what it means."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if auto is None:
            raise ValueError("dtype auto needs the platform's choice (resolve_dtype's `auto`)")
        dtype, why = auto()
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
               device: torch.device | str = "cpu", parallel=None, auto: AutoDtype | None = None
               ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the checkpoint's model with its weights on `device`, in eval mode and without
    gradients. `dtype` is a torch dtype or a name for `resolve_dtype` (with `auto`, the
    platform's choice, which matters for `auto` only); `parallel` (a
    layers.parallel.ParallelContext) makes it this rank's shard, reading only its
    slices of the files. Returns (model, config dict)."""
    model, config, _ = build_model(model_dir, dtype, device, parallel, auto)
    return model, config


def build_model(model_dir: str | Path, dtype: str | torch.dtype,
                device: torch.device | str = "cpu", parallel=None, auto: AutoDtype | None = None
                ) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """`load_model`, also returning the bytes read from the checkpoint files.

    Parameters are allocated uninitialized (built on the meta device, then materialized
    empty) since every one of them is overwritten."""
    config = read_config(model_dir)
    model_class = resolve_model_class(config.get("architectures"))
    torch_dtype = resolve_dtype(dtype, auto)
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
