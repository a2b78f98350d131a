"""Keep the memory a CPU step frees in the process's heap, for the next step to reuse.

A CPU step allocates and frees the same activations every time: the widened inputs of
the GEMM (kernels/gemm_widen.h: rows x K fp32, 2-6 MB a call at a 1,024-token prefill
chunk), torch's activation tensors, the decode stack's buffer. glibc's malloc serves a
request above its mmap threshold (128 KiB, raised as large chunks are freed, to 32 MiB
at most) with a fresh mapping and trims the heap's free top above its trim threshold, so
memory freed at the end of one call went back to the kernel and the next call faulted it
in again, page by page, each zeroed. How often depends on the history of the process's
allocations: on an AMD EPYC KVM guest, 1,024-token prefill steps of the demo model took
1.5 to 121 thousand page faults each from one process to the next (121 thousand: 485 MB
and 2.6 s a step, against 1.85 s with none); with `mallopt` as below, none in every
process (docs/benchmarks.md, "The same AVX2 host, round 14").

So a process that runs the model on the CPU sets, once, before its first step:
M_MMAP_THRESHOLD = 32 MiB (glibc's largest: below it, requests come from the heap),
M_TRIM_THRESHOLD = 1 GiB (the heap's free top stays mapped) and M_TOP_PAD = 64 MiB (the
heap grows in large steps). The cost is resident memory: the process keeps its peak
heap. vLLM's CPU build gets the same effect by preloading tcmalloc. Nothing happens on a
C library other than glibc (musl, macOS) or with ModelConfig.keep_freed_memory False
(`--no-keep-freed-memory`).
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter numbers (malloc.h)."""

SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))
"""What keep_freed_memory sets, in this order."""


def keep_freed_memory() -> bool:
    """Apply SETTINGS to this process's glibc malloc; True when every one was taken,
    False on another C library (nothing changed there)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
