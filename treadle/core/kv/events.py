"""What the KV cache tells an observer about its prefix cache: the one hook KV events use.

The prefix cache of the request-level group (core/kv/full.py's pool) calls a `KVEventSink`
when a block gets a prefix hash (`blocks_stored`: which of a request's blocks, so the sink
can read their tokens, parent hash, salt and adapter from the request), when a cached
block loses it (`blocks_removed`: evicted for reuse, rewritten by an H2O compaction, or
dropped by `reset_prefix_cache`), when nothing cached is left after a reset
(`all_cleared`), and when a swap-out parks a request's cached blocks in the swap pool
and when they leave it (`swapped_out`, `swap_released`).

It owns no state and no wire format: the sink (treadle/kv_events) turns the
calls into vLLM's events and publishes them. With no sink attached every call site is
one `is None` test on a path that evicts or registers blocks, never per token. The
sliding-window group's pool announces nothing: its hits are cut to the full group's
(core/kv/sliding.py), so the full group's cache is what a router can count on. No torch,
no I/O here.
"""

from __future__ import annotations

from typing import Protocol

from treadle.request import Request


class KVEventSink(Protocol):
    """Receives the prefix cache's changes on the engine thread, as they happen."""

    def blocks_stored(self, request: Request, indices: list[int],
                      hashes: list[bytes]) -> None:
        """Blocks `indices` (ascending positions in the request's block table, each full of
        its tokens) now hold the prefix hashes `hashes[i]` (the request's chain: `hashes`
        covers at least every index given)."""

    def blocks_removed(self, block_hash: bytes) -> None:
        """The block cached under `block_hash` is no longer in the prefix cache."""

    def all_cleared(self) -> None:
        """The prefix cache holds nothing (after a reset that left nothing cached)."""

    def swapped_out(self, request: Request, hashes: list[bytes | None]) -> None:
        """A preempted request's KV went to the swap pool, where it sits until
        `swap_released`; `hashes`: the prefix hash of each block of its table that was in
        the prefix cache (None for the others)."""

    def swap_released(self, request_id: str) -> None:
        """The request's swap blocks are freed (swapped back in, or it ended swapped)."""
