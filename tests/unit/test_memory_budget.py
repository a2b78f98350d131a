"""`kv_cache_memory auto` and `swap_space auto` (worker/memory_budget.py): sized from the
model, max_num_seqs x max_model_len and the memory available, cgroup limits included."""

from __future__ import annotations

import pytest

from treadle.config import EngineConfig
from treadle.worker.memory_budget import (KV_MEMORY_FRACTION, AvailableMemory,
                                          auto_kv_cache_bytes, auto_swap_bytes,
                                          available_memory, cache_bytes)

GIB = 2**30


def _meminfo(tmp_path, available_kib: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       32000000 kB\nMemFree:         1000 kB\n"
                    f"MemAvailable:   {available_kib} kB\n")
    return path


def test_available_memory_is_memavailable_without_a_cgroup_limit(tmp_path):
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    got = available_memory(_meminfo(tmp_path, 8 * 1024**2), cgroup)
    assert got == AvailableMemory(8 * GIB, "MemAvailable")


def test_a_cgroup_v2_limit_below_the_machine_wins_page_cache_not_counted(tmp_path):
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(str(4 * GIB))
    (cgroup / "memory.current").write_text(str(3 * GIB))
    (cgroup / "memory.stat").write_text(f"anon 100\ninactive_file {GIB}\nactive_file 5\n")
    got = available_memory(_meminfo(tmp_path, 16 * 1024**2), cgroup)
    assert got.num_bytes == 2 * GIB and "cgroup" in got.source  # 4 - (3 - 1)


def test_a_cgroup_v1_limit(tmp_path):
    cgroup = tmp_path / "cg"
    (cgroup / "memory").mkdir(parents=True)
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(str(6 * GIB))
    (cgroup / "memory" / "memory.usage_in_bytes").write_text(str(GIB))
    (cgroup / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    assert available_memory(_meminfo(tmp_path, 16 * 1024**2), cgroup).num_bytes == 5 * GIB
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # no limit
    assert available_memory(_meminfo(tmp_path, 16 * 1024**2), cgroup).num_bytes == 16 * GIB


def test_auto_kv_takes_what_the_scheduler_can_use_or_a_quarter_of_the_memory():
    # SmolLM2-135M: 23040 bytes per token; 128 requests x 8192 tokens would be 22.5 GiB.
    kv, why = auto_kv_cache_bytes(23040, 128, 8192, 16, 16 * GIB)
    assert kv == int(16 * GIB * KV_MEMORY_FRACTION) and "25%" in why and "22.5 GiB" in why
    small, why = auto_kv_cache_bytes(23040, 4, 1000, 16, 16 * GIB)
    assert small == 4 * 63 * 16 * 23040 and "within" in why  # 1000 tokens = 63 blocks
    shared, _ = auto_kv_cache_bytes(23040, 128, 8192, 16, 16 * GIB, num_ranks=2)
    assert shared == kv // 2
    unknown, _ = auto_kv_cache_bytes(100, 2, 10, 16, None)
    assert unknown == 2 * 16 * 100


def test_auto_swap_is_half_the_kv_cache_at_most_an_eighth_of_the_memory():
    assert auto_swap_bytes(2 * GIB, 64 * GIB)[0] == GIB
    assert auto_swap_bytes(4 * GIB, 16 * GIB)[0] == 2 * GIB
    assert auto_swap_bytes(8 * GIB, 16 * GIB)[0] == 2 * GIB  # capped: 16 / 8


def test_cache_bytes_resolves_auto_and_keeps_given_sizes():
    config = EngineConfig.from_options(max_num_seqs=8, kv_cache_memory="auto",
                                       swap_space="auto")
    assert config.cache.kv_cache_memory == "auto" == config.cache.swap_space
    sizes = cache_bytes(config, 1000, 2048, AvailableMemory(64 * GIB, "MemAvailable"))
    assert sizes.kv_cache == 8 * 2048 * 1000 and sizes.swap == sizes.kv_cache // 2
    assert "memory auto" in sizes.note and "64.0 GiB available" in sizes.note
    given = EngineConfig.from_options(kv_cache_memory="1GiB", swap_space="256MiB")
    kept = cache_bytes(given, 1000, 2048)
    assert (kept.kv_cache, kept.swap, kept.note) == (GIB, 256 * 2**20, None)
    blocks = EngineConfig.from_options(num_kv_blocks=10, kv_cache_memory="auto",
                                       swap_space="auto", block_size=16)
    assert cache_bytes(blocks, 100, 2048, AvailableMemory(GIB, "x")).swap == 10 * 16 * 100 // 2


def test_the_defaults_are_auto(monkeypatch):
    for name in ("TREADLE_KV_CACHE_MEMORY", "TREADLE_SWAP_SPACE"):
        monkeypatch.delenv(name, raising=False)
    cache = EngineConfig.from_options().cache
    assert cache.kv_cache_memory == "auto" and cache.swap_space == "auto"
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_options(kv_cache_memory="lots")
