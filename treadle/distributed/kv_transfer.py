"""P/D: a prompt's KV blocks out of one engine and into another, keyed by prefix hashes.

Owns the block-granular payload (`KVPayload`: the chained prefix-cache hashes of the
prompt's full blocks, the index of the first block carried, and one `KVPart` per rank of
the exporting engine — each rank's layers and KV heads of those blocks), and the engine
side of moving it: finding a prompt's blocks in the prefix cache, asking every worker
rank for its share (`Worker.export_kv_blocks`), and landing a payload in the receiving
engine's prefix cache — fresh blocks are allocated, every rank writes its own share of
them (`Worker.import_kv_blocks`, which re-slices parts of another TP x PP split), they
are registered under their hashes and released, so the scheduler admits the request
with a prefix hit on them (the blocks it already held are never sent).

It reaches the workers only through the executor's `collective_rpc`, on the engine
thread, between steps — so P/D works on every executor (uni, mp, torchrun) and with
tensor parallelism. The tensor work is the worker's (treadle/worker/kv_transfer.py);
this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.core.kv.hashing import hash_block, root_hash
from treadle.worker.kv_transfer import KVPart


@dataclass
class KVPayload:
    hashes: list[bytes]
    """Prefix hashes of every full block of the prompt, in chain order."""
    start: int
    """Index (into hashes) of the first block carried in the parts."""
    parts: list[KVPart]
    """One per distinct share (layers x KV heads) of the exporting engine's ranks, each
    carrying the same blocks (worker/kv_transfer.py has the layout)."""

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) - self.start

    @property
    def nbytes(self) -> int:
        return sum(int(p.data.nbytes) for p in self.parts)

    def from_block(self, start: int) -> "KVPayload":
        """The payload of blocks `start`.. of the chain (the receiver holds the ones
        before); `start` at or past this payload's own start."""
        if start == self.start:
            return self
        skip = slice(start - self.start, None)
        return KVPayload(self.hashes, start, [p.select(skip) for p in self.parts])


def prompt_hashes(prompt_token_ids: list[int], block_size: int, cache_salt: str | None,
                  lora_int_id: int | None) -> list[bytes]:
    """The prefix-cache hashes of the prompt's full blocks (KVCacheManager's chain)."""
    parent = root_hash(cache_salt, lora_int_id)
    hashes = []
    for i in range(len(prompt_token_ids) // block_size):
        parent = hash_block(parent, prompt_token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def num_cached_prefix_blocks(core, hashes: list[bytes]) -> int:
    """How many leading blocks of the chain this engine's prefix cache holds."""
    pool = core.scheduler.kv.pool
    n = 0
    for h in hashes:
        if pool.lookup(h) is None:
            break
        n += 1
    return n


def read_blocks(core, hashes: list[bytes]) -> KVPayload | None:
    """The KV of the blocks cached under `hashes` (all of them), from every rank, or None
    if any is gone. Between steps (the engine thread)."""
    pool = core.scheduler.kv.pool
    blocks = [pool.lookup(h) for h in hashes]
    if any(b is None for b in blocks):
        return None
    if not blocks:
        return KVPayload(hashes, 0, [])
    parts = core.executor.collective_rpc("export_kv_blocks", [b.block_id for b in blocks])
    distinct: dict = {}
    for part in parts:  # ranks sharing a replicated KV head hold the same KV
        distinct.setdefault(part.share, part)
    return KVPayload(hashes, 0, list(distinct.values()))


def land_blocks(core, payload: KVPayload) -> bool:
    """Write the payload's blocks into free blocks and register them in the prefix cache
    (then release them: cached and free, as a finished request leaves its prompt). Blocks
    already cached here are skipped. False, changing nothing, when too few blocks are
    free: the caller retries later (decode full). Raises ValueError, changing nothing,
    when the payload cannot land here (another model, block size or KV dtype)."""
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
    parts = (payload.parts if len(wanted) == payload.num_blocks
             else [p.select(wanted) for p in payload.parts])
    try:
        reasons = core.executor.collective_rpc("import_kv_blocks",
                                               [b.block_id for b in blocks], parts)
    except BaseException:
        pool.free(reversed(blocks))
        pool.free(reversed(present))
        raise
    reason = next((r for r in reasons if r is not None), None)
    if reason is None:
        for block, i in zip(blocks, wanted):
            pool.cache(block, payload.hashes[payload.start + i])
    pool.free(reversed(blocks))
    pool.free(reversed(present))
    if reason is not None:
        raise ValueError(f"P/D: this engine cannot take the prompt's KV: {reason}")
    return True
