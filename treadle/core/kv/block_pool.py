"""The pool of KV-cache blocks: reference counts, the LRU free queue and the prefix-hash map.

A block is *in use* while its reference count is above zero (one reference per request
whose block table holds it). A block whose count drops to zero goes to the tail of the
free queue but keeps its prefix hash, so a later request with the same prefix can take it
back ("cached-free"). New blocks are taken from the head of the free queue, least
recently freed first; taking a cached-free block evicts its hash.

This module knows blocks only by id; which request holds which block, and in what order,
is the KV cache manager's business. No torch here.

`on_removed`, when set (KV events: core/kv/events.py), is called with the hash of every
block that leaves the prefix cache (evicted for reuse, uncached, reset); `cache` says
whether it registered the block, so the manager can announce the blocks stored.

Blocks never used yet are not objects until first taken: the queue is the untouched ids
(`_fresh` and up, in id order) followed by the freed blocks, which is the order a queue
filled with every id at the start would have. So a pool of a million blocks (a tiny
model's default cache) costs nothing to make, where building a million objects took 5 s
of every engine start.

**Runs of consecutive blocks** (`allocate(..., owner=, expected=)`): a request that says
how many blocks it expects to hold gets a *run* of that many never-used ids set aside for
it (an extent), and takes its next block from there each time it grows, so its blocks
lie side by side in the KV tensors: a decode step reads a request's context in a few long
runs instead of one 16-token block here and another there (interleaved with every other
request's, as blocks taken one at a time from one queue are), which the attention kernels
read faster (docs/benchmarks.md, round 17). An extent is only a preference: its blocks
still count as free, and when the never-used blocks outside extents run out, the others
take the tail of the largest extent (an owner half of it, as its own extent) before any
cached block is evicted. So which blocks are *cached* and when they are evicted, how many
are free, and every count the scheduler reads are exactly what they are without extents;
only the ids of never-used blocks differ. `release(owner)` hands an extent's unused
remainder back (`_spare` runs, merged with their neighbours and the untouched tail).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Iterator


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
        self._extents: dict[str, list[int]] = {}
        """Owner -> [next, end): never-used ids set aside for it, taken from `next` up."""
        self._num_reserved = 0
        self._spare: dict[int, int] = {}
        """start -> end of never-used runs below `_fresh` that no owner holds (extents'
        unused remainders, handed back)."""
        self._spare_by_end: dict[int, int] = {}
        self._num_spare = 0
        self.on_removed: Callable[[bytes], None] | None = None
        """Told the hash of each block that leaves the prefix cache (None: nobody)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free ones included: they can be evicted)."""
        return (self.num_blocks - self._fresh + self._num_spare + self._num_reserved
                + len(self._free))

    @property
    def num_reserved_blocks(self) -> int:
        """Free blocks set aside in owners' extents (counted in num_free_blocks)."""
        return self._num_reserved

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int, owner: str | None = None,
                 expected: int = 0) -> list[KVBlock]:
        """Take `num_blocks` fresh blocks (reference count 1), evicting cached ones if needed.

        With an `owner` that `expected` to take that many blocks in all from now on
        (these included), never-used blocks come from its extent, set up on first need;
        without, from the lowest never-used id outside extents, as before extents."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {num_blocks} blocks with only {self.num_free_blocks} free")
        taken = []
        for i in range(num_blocks):
            block_id = self._take_unused(owner, expected - i)
            if block_id is not None:
                block = self.blocks[block_id]
                block.ref_cnt = 1
                taken.append(block)
                continue
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.on_removed is not None:
                    self.on_removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _take_unused(self, owner: str | None, expected: int) -> int | None:
        """A never-used id for `owner` (expecting `expected` more blocks), or None when
        every never-used block is taken: the owner's extent, else a new extent carved
        from the never-used runs (or, when only extents are left, half the largest one's
        tail); without an owner the lowest unowned id, else the largest extent's last."""
        if owner is not None:
            extent = self._extents.get(owner)
            if extent is not None and extent[0] < extent[1]:
                self._num_reserved -= 1
                extent[0] += 1
                return extent[0] - 1
        if self._fresh < self.num_blocks or self._spare:
            if owner is None or expected <= 1:
                return self._take_lowest_unowned()
            start, length = self._carve(expected)
            self._extents[owner] = [start + 1, start + length]
            self._num_reserved += length - 1
            return start
        if not self._num_reserved:
            return None
        victim = max(self._extents.values(), key=lambda e: e[1] - e[0])
        remaining = victim[1] - victim[0]
        if owner is None or expected <= 1 or remaining == 1:
            victim[1] -= 1
            self._num_reserved -= 1
            return victim[1]
        length = min(expected, (remaining + 1) // 2)
        victim[1] -= length
        self._extents[owner] = [victim[1] + 1, victim[1] + length]
        self._num_reserved -= 1
        return victim[1]

    def _take_lowest_unowned(self) -> int:
        if self._spare:
            start = min(self._spare)
            end = self._remove_spare(start)
            if start + 1 < end:
                self._add_spare(start + 1, end)
            self._num_spare -= 1
            return start
        self._fresh += 1
        return self._fresh - 1

    def _carve(self, length: int) -> tuple[int, int]:
        """Take the first `length` (or fewer) ids of the never-used run that fits `length`
        most tightly (else the longest): (start, how many)."""
        runs = list(self._spare.items()) + [(self._fresh, self.num_blocks)]
        fitting = [r for r in runs if r[1] - r[0] >= length]
        start, end = (min(fitting, key=lambda r: r[1] - r[0]) if fitting
                      else max(runs, key=lambda r: r[1] - r[0]))
        length = min(length, end - start)
        if start == self._fresh:
            self._fresh += length
        else:
            self._remove_spare(start)
            self._num_spare -= length
            if start + length < end:
                self._add_spare(start + length, end)
        return start, length

    def release(self, owner: str) -> None:
        """The owner holds no more blocks of its extent: hand back the unused remainder."""
        extent = self._extents.pop(owner, None)
        if extent is None or extent[0] >= extent[1]:
            return
        start, end = extent
        self._num_reserved -= end - start
        self._num_spare += end - start
        before = self._spare_by_end.get(start)
        if before is not None:  # merge with the run ending where this one starts
            self._remove_spare(before)
            start = before
        if end in self._spare:  # and with the run starting where it ends
            after_end = self._spare[end]
            self._remove_spare(end)
            end = after_end
        if end == self._fresh:  # touching the untouched tail: it grows back down
            self._num_spare -= end - start
            self._fresh = start
        else:
            self._add_spare(start, end)

    def _add_spare(self, start: int, end: int) -> None:
        self._spare[start] = end
        self._spare_by_end[end] = start

    def _remove_spare(self, start: int) -> int:
        """Take the spare run starting at `start` out of the maps (its ids stay counted in
        _num_spare until the caller takes or re-adds them); returns its end."""
        end = self._spare.pop(start)
        del self._spare_by_end[end]
        return end

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

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Record that `block` holds the full block with this prefix hash; whether it did.

        If another block already holds the same content, this one stays uncached (it is
        a duplicate computed before the first was registered) and is simply freed later.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def uncache(self, block: KVBlock) -> None:
        """Forget the prefix hash of a held block whose contents are about to change."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.on_removed is not None:
                self.on_removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's hash; returns how many were dropped."""
        dropped = 0
        for block in self._free.values():
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.on_removed is not None:
                    self.on_removed(block.block_hash)
                block.block_hash = None
                dropped += 1
        return dropped

    def _never_used_ranges(self) -> list[tuple[int, int]]:
        """Every never-used range: the untouched tail, spare runs, extents' remainders."""
        return ([(self._fresh, self.num_blocks)] + list(self._spare.items())
                + [(a, b) for a, b in self._extents.values() if a < b])

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests, debugging)."""
        ranges = sorted(self._never_used_ranges())
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            assert end <= start, f"never-used ranges overlap: {ranges}"
        assert self._num_spare == sum(b - a for a, b in self._spare.items())
        assert self._num_reserved == sum(max(b - a, 0) for a, b in self._extents.values())
        assert all(self._spare_by_end[b] == a for a, b in self._spare.items())
        assert len(self._spare_by_end) == len(self._spare)
        assert all(b < self._fresh for b in self._spare.values()), "a spare run past _fresh"
        for block in self.blocks.made():
            never_used = any(a <= block.block_id < b for a, b in ranges)
            in_free = block.block_id in self._free or never_used
            assert not (block.block_id in self._free and never_used)
            assert (block.ref_cnt == 0) == in_free, f"{block!r} free-queue mismatch"
            assert block.ref_cnt >= 0, f"{block!r} negative ref count"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{block!r} not in hash map"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map entry of {block!r} is stale"
