"""The pool of KV-cache blocks: reference counts, the LRU free queue and the prefix-hash map.

A block is *in use* while its reference count is above zero (one reference per request
whose block table holds it). A block whose count drops to zero goes to the tail of the
free queue but keeps its prefix hash, so a later request with the same prefix can take it
back ("cached-free"). New blocks are taken from the head of the free queue, least
recently freed first; taking a cached-free block evicts its hash.

This module knows blocks only by id; which request holds which block, and in what order,
is the KV cache manager's business. No torch here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class KVBlock:
    """Bookkeeping of one physical block (the tensors live in the worker)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    """Allocates, shares, frees and evicts blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first entry is evicted first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` fresh blocks (reference count 1), evicting cached ones if needed."""
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"asked for {num_blocks} blocks with only {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def num_reusable_from_free(self, blocks: Iterable[KVBlock]) -> int:
        """How many of these cached blocks would leave the free queue if touched."""
        return sum(1 for block in blocks if block.ref_cnt == 0)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit); revive cached-free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference to each block, in the given order.

        Blocks reaching zero join the free queue's tail in that order, so the first given
        is evicted first: callers pass a request's blocks tail first, which makes the tail
        of a prefix chain go before its head.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that `block` holds the full block with this prefix hash.

        If another block already holds the same content, this one stays uncached (it is
        a duplicate computed before the first was registered) and is simply freed later.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Forget the prefix hash of a held block whose contents are about to change."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's hash; returns how many were dropped."""
        dropped = 0
        for block in self._free.values():
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests, debugging)."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert (block.ref_cnt == 0) == in_free, f"{block!r} free-queue mismatch"
            assert block.ref_cnt >= 0, f"{block!r} negative ref count"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{block!r} not in hash map"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map entry of {block!r} is stale"
