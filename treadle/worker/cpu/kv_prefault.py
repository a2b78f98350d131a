"""Makes the CPU KV cache's memory resident just ahead of the blocks the engine uses,
on a background thread, so that no decode step pays for a page fault.

The KV tensors are untouched anonymous memory in transparent huge pages
(worker/cpu/huge_pages.py, worker/kv_cache.py): resident only once written, so a cache at
rest costs the blocks used so far (issue 47). The block pool hands out never-used blocks
in id order (core/kv/block_pool.py), so every layer's K and V runs cross into a new 2 MiB
page at about the same step, and that step takes the first write fault of each: on the
2-vCPU Xeon VM of issue 46, 30 faults of ~6 ms each (180 ms of system time inside one
DecodeStack call, where a few ms is usual), one step in ~250 beside a batch job, which
set the interactive stream's p99 TTFT.

`KVPrefaulter` keeps the pages populated from block 0 up to one huge page's worth of
blocks past the highest block id the worker has been given, with
`madvise(MADV_POPULATE_WRITE)` (Linux 5.14+): the kernel faults the pages in writable
without writing them, so blocks already holding KV keep it, and the thread holds no GIL
while the kernel works. It runs in the idle scheduling class (thread_priority.py): only
on a core the engine leaves idle. Residency stays about what is used plus two huge pages
per K or V run. Where the call is refused (an older kernel, not Linux) it stops, and the
step pays the faults as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import sys
import threading
import weakref
from typing import Callable

import torch

from treadle.thread_priority import lower_thread_priority
from treadle.worker.cpu.huge_pages import HUGE_PAGE

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""linux/mman.h (5.14): populate page tables writable, writing nothing."""
_PAGE = 4096
_CHUNK_BYTES = HUGE_PAGE
"""Bytes of each run populated per round: every run advances together, as the pool's ids do."""


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class _Population:
    """What the thread shares with its owner: the runs, the target and the progress. It
    holds no reference to the owner or the caches, so a worker that is dropped frees its
    caches (the owner's finalizer stops the thread)."""

    def __init__(self, runs: list[tuple[int, int, int]], chunk_blocks: int,
                 owner: Callable[[], object | None]) -> None:
        self.runs = runs
        self.owner = owner
        """A weak reference to the owner: held strongly for one round at a time, so the
        caches stay mapped while the kernel populates them."""
        self.chunk_blocks = chunk_blocks
        self.target = 0
        self.populated_blocks = 0
        self.failed: str | None = None
        self.closed = False
        self.wake = threading.Event()
        self.idle = threading.Event()
        self.madvise = _madvise()

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    def run(self) -> None:
        lower_thread_priority()
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.closed:
                return
            while self.populated_blocks < self.target and not self.closed:
                owner = self.owner()
                if owner is None:  # dropped: its caches may be unmapped already
                    return
                end = min(self.target, self.populated_blocks + self.chunk_blocks)
                populated = self._populate(self.populated_blocks, end)
                del owner
                if not populated:
                    self.idle.set()
                    return
                self.populated_blocks = end
            self.idle.set()

    def _populate(self, start: int, end: int) -> bool:
        """Blocks [start, end) of every run; False (and `failed` says why) when refused."""
        for address, block_bytes, num_blocks in self.runs:
            lo = address + min(start, num_blocks) * block_bytes
            hi = address + min(end, num_blocks) * block_bytes
            if hi <= lo:
                continue
            lo -= lo % _PAGE
            hi += -hi % _PAGE
            if self.madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                self.failed = errno.errorcode.get(code, str(code))
                logger.info("KV pages are not prefaulted (madvise MADV_POPULATE_WRITE: %s): "
                            "steps take the page faults as blocks are first used", self.failed)
                return False
        return True


class KVPrefaulter:
    """Populates the KV caches' pages ahead of use on a daemon thread (see the module)."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int) -> None:
        self._caches = caches  # held: the addresses the thread uses stay mapped
        runs: list[tuple[int, int, int]] = []
        """(address, bytes per block, blocks) of each contiguous run of blocks: a layer's K
        and V, and per KV head where the layout puts heads before blocks."""
        for cache in caches:
            if not cache.is_contiguous():
                raise ValueError("KV caches must be contiguous to be prefaulted")
            num_blocks = cache.shape[block_dim]
            block_bytes = math.prod(cache.shape[block_dim + 1:]) * cache.element_size()
            for outer in range(math.prod(cache.shape[:block_dim])):
                runs.append((cache.data_ptr() + outer * num_blocks * block_bytes,
                             block_bytes, num_blocks))
        smallest = min(bb for _, bb, _ in runs)
        self.ahead_blocks = -(-HUGE_PAGE // smallest)
        """Blocks kept populated past the highest in use: a huge page of the smallest run."""
        self.num_blocks = max(nb for _, _, nb in runs)
        self._state = _Population(runs, max(1, _CHUNK_BYTES // smallest), weakref.ref(self))
        self._thread = threading.Thread(target=self._state.run, name="treadle-kv-prefault",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._state.close)
        self.advance(-1)

    @classmethod
    def for_caches(cls, caches: list[torch.Tensor], block_dim: int) -> KVPrefaulter | None:
        """A prefaulter for CPU caches on Linux, else None (nothing to do)."""
        if (not caches or not sys.platform.startswith("linux")
                or any(c.device.type != "cpu" for c in caches)):
            return None
        return cls(caches, block_dim)

    @property
    def populated_blocks(self) -> int:
        """Blocks [0, this) of every run are resident."""
        return self._state.populated_blocks

    @property
    def failed(self) -> str | None:
        """Why the kernel refused (then the thread has stopped), or None."""
        return self._state.failed

    def advance(self, highest_block_id: int) -> None:
        """The worker has been given blocks up to `highest_block_id`: keep the pages a huge
        page's worth past it populated. Cheap; the work is the thread's."""
        state = self._state
        target = min(self.num_blocks, highest_block_id + 1 + self.ahead_blocks)
        if target > state.target and state.failed is None:
            state.target = target
            state.idle.clear()
            state.wake.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the thread has populated up to the last target (tests, benchmarks)."""
        return self._state.idle.wait(timeout)

    def close(self) -> None:
        """Stop the thread."""
        self._state.close()
        if self._thread is not threading.current_thread():
            self._thread.join()
