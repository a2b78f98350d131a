"""C kernels for the CPU attention path, the bf16 layers and the sampler, compiled on first
use and called through ctypes.

Owns building (gcc: every `kernels/*.c`, which may include the shared `kernels/*.h`,
compiled with `-O3 -fopenmp`, the ISA level's target flags (worker/cpu/cpu_isa.py) and its
own flags, linked into one shared object without fast-math; into `<cache>/kernels/`,
keyed by a hash of all sources, headers, flags and the CPU's features, written
atomically; the sources compile in parallel) and the typed call wrappers. One library
per ISA level: `load_kernels(isa)` builds the best level this CPU executes (`auto`) or the
one asked for, so a machine with AVX-512 BF16 can build and test the `avx512` and `avx2`
kernels too. The shared object links `libgomp.so.1` by soname, so inside a process where
torch already loaded its own libgomp there is one OpenMP runtime and one thread pool; it
binds its own symbols (-Bsymbolic), so libraries of several levels can be loaded at once.

When no compiler is available or the build fails, `load_kernels()` returns None and the
torch implementations (worker/attention/, worker/sampler.py) are used instead: slower,
same results. A build is announced before it starts, with its expected duration
(`build_estimate_s`), and `treadle build-kernels` runs every build ahead of a first start.
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from treadle.paths import cache_dir
from treadle.worker.cpu import cpu_isa

logger = logging.getLogger(__name__)

_KERNEL_DIR = Path(__file__).with_name("kernels")
_COMPILE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-c"]
# -ffast-math lets gcc vectorize expf and the reductions of the attention kernel (it has
# no inf/NaN inputs by construction: only real context positions are visited). The
# sampling kernel needs infinities (masked tokens), so it does without; -fno-trapping-math
# is what lets its exp polynomial (floorf, float->int) vectorize. Fast-math is
# given to the compile step only: on the link command of a shared object (gcc < 13) it
# pulls in crtfastmath.o, which switches the WHOLE process to flush-to-zero when the
# library loads, silently changing every float computation of numpy, torch and Python (a
# test caught it; tests/integration/test_native_attention.py guards it).
_FILE_FLAGS = {"paged_decode.c": ["-ffast-math"], "paged_prefill.c": ["-ffast-math"],
               "sampling.c": ["-fno-trapping-math", "-fno-math-errno"]}
_LINK_FLAGS = ["-shared", "-fopenmp", "-Wl,-Bsymbolic"]
COMPILE_TIMEOUT_S = 3600
"""Seconds one gcc call may take before the build counts as failed (a hung compiler):
generous, since on a loaded 2-core machine one source took over 300 s (the former bound,
which made a first start fall back from avx512bf16 to avx512 after 12 minutes)."""
BUILD_CPU_SECONDS = 60.0
"""gcc's CPU time for one level's library, all sources: 58 s measured for avx512bf16 on
the Xeon of docs/benchmarks.md (gcc 12, -O3); the wall time is this over the cores that
compile in parallel, longer on a busy machine."""
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SAMPLE_ARGTYPES = [_P, _I64, _I64, _I64] + [_P] * 6
_LOGPROB_ARGTYPES = [_P, _I64, _I64, _P, _I64, _P, _I64] + [_P] * 4
_PREFILL_ARGTYPES = [_P, _I64] + [_P] * 6 + [_I64] * 7 + [ctypes.c_float, _I64, _I64]


@dataclass
class RowLogprobs:
    """What `NativeKernels.logprobs` gives per row."""

    lse: torch.Tensor
    """[n] float64: log-sum-exp of the row."""
    ranks: torch.Tensor
    """[n] int64: entries at least as large as the token's."""
    top_values: torch.Tensor
    """[n, num_top] float32: the largest entries, descending (ties: lower id first)."""
    top_ids: torch.Tensor
    """[n, num_top] int64: their ids."""


