"""The KV cache and the swap space take memory only as they are used (issue 47): the CPU
KV tensors read as zeros without being written, and the swap space is made on its first
use (worker/kv_cache.py)."""

from __future__ import annotations

import re

import torch

from treadle.worker.kv_cache import (KVCacheSpec, SwapSpace, allocate_kv_caches,
                                     allocate_swap_space, copy_blocks)


def _rss_mib() -> float:
    text = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def test_cpu_kv_caches_read_as_zeros_and_are_not_resident_until_written():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    before = _rss_mib()
    caches = allocate_kv_caches(spec, num_blocks=2048, block_size=16)  # 32 MiB a layer
    grown = _rss_mib() - before
    total = sum(c.numel() * c.element_size() for c in caches) / 2**20
    assert total == 128 and grown < 32, (grown, total)  # zeroing them made all 128 resident
    assert not caches[1][:, :, :8].any()  # what attention reads of an unused block: zeros
    caches[0][:, :, 0].fill_(1)  # one block of one layer written: about that resident
    assert _rss_mib() - before < 64
    assert bool((caches[0][:, :, 0] == 1).all()) and not caches[0][:, :, 1].any()


def test_swap_space_is_reserved_on_first_use_and_round_trips_blocks():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    swap = allocate_swap_space(spec, num_blocks=6, block_size=4)
    assert isinstance(swap, SwapSpace) and not swap.allocated and len(swap) == 2
    assert swap.nbytes == 2 * 2 * 2 * 6 * 4 * 64 * 2
    caches = allocate_kv_caches(spec, 8, 4)
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
    before = [c.clone() for c in caches]
    copy_blocks(caches, swap, [(5, 0), (2, 3)], spec.block_dim)  # the first swap-out
    assert swap.allocated and swap[0].shape == spec.shape(6, 4)
    for c in caches:
        c[:, :, [5, 2]] = 0
    copy_blocks(swap, caches, [(0, 5), (3, 2)], spec.block_dim)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
