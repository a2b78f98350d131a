"""Helpers every benchmark shares: environment record, percentiles, JSON output, text tables.

Owns how results are summarized and written (vLLM `bench serve` style mean / median /
p90 / p99). Must not: run or time anything, record the host name or any credential,
or depend on a particular benchmark's result layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import numpy as np


def _version(package: str, default: str = "not installed") -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return default


def cpu_info() -> tuple[str, list[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; platform.processor() elsewhere."""
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def environment() -> dict:
    """Versions and hardware that a figure depends on (no host name)."""
    import torch

    cpu_model, flags = cpu_info()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "numpy": np.__version__,
        "treadle": _version("treadle", "dev"),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": bool(torch.cuda.is_available()),
    }


def percentiles(values: Iterable[float]) -> dict:
    """mean, median, p90, p99 (numpy linear interpolation). Empty input -> all NaN
    (written to JSON as null), so a missing figure never reads as a zero."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {"mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan}
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def to_jsonable(value: Any) -> Any:
    """numpy scalars / arrays, dataclasses, Paths, tuples, sets -> plain JSON values;
    NaN and infinities -> None (strict JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def write_json(path: str | Path, result: dict) -> Path:
    """Write `result` as indented JSON, creating parent directories; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(result), indent=2, allow_nan=False) + "\n")
    return path


def _cell(value: Any) -> str:
    if isinstance(value, (np.generic,)):
        value = value.item()
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else str(value)
        magnitude = abs(value)
        return f"{value:.0f}" if magnitude >= 1000 else f"{value:.3g}" if magnitude < 0.01 and value \
            else f"{value:.2f}"
    return str(value)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Plain aligned text table: a header, a rule, one line per row; numbers right-aligned,
    text left-aligned; a missing value shows as '-'."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    numeric = [all(isinstance(row.get(c), (int, float, np.number)) and not isinstance(row.get(c), bool)
                   for row in rows if row.get(c) is not None) for c in columns]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)
