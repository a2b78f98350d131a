"""The quantized linears of a model as made once, kept on disk for the next start.

`--quantization gguf` (the default model's) takes every projection's blocks out of the
GGUF file (parsing its metadata took 6 s per read on a busy 2-core machine, twice per
start) and repacks each for the r16 kernel; `int8` quantizes every weight at load. This
module keeps what that made — each linear's blocks, INT8 scales and r16 copy, which
layers stayed dense, the mode — in one safetensors file, so that a second start reads it
back (a copy of ~200 MB for SmolLM2-135M) instead of remaking it.

Where: beside the GGUF file's converted checkpoint (`<cache>/gguf/<sha>-<dtype>-v1/
quantized-<mode>-<key>.safetensors`), so that it goes with the conversion. Only models
from a GGUF file are cached: a checkpoint folder's `int8` weights are made again at each
start (a pass over the weights; a key for them would mean hashing the folder's files,
which costs about as much, or trusting their modification times). The key covers what
the bytes depend on: the GGUF file's sha256, the mode, the dtype, the kernel library
(its file name carries the digest of every kernel source and flag, worker/cpu/native.py,
so the r16 layout of another build is never read) and FORMAT_VERSION. Written whole and
renamed into place; an entry that does not fit the model (names, shapes) is ignored and
remade. It decides nothing about which layers quantize (quantized_linears.py does) and
never reads the GGUF file itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from treadle.models.quant_weights import QuantizedLinear

logger = logging.getLogger(__name__)

FORMAT_VERSION = 4  # 2: other GGML block types as Q8_0 made at load; 3: Q4_K's r16 copy;
# 4: Q4_K's r16 copy with AMX too
"""Part of the key: bump it when what is stored, or how, changes."""


def _library_name(kernels) -> str:
    lib = getattr(kernels, "lib", None)
    return Path(getattr(lib, "_name", "") or "torch").name


def cache_path(mode: str, dtype: torch.dtype, kernels, gguf_path: Path) -> Path:
    """The file holding (or to hold) the quantized linears made from this GGUF file in
    this mode and dtype with this kernel build (see the module docstring)."""
    from treadle.models.gguf_convert import conversion_dir, file_sha256

    key = hashlib.sha256("\0".join([
        file_sha256(gguf_path), mode, str(dtype), _library_name(kernels),
        f"v{FORMAT_VERSION}"]).encode()).hexdigest()[:20]
    return conversion_dir(gguf_path, dtype) / f"quantized-{mode}-{key}.safetensors"


class CachedWeights:
    """The quantized linears read back from a cache file, by parameter prefix."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.path, self.tensors, self.meta = path, tensors, meta
        self.layers: dict[str, dict] = meta["layers"]
        self.dense: set[str] = set(meta["dense"])

    @classmethod
    def read(cls, path: Path) -> CachedWeights | None:
        """The cache at `path`, or None when there is none (or it cannot be read)."""
        if not path.is_file():
            return None
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads(f.metadata()["treadle"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors too: remake it
            logger.warning("ignoring the weight cache %s: %s", path, exc)
            return None
        if meta.get("version") != FORMAT_VERSION:
            return None
        return cls(path, tensors, meta)

    def get(self, name: str, shape: tuple[int, int], bias: torch.Tensor | None,
            kernels) -> QuantizedLinear | None:
        """The cached weight of `name`, None for a layer the cache says stays dense.
        KeyError or ValueError when the cache does not hold it as the model has it."""
        if name in self.dense:
            return None
        layer = self.layers[name]
        if (layer["out_features"], layer["in_features"]) != tuple(shape):
            raise ValueError(f"{name}: cached as [{layer['out_features']}, "
                             f"{layer['in_features']}], the model has {list(shape)}")
        scales = self.tensors.get(f"{name}.scales")
        return QuantizedLinear(layer["format"], self.tensors[f"{name}.blocks"],
                               layer["in_features"], scales=scales, bias=bias, kernels=kernels,
                               packed=self.tensors.get(f"{name}.packed"))


def write(path: Path, mode: str, weights: dict[str, QuantizedLinear],
          dense: list[str]) -> None:
    """Store what `attach` made: every quantized linear (blocks, scales, r16 copy) and the
    names that stayed dense. Written to a temporary file and renamed into place; a cache
    that cannot be written is a warning (the next start remakes the weights)."""
    from safetensors.torch import save_file

    tensors, layers = {}, {}
    for name, q in weights.items():
        tensors[f"{name}.blocks"] = q.blocks
        if q.scales is not None:
            tensors[f"{name}.scales"] = q.scales
        if q.packed is not None:  # a slice of the huge-page arena's chunk: copied alone
            tensors[f"{name}.packed"] = q.packed.clone()
        layers[name] = {"format": q.format.name, "in_features": q.in_features,
                        "out_features": q.out_features}
    meta = {"version": FORMAT_VERSION, "mode": mode, "layers": layers, "dense": dense}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"treadle": json.dumps(meta)})
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        logger.warning("could not write the weight cache %s: %s", path, exc)
        return
    logger.info("quantized weights cached for later starts: %s (%.0f MiB)", path,
                path.stat().st_size / 2**20)
