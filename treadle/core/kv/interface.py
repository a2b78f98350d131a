"""The one interface every layer group's manager implements (core/kv/manager.py composes
them; vLLM's single_type_kv_cache_manager is the shape).

A manager owns one group's block pool and each request's table in it, and answers for
its spec (kv_specs/specs.py) alone: how long a prefix hit it can serve, how many blocks a
step is short of, which blocks a request no longer needs. It never sees another group,
never chooses which request gets memory (the scheduler does) and never hashes tokens
(the composite hands it the request's chained prefix hashes). No torch here.

Hits are counted in blocks of the request's prompt, from its first: a hit of k blocks
means its first k * block_size tokens come from the prefix cache. `hit_blocks` are the
blocks of such a hit the group actually takes: all k for full attention, only those
still inside the window for a sliding group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from treadle.core.kv.block_pool import BlockPool, KVBlock
from treadle.kv_specs.specs import KVSpec
from treadle.request import Request

BlockHashes = Callable[[int], list[bytes]]
"""The request's chained prefix hashes of its first n full blocks (memoised by the
composite): `hashes(n)`."""


class SpecManager(ABC):
    """One layer group's blocks under one spec."""

    spec: KVSpec
    pool: BlockPool
    block_size: int

    frees_skipped_blocks: bool = False
    """Whether `remove_skipped_blocks` can free anything (the composite calls it only on
    such groups, so the decode steps of other groups pay nothing for it)."""

    # ----- prefix hits ------------------------------------------------------------------

    @abstractmethod
    def find_longest_cache_hit(self, hashes: BlockHashes, max_blocks: int) -> int:
        """The longest hit of at most `max_blocks` blocks this group can serve now."""

    @abstractmethod
    def hit_blocks(self, hashes: BlockHashes, num_hit_blocks: int) -> list[KVBlock] | None:
        """The group's cached blocks of a hit of that length, or None when one is gone."""

    # ----- allocation -------------------------------------------------------------------

    @abstractmethod
    def num_blocks_short(self, request: Request, num_hit_blocks: int, hit: list[KVBlock],
                         num_new_tokens: int) -> int:
        """Blocks missing for the request to take the hit and hold `num_new_tokens` more
        (negative: spare)."""

    @abstractmethod
    def allocate(self, request: Request, num_hit_blocks: int, hit: list[KVBlock],
                 num_new_tokens: int) -> None:
        """Take the hit (a request that holds nothing yet) and room for `num_new_tokens`
        more; the composite checked `num_blocks_short` first."""

    def remove_skipped_blocks(self, request_id: str, next_query_pos: int) -> None:
        """Free the blocks no query from `next_query_pos` on reads (none by default)."""

    @abstractmethod
    def cache_blocks(self, request: Request, num_full_blocks: int,
                     hashes: BlockHashes) -> None:
        """Register the request's newly full blocks (of its first `num_full_blocks`)
        under their prefix hashes."""

    # ----- release ----------------------------------------------------------------------

    @abstractmethod
    def trim(self, request_id: str, num_kept_blocks: int) -> list[int]:
        """Roll back to the first `num_kept_blocks` entries; the freed block ids."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block the request holds here."""

    # ----- tables -----------------------------------------------------------------------

    @abstractmethod
    def block_ids(self, request_id: str) -> list[int]:
        """The request's table in this group (the live list the step message reads)."""

    @abstractmethod
    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in this group now."""
