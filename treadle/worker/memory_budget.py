"""`kv_cache_memory auto` and `swap_space auto`: how much host memory the KV cache and
the swap space take, from the model, the scheduler's limits and the memory this machine
(or its container) has free at start.

Owns reading the memory available (`available_memory`: /proc/meminfo's MemAvailable, and
the cgroup's limit less its usage where one is set: v2 `memory.max` / `memory.current`,
v1 `memory.limit_in_bytes` / `memory.usage_in_bytes`, reclaimable page cache not
counted as used) and the two sizing rules (`auto_kv_cache_bytes`, `auto_swap_bytes`),
pure functions of those numbers. The worker calls them after the model is loaded, so
the weights are already out of what is available, and logs the choice. No torch here;
it allocates nothing.

The rules (docs/memory.md):
- KV cache: what the scheduler can ever use, max_num_seqs x max_model_len tokens at the
  model's bytes per token, but at most KV_MEMORY_FRACTION of the memory available at
  start (a quarter), shared by the ranks on this machine.
- swap space: half the KV cache, at most SWAP_MEMORY_FRACTION (an eighth) of the memory
  available; it is reserved only when a request is first swapped out
  (worker/kv_cache.py `SwapSpace`), and on the CPU only the blocks written take memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

KV_MEMORY_FRACTION = 0.25
"""Most of the memory available at start that `kv_cache_memory auto` takes."""
SWAP_MEMORY_FRACTION = 0.125
"""Most of the memory available at start that `swap_space auto` takes."""
SWAP_KV_RATIO = 0.5
"""`swap_space auto` is at most this share of the KV cache's bytes."""
_NO_LIMIT = 1 << 60  # cgroup v1 writes 'no limit' as a number near 2^63


@dataclass(frozen=True)
class AvailableMemory:
    """What the machine has free for this process, and where the figure came from."""

    num_bytes: int
    source: str
    """e.g. 'MemAvailable' or 'cgroup memory.max - usage'."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _cgroup_free(root: Path) -> int | None:
    """The cgroup's limit less what it uses, reclaimable page cache (inactive_file) not
    counted; None where no limit is set (or no cgroup files are readable)."""
    for limit_name, usage_name, stat_key in (
            ("memory.max", "memory.current", "inactive_file"),  # v2
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "total_inactive_file")):  # v1
        limit = _read_int(root / limit_name)
        usage = _read_int(root / usage_name)
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        stat_name = Path(limit_name).parent / ("memory.stat")
        inactive = 0
        try:
            for line in (root / stat_name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == stat_key and value.strip().isdigit():
                    inactive = int(value)
        except OSError:
            pass
        return max(0, limit - max(0, usage - inactive))
    return None


def available_memory(meminfo: Path = Path("/proc/meminfo"),
                     cgroup: Path = Path("/sys/fs/cgroup")) -> AvailableMemory | None:
    """The memory available now: the smaller of MemAvailable and the cgroup's free share;
    None where neither can be read (not Linux)."""
    figures = []
    system = _meminfo_available(meminfo)
    if system is not None:
        figures.append((system, "MemAvailable"))
    group = _cgroup_free(cgroup)
    if group is not None:
        figures.append((group, "the cgroup's limit less its usage"))
    if not figures:
        return None
    num_bytes, source = min(figures)
    return AvailableMemory(num_bytes, source)


def auto_kv_cache_bytes(bytes_per_token: int, max_num_seqs: int, max_model_len: int,
                        block_size: int, available: int | None,
                        num_ranks: int = 1) -> tuple[int, str]:
    """(bytes, why) for `kv_cache_memory auto` on one of `num_ranks` ranks sharing the
    machine: every running request's whole context (rounded up to blocks), capped by
    KV_MEMORY_FRACTION of `available` (None: unknown, no cap)."""
    blocks_per_seq = -(-max_model_len // block_size)
    need = max_num_seqs * blocks_per_seq * block_size * bytes_per_token
    if available is None:
        return need, (f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len} tokens "
                      "(the available memory is unknown)")
    cap = int(available * KV_MEMORY_FRACTION) // max(1, num_ranks)
    if need <= cap:
        return need, (f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len} tokens, "
                      f"within {KV_MEMORY_FRACTION:.0%} of the available memory")
    share = f" / {num_ranks} ranks" if num_ranks > 1 else ""
    return cap, (f"{KV_MEMORY_FRACTION:.0%} of the available memory{share} (max_num_seqs "
                 f"{max_num_seqs} x max_model_len {max_model_len} tokens would take "
                 f"{need / 2**30:.1f} GiB)")


def auto_swap_bytes(kv_cache_bytes: int, available: int | None,
                    num_ranks: int = 1) -> tuple[int, str]:
    """(bytes, why) for `swap_space auto`: SWAP_KV_RATIO of the KV cache, at most
    SWAP_MEMORY_FRACTION of `available` (None: unknown, no cap) per rank."""
    want = int(kv_cache_bytes * SWAP_KV_RATIO)
    if available is None:
        return want, f"{SWAP_KV_RATIO:.0%} of the KV cache"
    cap = int(available * SWAP_MEMORY_FRACTION) // max(1, num_ranks)
    if want <= cap:
        return want, f"{SWAP_KV_RATIO:.0%} of the KV cache"
    return cap, f"{SWAP_MEMORY_FRACTION:.1%} of the available memory"


@dataclass(frozen=True)
class CacheBytes:
    """The KV cache's and the swap space's bytes one rank gets, and the log line saying
    how `auto` chose them (None when both were given)."""

    kv_cache: int
    swap: int
    note: str | None


def cache_bytes(config, bytes_per_token: int, max_model_len: int,
                available: AvailableMemory | None = None) -> CacheBytes:
    """Resolve `kv_cache_memory` and `swap_space` of an EngineConfig (`auto` per the
    module's rules, a byte count as given) for a model of `bytes_per_token` KV bytes per
    token (a draft model's included) and this context length. `available`: the memory
    available now (read here when not given and some option is auto)."""
    from treadle.config import AUTO

    cache, sched = config.cache, config.scheduler
    ranks = config.parallel.world_size
    if AUTO not in (cache.kv_cache_memory, cache.swap_space):
        return CacheBytes(cache.kv_cache_memory, cache.swap_space, None)
    if available is None:
        available = available_memory()
    free = None if available is None else available.num_bytes
    notes = []
    kv = cache.kv_cache_memory
    if cache.num_kv_blocks is not None:
        kv = cache.num_kv_blocks * cache.block_size * bytes_per_token
    elif kv == AUTO:
        kv, why = auto_kv_cache_bytes(bytes_per_token, sched.max_num_seqs, max_model_len,
                                      cache.block_size, free, ranks)
        notes.append(f"KV cache {kv / 2**30:.2f} GiB ({why})")
    swap = cache.swap_space
    if swap == AUTO:
        swap, why = auto_swap_bytes(kv, free, ranks)
        notes.append(f"swap space {swap / 2**30:.2f} GiB ({why}; reserved when first used)")
    where = ("memory available unknown" if available is None else
             f"{available.num_bytes / 2**30:.1f} GiB available ({available.source})")
    return CacheBytes(kv, swap, f"memory auto: {where}: " + "; ".join(notes))
