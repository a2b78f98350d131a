"""The pool of KV-cache blocks: reference counts, the LRU free queue and the prefix-hash map.

A block is *in use* while its reference count is above zero (one reference per request
whose block table holds it). A block whose count drops to zero goes to the tail of the
free queue but keeps its prefix hash, so a later request with the same prefix can take it
back ("cached-free"). New blocks are taken from the head of the free queue, least
recently freed first; taking a cached-free block evicts its hash.

This module knows blocks only by id; which request holds which block, and in what order,
is the KV cache manager's business. No torch here.

Blocks never used yet are not objects until first taken: the queue is the untouched ids
(`_fresh` and up, in id order) followed by the freed blocks, which is the order a queue
filled with every id at the start would have. So a pool of a million blocks (a tiny
model's default cache) costs nothing to make, where building a million objects took 5 s
of every engine start.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator


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


class Blocks:
    """Every block of a pool by id, each made on first access."""

    def __init__(self, num_blocks: int) -> None:
        self._made: list[KVBlock] = []
        self._num_blocks = num_blocks

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self._num_blocks})")
        made = self._made
        if block_id >= len(made):
            made.extend(KVBlock(i) for i in range(len(made), block_id + 1))
        return made[block_id]

    def __iter__(self) -> Iterator[KVBlock]:
        return (self[i] for i in range(self._num_blocks))

    def made(self) -> list[KVBlock]:
        """The blocks made so far (the others were never taken)."""
        return self._made


class BlockPool:
    """Allocates, shares, frees and evicts blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = Blocks(num_blocks)
        self._fresh = 0
        """Ids from here up were never taken: the head of the free queue, in id order."""
        # Freed blocks, after the fresh ones; insertion order is eviction order.
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free ones included: they can be evicted)."""
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` fresh blocks (reference count 1), evicting cached ones if needed."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {num_blocks} blocks with only {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            if self._fresh < self.num_blocks:
                block = self.blocks[self._fresh]
                self._fresh += 1
                block.ref_cnt = 1
                taken.append(block)
                continue
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
                del self._free[block.block_id]  # a fresh block holds no hash: never here
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
        for block in self.blocks.made():
            in_free = block.block_id in self._free or block.block_id >= self._fresh
            assert not (block.block_id in self._free and block.block_id >= self._fresh)
            assert (block.ref_cnt == 0) == in_free, f"{block!r} free-queue mismatch"
            assert block.ref_cnt >= 0, f"{block!r} negative ref count"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{block!r} not in hash map"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map entry of {block!r} is stale"