class NativeKernels:
    """Typed wrappers around the compiled kernels."""

    def __init__(self, lib: ctypes.CDLL, isa: str = "native") -> None:
        self.lib = lib
        """The loaded library; worker/cpu/native_linear.py wraps its bf16 layer kernels."""
        self.isa = isa
        """The ISA level it was built for (worker/cpu/cpu_isa.py)."""
        self.march = cpu_isa.compile_flags(isa)
        """gcc's target flags of that level."""
        lib.kernels_simd_width.restype = ctypes.c_int
        lib.kernels_have_dpbf16.restype = ctypes.c_int
        self.simd_width = int(lib.kernels_simd_width())
        """fp32 lanes of the vector paths: 16 (AVX-512), 8 (AVX2), 0 (none: generic loops)."""
        self.has_dpbf16 = bool(lib.kernels_have_dpbf16())
        """Whether bf16 dot products use vdpbf16ps (else bf16 is widened to fp32)."""
        lib.paged_decode_fast_path.argtypes = [_I64, _I64]
        lib.paged_decode_fast_path.restype = ctypes.c_int
        # The entry points that take the context split (`split_tokens`) and a sliding
        # window (`window`, 0: none): paged_decode.c.
        self._decode = {torch.bfloat16: lib.paged_decode_bf16_window,
                        torch.float32: lib.paged_decode_f32_window}
        self._decode_q8 = {torch.bfloat16: lib.paged_decode_q8_bf16_window,
                           torch.float32: lib.paged_decode_q8_f32_window}
        """Over an int8 KV cache (worker/kv_quant.py rows), by the queries' dtype."""
        for fn in (*self._decode.values(), *self._decode_q8.values()):
            fn.argtypes = _ARGTYPES + [_I64, _I64]
            fn.restype = ctypes.c_int
        self._sample_rows = lib.sample_rows
        self._sample_rows.argtypes = _SAMPLE_ARGTYPES
        self._sample_rows.restype = ctypes.c_int
        self._probs_rows = lib.probs_rows
        self._probs_rows.argtypes = [_P, _I64, _I64, _I64] + [_P] * 5 + [_I64]
        self._probs_rows.restype = ctypes.c_int
        self._logprob_rows = lib.logprob_rows
        self._logprob_rows.argtypes = _LOGPROB_ARGTYPES
        self._logprob_rows.restype = None
        self._prefill = lib.paged_prefill_bf16
        self._prefill.argtypes = _PREFILL_ARGTYPES
        self._prefill.restype = ctypes.c_int
        self._prefill_q8 = lib.paged_prefill_q8_bf16
        self._prefill_q8.argtypes = _PREFILL_ARGTYPES
        self._prefill_q8.restype = ctypes.c_int
        self._prefill_workspace = lib.paged_prefill_workspace_bytes
        self._prefill_workspace.argtypes = [_P, _I64, _I64, _I64]
        self._prefill_workspace.restype = ctypes.c_int64
        lib.paged_prefill_available.argtypes = [_I64, _I64]
        lib.paged_prefill_available.restype = ctypes.c_int
        lib.paged_prefill_amx_available.argtypes = [_I64]
        lib.paged_prefill_amx_available.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._decode

    def supports_fast_decode(self, head_dim: int, group: int = 1) -> bool:
        """Whether `paged_decode` takes its vector path for this head size and number of
        query heads per KV head (else it runs the generic loops: right, slower): head_dim
        64 and 128 with 1..8 query heads per KV head, 256 with 1..4, on AVX-512 or AVX2
        builds, over every cache dtype."""
        return bool(self.lib.paged_decode_fast_path(head_dim, group))

    def paged_decode(self, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_table: torch.Tensor,
                     ctx_lens: torch.Tensor, out: torch.Tensor, scale: float,
                     split_tokens: int | None = None, window: int | None = None) -> None:
        """Attention of one query token per request over its blocks, into `out`.

        query, out: [num_reqs, num_heads, head_dim]; key/value_cache: [kv_heads,
        num_blocks, block_size, head_dim] of the queries' dtype, or int8 rows [..., head_dim
        + 2] (worker/kv_quant.py); block_table: [num_reqs, max_blocks] int64; ctx_lens:
        [num_reqs] int64. All contiguous, on CPU. split_tokens: None to split long contexts
        across threads as the batch suits; else the fixed length of the ranges a context is
        cut into (0: none), whatever the batch, so that each row's result depends on its
        context alone (batch-invariant engines). window: None (or 0) to attend to the whole
        context; else a row with context length n attends to positions [max(0, n -
        window), n) only (the query, at n - 1, included: transformers' convention), and
        its table's entries for blocks wholly before that are never read (a sliding KV
        group frees those blocks: core/kv/sliding.py).
        """
        num_reqs, num_heads, head_dim = query.shape
        num_kv_heads, num_blocks, block_size, row = key_cache.shape
        for t in (query, key_cache, value_cache, block_table, ctx_lens, out):
            assert t.is_contiguous(), "paged_decode needs contiguous tensors"
        q8 = key_cache.dtype == torch.int8
        assert row == (head_dim + 2 if q8 else head_dim) and value_cache.dtype == key_cache.dtype
        status = (self._decode_q8 if q8 else self._decode)[query.dtype](
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_table.data_ptr(), ctx_lens.data_ptr(), out.data_ptr(),
            num_reqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
            block_table.shape[1], scale, -1 if split_tokens is None else max(0, split_tokens),
            window or 0)
        if status != 0:
            raise ValueError(f"paged_decode: head grouping {num_heads}/{num_kv_heads} x "
                             f"head_dim {head_dim} x block_size {block_size} exceeds its limits")

    def supports_prefill(self, dtype: torch.dtype, head_dim: int,
                         window: int | None = None) -> bool:
        """Whether `paged_prefill` runs for this dtype and head size, with this sliding
        window (None: none), in this build (bf16, AVX-512 or AVX2; head_dim 64 or 128,
        and on the widening builds (no AVX-512 BF16) also 256 and windows); otherwise
        torch's attention does prefills."""
        return dtype == torch.bfloat16 and bool(
            self.lib.paged_prefill_available(head_dim, window or 0))

    def supports_amx_prefill(self, head_dim: int) -> bool:
        """Whether `paged_prefill(amx=True)` computes on AMX tiles for this head size
        (64 or 128, no window): the AVX-512 BF16 build, on a CPU with AMX-BF16 whose
        tile state Linux grants to this process."""
        return bool(self.lib.paged_prefill_amx_available(head_dim))

    def prefill_workspace(self, spans: torch.Tensor, num_kv_heads: int,
                          head_dim: int) -> torch.Tensor:
        """A buffer for `paged_prefill` with these spans, 64-byte aligned; one per step
        serves every layer."""
        size = self._prefill_workspace(spans.data_ptr(), spans.shape[0], num_kv_heads,
                                       head_dim)
        raw = torch.empty(size + 64, dtype=torch.uint8)
        skip = -raw.data_ptr() % 64
        return raw[skip:skip + size]

    def paged_prefill(self, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, spans: torch.Tensor,
                      block_tables: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor,
                      scale: float, window: int | None = None, amx: bool = False) -> None:
        """Causal attention of every prefill span's new tokens over their context.

        query: [tokens, num_heads, head_dim] bf16 (rows may be strided); out: [tokens,
        num_heads * head_dim]; key/value_cache: [kv_heads, num_blocks, block_size,
        head_dim]; spans: [num_spans, 3] int64 (first row, new tokens, positions before
        the chunk); block_tables: [num_spans, max_blocks] int64; workspace from
        `prefill_workspace`. Rows of `out` outside the spans are not written. window: None
        (or 0) for causal attention over the whole context; else a query at position p
        sees keys [p - window + 1, p], and a table entry of a block wholly before its
        span's first query's window is never read (a sliding KV group's stale ids).
        amx: compute on AMX tiles where `supports_amx_prefill` (and without a window);
        elsewhere the flag is ignored.
        """
        num_heads, head_dim = query.shape[1:]
        num_kv_heads, num_blocks, block_size, row = key_cache.shape
        assert query.stride(2) == 1 and query.stride(1) == head_dim
        for t in (key_cache, value_cache, spans, block_tables, out):
            assert t.is_contiguous(), "paged_prefill needs contiguous tensors"
        q8 = key_cache.dtype == torch.int8  # int8 rows [..., head_dim + 2]
        assert row == (head_dim + 2 if q8 else head_dim)
        status = (self._prefill_q8 if q8 else self._prefill)(
            query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
            spans.data_ptr(), block_tables.data_ptr(), out.data_ptr(), workspace.data_ptr(),
            spans.shape[0], num_heads, num_kv_heads, head_dim, num_blocks, block_size,
            block_tables.shape[1], scale, window or 0, int(amx))
        if status != 0:
            raise ValueError(f"paged_prefill: head_dim {head_dim}, heads "
                             f"{num_heads}/{num_kv_heads} or window {window} unsupported "
                             "on this CPU")

    def sample(self, logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of logits [rows, vocab] (float32, rows contiguous; not
        modified). Per row: inv_temperature float32 (0: greedy, the first argmax),
        top_k int64 (0: off), top_p float64 (1: off), min_p float32 (0: off), u float64
        in [0, 1) (the inverse CDF's point). Returns int64 [rows]."""
        rows, vocab = logits.shape
        assert logits.dtype == torch.float32 and logits.stride(1) == 1
        args = [(inv_temperature, torch.float32), (top_k, torch.int64),
                (top_p, torch.float64), (min_p, torch.float32), (u, torch.float64)]
        for t, dtype in args:
            assert t.dtype == dtype and t.shape == (rows,) and t.is_contiguous()
        tokens = torch.empty(rows, dtype=torch.int64)
        if rows == 0:
            return tokens
        status = self._sample_rows(logits.data_ptr(), rows, vocab, logits.stride(0),
                                   *(t.data_ptr() for t, _ in args), tokens.data_ptr())
        if status != 0:
            raise MemoryError("sample_rows: could not allocate its buffers")
        return tokens

    def probs(self, logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """The distribution `sample` draws from for each row (same parameters, no u):
        float32 [rows, vocab], each row summing to 1 over its kept tokens."""
        rows, vocab = logits.shape
        assert logits.dtype == torch.float32 and logits.stride(1) == 1
        args = [(inv_temperature, torch.float32), (top_k, torch.int64),
                (top_p, torch.float64), (min_p, torch.float32)]
        for t, dtype in args:
            assert t.dtype == dtype and t.shape == (rows,) and t.is_contiguous()
        out = torch.empty(rows, vocab, dtype=torch.float32)
        if rows == 0:
            return out
        status = self._probs_rows(logits.data_ptr(), rows, vocab, logits.stride(0),
                                  *(t.data_ptr() for t, _ in args), out.data_ptr(), vocab)
        if status != 0:
            raise MemoryError("probs_rows: could not allocate its buffers")
        return out

    def logprobs(self, logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                 num_top: int) -> RowLogprobs:
        """For logits[rows[j]] (float32 [*, vocab], rows contiguous): the log-sum-exp, the
        rank of token_ids[j] and the num_top largest entries. rows, token_ids: int64."""
        vocab = logits.shape[1]
        assert logits.dtype == torch.float32 and logits.stride(1) == 1
        n = rows.shape[0]
        for t in (rows, token_ids):
            assert t.dtype == torch.int64 and t.shape == (n,) and t.is_contiguous()
        out = RowLogprobs(torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.int64),
                          torch.empty(n, num_top, dtype=torch.float32),
                          torch.empty(n, num_top, dtype=torch.int64))
        if n:
            self._logprob_rows(logits.data_ptr(), vocab, logits.stride(0), rows.data_ptr(), n,
                               token_ids.data_ptr(), num_top, out.lse.data_ptr(),
                               out.ranks.data_ptr(), out.top_values.data_ptr(),
                               out.top_ids.data_ptr())
        return out


def compiler() -> str | None:
    """The C compiler the kernels are built with ($CC, gcc or cc), or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


_compiler = compiler


def _sources() -> list[Path]:
    return sorted(_KERNEL_DIR.glob("*.c"))


def _headers() -> list[Path]:
    return sorted(_KERNEL_DIR.glob("*.h"))


def _compile_flags(source: Path, isa: str) -> list[str]:
    return _COMPILE_FLAGS + cpu_isa.compile_flags(isa) + _FILE_FLAGS.get(source.name, [])


def build_estimate_s(num_jobs: int | None = None) -> float:
    """The expected wall time of one level's build on an idle machine (BUILD_CPU_SECONDS
    over the parallel compiles)."""
    jobs = num_jobs or max(1, min(len(_sources()), os.cpu_count() or 1))
    return BUILD_CPU_SECONDS / jobs


def _build(compiler: str, sources: list[Path], target: Path, isa: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        objects = [Path(tmp) / (source.stem + ".o") for source in sources]

        def compile_one(pair: tuple[Path, Path]) -> None:
            source, obj = pair
            subprocess.run([compiler, *_compile_flags(source, isa), str(source), "-o", str(obj)],
                           check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)

        with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
            list(pool.map(compile_one, zip(sources, objects)))
        subprocess.run([compiler, *_LINK_FLAGS, *map(str, objects), "-o", str(partial), "-lm"],
                       check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(partial, target)


def _cpu_features() -> bytes:
    """The CPU's feature flags: the builds are tuned for (and -march=native built for) this
    CPU, so a cache folder shared with another machine must not hand it a library built for
    other features."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    return platform.processor().encode()


def library_path(isa: str, compiler: str | None = None) -> Path:
    """Where the library of this ISA level lives in the cache (built or not)."""
    compiler = compiler or _compiler() or ""
    digest = hashlib.sha256()
    for source in _sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0"
                      + " ".join(_compile_flags(source, isa)).encode() + b"\0")
    for header in _headers():
        digest.update(header.name.encode() + b"\0" + header.read_bytes() + b"\0")
    digest.update(" ".join(_LINK_FLAGS).encode() + platform.machine().encode()
                  + compiler.encode() + _cpu_features())
    return cache_dir() / "kernels" / f"kernels-{isa}-{digest.hexdigest()[:16]}.so"


