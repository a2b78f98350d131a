"""The KV prefaulter (worker/cpu/kv_prefault.py): the pages just past the blocks in use
are resident before a step writes them, so the step takes no page fault; blocks already
written keep their contents; where the kernel refuses, nothing changes but the faults."""

from __future__ import annotations

import gc
import re
import resource
import weakref

import pytest
import torch

from treadle.worker.cpu import kv_prefault
from treadle.worker.cpu.huge_pages import HUGE_PAGE
from treadle.worker.cpu.kv_prefault import KVPrefaulter
from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
BLOCK_SIZE = 16


def _layout(caches) -> tuple[int, int]:
    """(runs of blocks in all, bytes of a block in one run): K and V of each layer, and
    of each KV head where the layout puts heads before blocks."""
    shape, dim = caches[0].shape, SPEC.block_dim
    runs = len(caches) * shape[:dim].numel()
    return runs, shape[dim + 1:].numel() * caches[0].element_size()


def _rss_mib() -> float:
    """Resident memory from the page tables (VmRSS in /proc/self/status is a per-CPU
    counter that lags another thread's faults)."""
    text = open("/proc/self/smaps_rollup").read()
    return int(re.search(r"\nRss:\s+(\d+) kB", text).group(1)) / 1024


def _block(cache: torch.Tensor, block: int) -> torch.Tensor:
    return cache.select(SPEC.block_dim, block)


def _faults_writing(cache: torch.Tensor, block: int) -> int:
    """Minor page faults this thread takes writing one block of K and of V."""
    _block(torch.zeros(cache.shape[:SPEC.block_dim] + (1,) + cache.shape[SPEC.block_dim + 1:],
                       dtype=cache.dtype), 0).fill_(1)  # the same work, on resident memory
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    _block(cache, block).fill_(1)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _fewest_faults_writing(*cache_blocks: tuple[torch.Tensor, int]) -> int:
    """The fewest faults of writing each (cache, block), blocks on different pages: a
    populated block takes none, but the thread may take a stray fault of its own (a code
    page read again under memory pressure: once in a CI run, 1 where 0 was due), which a
    second block on other pages does not repeat; an unpopulated block faults every time."""
    return min(_faults_writing(cache, block) for cache, block in cache_blocks)


def _prefaulter(caches) -> KVPrefaulter:
    prefaulter = KVPrefaulter.for_caches(caches, SPEC.block_dim)
    if prefaulter is None:
        pytest.skip("not a Linux CPU")
    assert prefaulter.wait_idle(30)
    if prefaulter.failed:
        pytest.skip(f"this kernel refuses MADV_POPULATE_WRITE ({prefaulter.failed})")
    return prefaulter


def test_blocks_past_the_highest_in_use_take_no_fault_and_later_ones_still_do():
    caches = allocate_kv_caches(SPEC, num_blocks=8192, block_size=BLOCK_SIZE)
    prefaulter = _prefaulter(caches)
    ahead = prefaulter.ahead_blocks
    assert ahead == HUGE_PAGE // _layout(caches)[1]
    assert prefaulter.populated_blocks == ahead  # from the start, block 0 up
    assert _fewest_faults_writing((caches[0], ahead - 1), (caches[2], ahead - 1)) == 0
    far = 3 * ahead + 5
    assert _faults_writing(caches[1], far) > 0  # the twin: not populated, faults
    prefaulter.advance(far)
    assert prefaulter.wait_idle(30)
    assert prefaulter.populated_blocks == far + 1 + ahead
    assert _fewest_faults_writing((caches[2], far + ahead), (caches[0], far + ahead)) == 0
    prefaulter.close()


def test_residency_follows_use_not_the_cache_size():
    gc.collect()  # earlier tests' caches unmapped now, not in the middle of this one
    before = _rss_mib()
    caches = allocate_kv_caches(SPEC, num_blocks=8192, block_size=BLOCK_SIZE)  # 192 MiB
    prefaulter = _prefaulter(caches)
    runs, block_bytes = _layout(caches)
    assert _rss_mib() - before < runs * 2 * HUGE_PAGE / 2**20 + 16  # a page or two a run
    prefaulter.advance(4 * prefaulter.ahead_blocks)
    assert prefaulter.wait_idle(30)
    grown = _rss_mib() - before
    populated = runs * prefaulter.populated_blocks * block_bytes / 2**20
    assert populated <= grown < populated + runs * HUGE_PAGE / 2**20 + 16, (grown, populated)
    prefaulter.close()


def test_blocks_already_written_keep_their_contents():
    caches = allocate_kv_caches(SPEC, num_blocks=2048, block_size=BLOCK_SIZE)
    written = torch.randn(_block(caches[0], 700).shape).to(caches[0].dtype)
    _block(caches[0], 700).copy_(written)  # before the prefaulter reaches it: written by a step
    prefaulter = _prefaulter(caches)
    prefaulter.advance(2047)
    assert prefaulter.wait_idle(30) and prefaulter.populated_blocks == 2048
    assert torch.equal(_block(caches[0], 700), written)
    assert not _block(caches[0], 699).any() and not caches[1].any()
    prefaulter.close()


def test_a_refusing_kernel_stops_the_thread_and_nothing_else(monkeypatch):
    monkeypatch.setattr(kv_prefault, "_madvise", lambda: lambda address, size, advice: -1)
    caches = allocate_kv_caches(SPEC, num_blocks=256, block_size=BLOCK_SIZE)
    prefaulter = KVPrefaulter.for_caches(caches, SPEC.block_dim)
    assert prefaulter.wait_idle(30)
    assert prefaulter.failed is not None and prefaulter.populated_blocks == 0
    prefaulter.advance(100)  # ignored: no work is queued for a stopped thread
    assert prefaulter.wait_idle(1)
    _block(caches[0], 5).fill_(1)  # the cache works as before
    assert bool((_block(caches[0], 5) == 1).all())


def test_gpu_or_empty_caches_get_none():
    assert KVPrefaulter.for_caches([], SPEC.block_dim) is None
    meta = [torch.empty((2, 8, 16, 2, 64), device="meta")]
    assert KVPrefaulter.for_caches(meta, SPEC.block_dim) is None


def test_a_dropped_prefaulter_ends_its_thread_and_frees_the_caches():
    """The thread holds neither the prefaulter nor the caches: a worker that is dropped
    (tests make hundreds) does not keep its KV cache alive through a daemon thread."""
    caches = allocate_kv_caches(SPEC, num_blocks=1024, block_size=BLOCK_SIZE)
    prefaulter = _prefaulter(caches)
    thread, cache = prefaulter._thread, weakref.ref(caches[0])
    del prefaulter, caches
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive() and cache() is None
