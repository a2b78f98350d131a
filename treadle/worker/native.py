"""C kernels for the CPU attention path, compiled on first use and called through ctypes.

Owns building (gcc, `-O3 -march=native -ffast-math -fopenmp` to compile, fast-math kept
off the link; into `<cache>/kernels/`, keyed by a hash of the source and flags, written
atomically) and the typed call wrappers. The
shared object links `libgomp.so.1` by soname, so inside a process where torch already
loaded its own libgomp there is one OpenMP runtime and one thread pool.

When no compiler is available or the build fails, `load_kernels()` returns None and the
torch implementation in worker/attention.py is used instead: slower, same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from treadle.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
# -ffast-math lets gcc vectorize expf and the reductions (the kernel has no inf/NaN
# inputs by construction: only real context positions are visited). It is given to the
# compile step only: on the link command of a shared object (gcc < 13) it pulls in
# crtfastmath.o, which switches the WHOLE process to flush-to-zero when the library
# loads, silently changing every float computation of numpy, torch and Python (a test
# caught it; tests/integration/test_native_attention.py guards it).
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]


class NativeKernels:
    """Typed wrappers around the compiled kernels."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._decode = {torch.bfloat16: lib.paged_decode_bf16, torch.float32: lib.paged_decode_f32}
        for fn in self._decode.values():
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._decode

    def paged_decode(self, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_table: torch.Tensor,
                     ctx_lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """Attention of one query token per request over its blocks, into `out`.

        query, out: [num_reqs, num_heads, head_dim]; key/value_cache: [kv_heads,
        num_blocks, block_size, head_dim]; block_table: [num_reqs, max_blocks] int64;
        ctx_lens: [num_reqs] int64. All contiguous, on CPU, of one dtype.
        """
        num_reqs, num_heads, head_dim = query.shape
        num_kv_heads, num_blocks, block_size, _ = key_cache.shape
        for t in (query, key_cache, value_cache, block_table, ctx_lens, out):
            assert t.is_contiguous(), "paged_decode needs contiguous tensors"
        status = self._decode[query.dtype](
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_table.data_ptr(), ctx_lens.data_ptr(), out.data_ptr(),
            num_reqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
            block_table.shape[1], scale)
        if status != 0:
            raise ValueError(f"paged_decode: head grouping {num_heads}/{num_kv_heads} x "
                             f"head_dim {head_dim} x block_size {block_size} exceeds its limits")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial, obj = Path(tmp) / target.name, Path(tmp) / "paged_decode.o"
        subprocess.run([compiler, *_COMPILE_FLAGS, str(_SOURCE), "-o", str(obj)],
                       check=True, capture_output=True, text=True, timeout=300)
        subprocess.run([compiler, *_LINK_FLAGS, str(obj), "-o", str(partial), "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(partial, target)


def load_kernels() -> NativeKernels | None:
    """The compiled kernels, building them if needed; None when they cannot be had."""
    if platform.system() != "Linux":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: using the slower torch attention path")
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode()
                         + platform.machine().encode() + compiler.encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_decode-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
            logger.info("built CPU attention kernels at %s", target)
        return NativeKernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("could not build the CPU attention kernels (%s): using the torch path",
                       detail)
        return None
