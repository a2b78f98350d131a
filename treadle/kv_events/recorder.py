"""The KV event sink (core/kv/events.py's hook) that turns the prefix cache's changes into
vLLM's events, on the engine thread, between flushes.

What it writes for each call:

- `blocks_stored`: one `BlockStored` per run of consecutive block indices, with the run's
  hashes, the hash of the block before it (None at the request's first block), the run's
  tokens, the adapter's id and name, the cache's medium, and `extra_keys` (per block:
  the adapter's name, and the request's cache salt — treadle's tenant — on block 0),
  group 0, kind `full_attention`;
- `blocks_removed`: the hash joins one `BlockRemoved` with the hashes removed just
  before it (one event per run of removals);
- `all_cleared`: `AllBlocksCleared`;
- `swapped_out` / `swap_released`: the request's chain of cached blocks from its first
  (up to the first block not in the prefix cache) is stored / removed on the
  `CPU_SWAP` medium, each hash counted over the requests that parked it, so a hash is
  announced once and removed when the last of them leaves swap.

`take()` hands the events gathered since the last call to the publisher. Holds no
socket and never blocks.
"""

from __future__ import annotations

from treadle.kv_events.wire import (KIND_FULL_ATTENTION, MEDIUM_CPU_SWAP,
                                                 AllBlocksCleared, BlockRemoved, BlockStored,
                                                 wire_hash)
from treadle.request import Request


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Ascending indices as [start, end) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    start = prev = indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            runs.append((start, prev + 1))
            start = i
        prev = i
    runs.append((start, prev + 1))
    return runs


class KVEventRecorder:
    """Gathers one engine's KV events; `medium` names where its KV cache lives."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list = []
        self._swap_count: dict[int, int] = {}
        """Wire hash -> how many swapped-out requests hold it in swap memory."""
        self._swapped: dict[str, list[int]] = {}
        """Request id -> the wire hashes it parked (announced or counted)."""

    def take(self) -> list:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ----- the hook -----------------------------------------------------------------------

    def blocks_stored(self, request: Request, indices: list[int],
                      hashes: list[bytes]) -> None:
        for start, end in _runs(indices):
            self._events.append(self._stored(request, start, end, hashes, self.medium))

    def blocks_removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is BlockRemoved and last.medium == self.medium:
            last.block_hashes.append(wire_hash(block_hash))
        else:
            self._events.append(BlockRemoved([wire_hash(block_hash)], self.medium, 0))

    def all_cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def swapped_out(self, request: Request, hashes: list[bytes | None]) -> None:
        chain = []
        for block_hash in hashes:
            if block_hash is None:
                break
            chain.append(block_hash)
        parked = [wire_hash(h) for h in chain]
        self._swapped[request.request_id] = parked
        new = []
        for i, h in enumerate(parked):
            count = self._swap_count.get(h, 0)
            self._swap_count[h] = count + 1
            if count == 0:
                new.append(i)
        if new:
            for start, end in _runs(new):
                self._events.append(self._stored(request, start, end, chain, MEDIUM_CPU_SWAP))

    def swap_released(self, request_id: str) -> None:
        gone = []
        for h in self._swapped.pop(request_id, ()):
            count = self._swap_count[h] - 1
            if count:
                self._swap_count[h] = count
            else:
                del self._swap_count[h]
                gone.append(h)
        if gone:
            self._events.append(BlockRemoved(gone, MEDIUM_CPU_SWAP, 0))

    # ----- building events ----------------------------------------------------------------

    def _stored(self, request: Request, start: int, end: int, hashes: list[bytes],
                medium: str) -> BlockStored:
        size = self.block_size
        lora = request.lora_request
        lora_name = None if lora is None else lora.lora_name
        salt = request.cache_salt
        extra_keys: list[tuple | None] = []
        for i in range(start, end):
            keys = ((lora_name,) if lora_name is not None else ()) + \
                ((salt,) if i == 0 and salt is not None else ())
            extra_keys.append(keys or None)
        return BlockStored(
            block_hashes=[wire_hash(h) for h in hashes[start:end]],
            parent_block_hash=None if start == 0 else wire_hash(hashes[start - 1]),
            token_ids=request.all_token_ids[start * size:end * size],
            block_size=size, lora_id=None if lora is None else lora.lora_int_id,
            medium=medium, lora_name=lora_name, extra_keys=extra_keys, group_idx=0,
            kv_cache_spec_kind=KIND_FULL_ATTENTION)
