"""HugePageArena: tensors cut from huge-page-backed chunks (worker/cpu/huge_pages.py)."""

import mmap
import pathlib

import pytest
import torch

from treadle.worker.cpu.huge_pages import HUGE_PAGE, HugePageArena


def test_tensors_are_aligned_disjoint_and_of_the_asked_size():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    sizes = [(1, torch.bfloat16), (1000, torch.bfloat16), (7, torch.float32),
             (HUGE_PAGE // 2, torch.bfloat16), (0, torch.uint8), (3 * HUGE_PAGE, torch.uint8)]
    tensors = [arena.empty(n, dtype) for n, dtype in sizes]
    spans = []
    for t, (n, dtype) in zip(tensors, sizes):
        assert t.dtype == dtype and t.shape == (n,) and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    for i, (a0, a1) in enumerate(spans):  # no two tensors share a byte
        for b0, b1 in spans[i + 1:]:
            assert a1 <= b0 or b1 <= a0
    # Writing every tensor leaves the others as written.
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert bool((t == i + 1).all())
    # The tensor larger than a chunk got a chunk of its own, rounded up to huge pages.
    assert arena.mapped_bytes >= 3 * HUGE_PAGE + HUGE_PAGE


def test_a_chunk_stays_mapped_while_a_tensor_cut_from_it_lives():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    kept = arena.empty(1024, torch.float32)
    kept.copy_(torch.arange(1024, dtype=torch.float32))
    for _ in range(8):  # later chunks replace the arena's current one
        arena.empty(HUGE_PAGE // 2, torch.float32).fill_(-1)
    del arena
    assert torch.equal(kept, torch.arange(1024, dtype=torch.float32))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="chunk_bytes must be at least"):
        HugePageArena(chunk_bytes=4096)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        HugePageArena().empty(-1, torch.bfloat16)


def _thp_mode() -> str | None:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")]


_GIVES_HUGE_PAGES = _thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def _anon_huge_kb() -> int:
    for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not _GIVES_HUGE_PAGES,
                    reason="the kernel gives no transparent huge pages here "
                           "(test_tensors_are_aligned_disjoint_and_of_the_asked_size runs)")
def test_touched_chunks_are_backed_by_huge_pages():
    """Where Linux gives transparent huge pages for madvised memory, the arena's memory is
    in them once written (a packed weight of SmolLM2-135M's LM head: 56.6 MB)."""
    before = _anon_huge_kb()
    arena = HugePageArena()
    t = arena.empty(49152 * 576, torch.bfloat16)
    t.fill_(1.0)
    grown_kb = _anon_huge_kb() - before
    # Memory may be too fragmented for every page; most of 56 MB in 2 MB pages is the point.
    assert grown_kb >= (t.numel() * 2 // 1024) // 2, grown_kb


def test_cpu_kv_caches_are_zeroed_disjoint_and_in_the_arena():
    """The CPU KV caches come from huge pages (worker/kv_cache.py): one zeroed tensor per
    layer of the layout's shape, none sharing memory with another, each writable alone."""
    from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    caches = allocate_kv_caches(spec, num_blocks=40, block_size=16)
    assert len(caches) == 3
    for c in caches:
        assert c.shape == spec.shape(40, 16) and c.dtype == torch.bfloat16
        assert c.is_contiguous() and c.data_ptr() % 64 == 0
        assert not c.any()
    for i, c in enumerate(caches):
        c.fill_(i + 1)
    for i, c in enumerate(caches):
        assert bool((c == i + 1).all())


@pytest.mark.skipif(not _GIVES_HUGE_PAGES,
                    reason="the kernel gives no transparent huge pages here "
                           "(test_cpu_kv_caches_are_zeroed_disjoint_and_in_the_arena runs)")
def test_cpu_kv_caches_are_backed_by_huge_pages():
    from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches
    before = _anon_huge_kb()
    spec = KVCacheSpec(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    caches = allocate_kv_caches(spec, num_blocks=1024, block_size=16)  # 12.6 MB a layer
    for c in caches:  # memory is resident once written (test_kv_cache_memory.py)
        c.fill_(1)
    grown_kb = _anon_huge_kb() - before
    total_kb = sum(c.numel() * c.element_size() for c in caches) // 1024
    assert grown_kb >= total_kb // 2, (grown_kb, total_kb)
