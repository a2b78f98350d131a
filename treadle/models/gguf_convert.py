"""A GGUF file as a Hugging Face checkpoint directory, converted once and cached.

Owns the conversion (config.json and generation_config.json from the metadata, the
dequantized tensors as safetensors in the engine's dtype, sharded past 4 GiB, the tokenizer
and chat template through transformers' GGUF tokenizer support, and treadle_gguf.json
recording the source) and the cache of conversions under treadle's cache dir, keyed by the
file's sha256 and the dtype, so that a second start loads the safetensors directly. A
conversion is written into a temporary sibling and renamed into place: the cache never
holds half a checkpoint. It never loads a model and never downloads anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from treadle.models.gguf_reader import check_supported, dequantize, hf_config, open_gguf, \
    raw_tensors
from treadle.paths import cache_dir as default_cache_dir

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
"""Part of the cache key: bump it when the files a conversion writes change."""
CONVERT_SECONDS_PER_MB = 0.16
"""A conversion's time per MB of GGUF file, for the log line before it: 16 s for the
default model's 98 MB on a shared 2-core machine (38 s at a load average of 20)."""
SHARD_BYTES = 4 * 1024**3
SOURCE_FILE = "treadle_gguf.json"
"""Written last into a conversion: the GGUF file it came from and its tensor types."""
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def file_sha256(path: str | Path, chunk_bytes: int = 8 * 1024**2) -> str:
    """The file's sha256 (about 1.5 GB/s here: 0.07 s for the 98 MB default model),
    read once per process while the file's size, mtime and inode stay the same (start-up
    asks for it twice: the conversion cache's key, then --quantization's source check)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _SHA256_SEEN:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
        _SHA256_SEEN[key] = digest.hexdigest()
    return _SHA256_SEEN[key]


_SHA256_SEEN: dict[tuple, str] = {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tensors(gguf, config: dict[str, Any], out: Path, dtype: torch.dtype) -> Counter:
    """Dequantize every tensor into out/model*.safetensors; the count of each GGUF type.

    Shards of at most SHARD_BYTES are saved as they fill, so memory holds one shard."""
    types: Counter = Counter()
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    size = 0

    def flush() -> None:
        save_file(shard, str(out / f".shard-{len(shard_names)}.safetensors"),
                  metadata={"format": "pt"})
        shard_names.append(list(shard))
        shard.clear()

    for raw in raw_tensors(gguf, config):
        types[raw.tensor_type] += 1
        if raw.hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        tensor = dequantize(raw, dtype)
        if shard and size + tensor.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[raw.hf_name] = tensor
        size += tensor.nbytes
    if shard:
        flush()
    if len(shard_names) == 1:
        os.replace(out / ".shard-0.safetensors", out / "model.safetensors")
        return types
    weight_map = {}
    for i, names in enumerate(shard_names):
        file_name = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
        os.replace(out / f".shard-{i}.safetensors", out / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    _write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    return types


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    """The tokenizer (and chat template) that transformers builds from the GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                  gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many kinds; name the file and the cause
        raise ValueError(f"cannot build a tokenizer from the metadata of {gguf_path}: "
                         f"{exc}") from exc
    tokenizer.save_pretrained(str(out))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Write the HF checkpoint of `gguf_path` into the existing empty `out_dir`.

    Returns the config dict. Unsupported architectures, metadata and tensor types raise
    ValueError naming them, before anything is written.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    gguf = open_gguf(gguf_path)
    config = hf_config(gguf)
    check_supported(gguf)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    types = _write_tensors(gguf, config, out, dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config})
    _write_tokenizer(gguf_path, out)
    _write_json(out / SOURCE_FILE, {
        "source": str(gguf_path.resolve()), "sha256": file_sha256(gguf_path),
        "architecture": gguf.arch.gguf_name, "general.name": gguf.get("general.name"),
        "tensor_types": dict(sorted(types.items())), "dtype": _DTYPE_NAMES[dtype],
        "converter_version": CONVERTER_VERSION})
    return config


def conversion_dir(gguf_path: str | Path, dtype: torch.dtype,
                   cache_dir: str | Path | None = None) -> Path:
    """`<cache>/gguf/<sha256 prefix>-<dtype>-v<version>`: the folder of the file's
    conversion to `dtype` (the checkpoint is a folder inside it; the weight cache of its
    quantized linears sits beside it, worker/cpu/weight_cache.py)."""
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "gguf"
    return root / f"{file_sha256(gguf_path)[:24]}-{_DTYPE_NAMES[dtype]}-v{CONVERTER_VERSION}"


def cached_checkpoint(gguf_path: str | Path, dtype: torch.dtype, name: str | None = None,
                      cache_dir: str | Path | None = None) -> Path:
    """The converted checkpoint of a GGUF file, converting it on first use.

    It lives at `<cache>/gguf/<sha256 prefix>-<dtype>-v<version>/<name>` (name: the file's
    stem unless given; it becomes the served model name). Concurrent first uses are
    serialized by a lock file; a later start only hashes the file.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"cannot convert GGUF to dtype {dtype}")
    folder = conversion_dir(gguf_path, dtype, cache_dir)
    root, key = folder.parent, folder.name
    path = folder / (name or gguf_path.stem)
    if (path / SOURCE_FILE).is_file():
        _record_source(path, gguf_path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (path / SOURCE_FILE).is_file():  # another process converted it meanwhile
            return path
        if path.exists():  # not a conversion of ours (ours appear whole): start afresh
            shutil.rmtree(path)
        size_mb = gguf_path.stat().st_size / 1e6
        logger.info("converting %s (%.0f MB) to a Hugging Face checkpoint (%s) in %s: about "
                    "%.0f s on an idle 2-core machine, once; later starts reuse it", gguf_path,
                    size_mb, _DTYPE_NAMES[dtype], path, size_mb * CONVERT_SECONDS_PER_MB)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            convert_gguf(gguf_path, tmp, dtype)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return path


def _record_source(checkpoint: Path, gguf_path: Path) -> None:
    """Point a cached conversion's record at `gguf_path`, a file with the recorded content
    found at another path (a copy, or the first converter's file since moved), so that
    `--quantization gguf` reads the blocks from the file this start was given
    (models/resolve.py `gguf_source`). Written whole with a rename: a concurrent reader
    sees the old record or the new one, both naming a file with this content."""
    record = checkpoint / SOURCE_FILE
    info = json.loads(record.read_text(encoding="utf-8"))
    source = str(gguf_path.resolve())
    if info.get("source") == source:
        return
    info["source"] = source
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    try:
        _write_json(tmp, info)
        os.replace(tmp, record)
    except OSError as exc:  # a read-only cache: the old record stays, and says where
        logger.warning("could not update %s to name %s: %s", record, source, exc)
        tmp.unlink(missing_ok=True)
