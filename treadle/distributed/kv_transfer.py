"""P/D: a prompt's KV blocks out of one engine and into another, keyed by prefix hashes.

Owns the block-granular payload (`KVPayload`: the chained prefix-cache hashes of the
prompt's full blocks, the index of the first block carried, and the blocks of every layer
as one contiguous array), reading blocks out of a worker's KV tensors and writing them
into another's, and landing them in the receiving engine's prefix cache: fresh blocks are
allocated, filled, registered under their hashes and released, so the scheduler admits
the request with a prefix hit on them (the blocks it already held are never sent). It
runs on the engine thread, between steps, on the `uni` executor's worker (the KV tensors
live in the engine's own process there).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.kv.hashing import hash_block, root_hash


@dataclass
class KVPayload:
    hashes: list[bytes]
    """Prefix hashes of every full block of the prompt, in chain order."""
    start: int
    """Index (into hashes) of the first block carried in `data`."""
    data: np.ndarray
    """(layers, *one layer's KV with the carried blocks along its block axis), as stored
    (bf16 viewed as int16: numpy has no bfloat16)."""
    dtype: str

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) - self.start

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def prompt_hashes(prompt_token_ids: list[int], block_size: int, cache_salt: str | None,
                  lora_int_id: int | None) -> list[bytes]:
    """The prefix-cache hashes of the prompt's full blocks (KVCacheManager's chain)."""
    parent = root_hash(cache_salt, lora_int_id)
    hashes = []
    for i in range(len(prompt_token_ids) // block_size):
        parent = hash_block(parent, prompt_token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def _worker(core):
    worker = getattr(core.executor, "worker", None)
    if worker is None or worker.runner is None:
        raise ValueError("P/D disaggregation needs the uni executor (the KV tensors in the "
                         "engine's process): distributed_executor_backend must be uni")
    return worker


def num_cached_prefix_blocks(core, hashes: list[bytes]) -> int:
    """How many leading blocks of the chain this engine's prefix cache holds."""
    pool = core.scheduler.kv.pool
    n = 0
    for h in hashes:
        if pool.lookup(h) is None:
            break
        n += 1
    return n


def read_blocks(core, hashes: list[bytes]) -> tuple[np.ndarray, str] | None:
    """The KV of the blocks cached under `hashes` (all of them), or None if any is gone."""
    pool = core.scheduler.kv.pool
    blocks = [pool.lookup(h) for h in hashes]
    if any(b is None for b in blocks):
        return None
    worker = _worker(core)
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
    dim = worker.kv_spec.block_dim
    caches = worker.runner.kv_caches
    data = torch.stack([c.index_select(dim, ids.to(c.device)).cpu() for c in caches])
    dtype = str(data.dtype).removeprefix("torch.")
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return data.numpy(), dtype


def land_blocks(core, payload: KVPayload) -> bool:
    """Write the payload's blocks into free blocks and register them in the prefix cache
    (then release them: cached and free, as a finished request leaves its prompt). Blocks
    already cached here are skipped. False, changing nothing, when too few blocks are
    free: the caller retries later (decode full)."""
    kv = core.scheduler.kv
    pool = kv.pool
    if not kv.enable_prefix_caching:
        raise ValueError("P/D disaggregation needs enable_prefix_caching on decode engines")
    present = [b for b in map(pool.lookup, payload.hashes) if b is not None]
    wanted = [i for i in range(payload.num_blocks)
              if pool.lookup(payload.hashes[payload.start + i]) is None]
    if not wanted:
        return True
    pool.touch(present)  # held while allocating: the new blocks must not evict the chain
    if len(wanted) > pool.num_free_blocks:
        pool.free(reversed(present))
        return False
    blocks = pool.allocate(len(wanted))
    worker = _worker(core)
    dim = worker.kv_spec.block_dim
    with warnings.catch_warnings():  # Ray's object store arrays are read-only: only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(payload.data)
    if payload.dtype == "bfloat16":
        data = data.view(torch.bfloat16)
    rows = torch.tensor(wanted, dtype=torch.long)
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
    for layer, cache in enumerate(worker.runner.kv_caches):
        src = data[layer].index_select(dim, rows).to(cache.device, cache.dtype)
        cache.index_copy_(dim, ids.to(cache.device), src)
    for block, i in zip(blocks, wanted):
        pool.cache(block, payload.hashes[payload.start + i])
    pool.free(reversed(blocks))
    pool.free(reversed(present))
    return True
