"""Weights and KV caches the CPU kernels stream every step, kept in transparent huge pages.

A decode step reads every packed weight once (kernels/gemm_bf16_vnni.c), and at a few
rows its time is that read. Read in 4 KiB pages, a stream of them crosses a page every
64 cache lines, each a TLB miss (two levels of page walk in a virtual machine); in 2 MiB
pages it crosses one every 32,768 lines. On the AMD EPYC KVM guest of docs/benchmarks.md
("Round 21") two 269 MB buffers with `MADV_HUGEPAGE` read at 36-37 GB/s against 31-35
for two without, side by side in one process. The KV caches (worker/kv_cache.py) come
from here too: decode attention walks each request's K and V in runs of a few dozen KiB,
and in 4 KiB pages the hardware prefetcher starts over at every page ("Round 22").

Linux hands out huge pages for anonymous memory only where asked (transparent_hugepage
`madvise`, the usual default) or everywhere (`always`). `HugePageArena` maps chunks of
anonymous memory, asks for huge pages on their 2 MiB-aligned interior before anything
touches them, and hands out tensors cut from them. Where the kernel does not give huge
pages (`never`, no THP, not Linux) the tensors are ordinary memory: nothing changes but
the alignment. A chunk stays mapped while any tensor cut from it is alive.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
"""Bytes mapped at a time: the packed weights of SmolLM2-135M (269 MB) in five chunks."""
_ALIGN = 64  # bytes between tensors: a cache line, as the kernels' vector loads want


class HugePageArena:
    """Hands out uninitialized tensors from huge-page-backed chunks (see the module)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes < HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be at least {HUGE_PAGE}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 bytes of the current chunk
        self._used = 0
        self.mapped_bytes = 0
        self.advised = hasattr(mmap, "MADV_HUGEPAGE")

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D tensor of `numel` elements of `dtype`, 64-byte aligned."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        size = numel * torch.empty((), dtype=dtype).element_size()
        if self._chunk is None or self._used + size > self._chunk.numel():
            self._chunk = self._map(max(self.chunk_bytes, -(-size // HUGE_PAGE) * HUGE_PAGE))
            self._used = 0
        start = self._used
        self._used = -(-(start + size) // _ALIGN) * _ALIGN
        return self._chunk[start:start + size].view(dtype)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`empty`, known to read as zeros without being written: every byte an arena
        hands out comes from an anonymous mapping made by it and handed out once, which
        the kernel fills with zeros on first touch. So nothing is touched here, and the
        memory becomes resident only as it is written (a KV cache at rest costs the
        blocks used so far, not its size)."""
        return self.empty(numel, dtype)

    def _map(self, size: int) -> torch.Tensor:
        """`size` bytes starting on a 2 MiB boundary, huge pages asked for, untouched."""
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped
        offset = -whole.data_ptr() % HUGE_PAGE
        if self.advised:
            try:
                region.madvise(mmap.MADV_HUGEPAGE, offset, size)
            except OSError:  # a kernel without THP: ordinary pages
                self.advised = False
        self.mapped_bytes += size + HUGE_PAGE
        return whole[offset:offset + size]