def load_kernels(isa: str = "auto") -> NativeKernels | None:
    """The compiled kernels, building them if needed; None when they cannot be had.

    isa (ModelConfig.kernel_isa): `auto` builds the best level this CPU executes and falls
    back to the next when a build fails (an old gcc without -mavx512bf16, say), then to
    -march=native; a level by name (avx512bf16, avx512, avx2, native) builds only that
    one, and a level this CPU cannot execute is a ValueError.
    """
    if platform.system() != "Linux":
        return None
    levels = cpu_isa.candidate_levels(isa)
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: using the slower torch attention and sampler")
        return None
    sources = _sources()
    for level in levels:
        target = library_path(level, compiler)
        try:
            if not target.exists():
                logger.info(
                    "building the C kernels for %s (%d sources, gcc on %d cores: about %.0f s "
                    "on an idle machine, once per machine and kernel version; `treadle "
                    "build-kernels` builds them ahead)", level, len(sources),
                    min(len(sources), os.cpu_count() or 1), build_estimate_s())
                start = time.perf_counter()
                _build(compiler, sources, target, level)
                logger.info("built the C kernels for %s in %.0f s: %s", level,
                            time.perf_counter() - start, target)
            return NativeKernels(ctypes.CDLL(str(target)), level)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("could not build the CPU kernels for %s (%s)", level, detail)
    logger.warning("no CPU kernels could be built: using the torch paths")
    return None
