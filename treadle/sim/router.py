"""Routers of the simulated fleet: which replica a request goes to.

Owns the small interface a router implements (`Router.route(request, replicas)` -> an
index into `replicas`, each seen through `ReplicaView`: queue depths, KV usage, and how
many prompt tokens its prefix cache would serve) and three routers: `round-robin`,
`least-load` (fewest unfinished requests, then fewest KV blocks in use) and `prefix`
(the longest prefix-cache hit, unless that replica is busier than the least loaded one
by more than `max_imbalance` requests; least-load otherwise). A router of the scale-out
issue (treadle/router/) plugs in by implementing `route`. A router never changes a
replica: `prefix_hit_tokens` is a lookup without side effects.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from treadle.core.kv.hashing import hash_block, root_hash


class RoutedRequest:
    """A request as a router sees it: its prompt, and (computed once, on first use) the
    chained prefix hashes of its full blocks at a block size."""

    __slots__ = ("index", "prompt_token_ids", "priority", "cache_salt", "_hashes")

    def __init__(self, index: int, prompt_token_ids: list[int], priority: int = 0,
                 cache_salt: str | None = None) -> None:
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.priority = priority
        self.cache_salt = cache_salt
        self._hashes: dict[int, list[bytes]] = {}

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Hashes of the blocks a prefix hit may cover (all but the last token's block),
        the same chain as KVCacheManager's."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            tokens = self.prompt_token_ids
            parent = root_hash(self.cache_salt)
            hashes = []
            for i in range((len(tokens) - 1) // block_size):
                parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
                hashes.append(parent)
            self._hashes[block_size] = hashes
        return hashes


class ReplicaView(Protocol):
    """What a router may read of a replica."""

    index: int
    num_running: int
    num_waiting: int
    num_unfinished: int
    kv_usage: float

    def prefix_hit_tokens(self, request: RoutedRequest) -> int: ...


class Router(Protocol):
    name: str

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> int: ...


class RoundRobinRouter:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> int:
        index = self._next % len(replicas)
        self._next = index + 1
        return index


def _least_loaded(replicas: Sequence[ReplicaView]) -> int:
    return min(range(len(replicas)),
               key=lambda i: (replicas[i].num_unfinished, replicas[i].kv_usage, i))


class LeastLoadRouter:
    name = "least-load"

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> int:
        return _least_loaded(replicas)


class PrefixAwareRouter:
    name = "prefix"

    def __init__(self, max_imbalance: int = 8) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> int:
        least = _least_loaded(replicas)
        floor = replicas[least].num_unfinished + self.max_imbalance
        best, best_hit = least, 0
        for i, replica in enumerate(replicas):
            if replica.num_unfinished > floor:
                continue
            hit = replica.prefix_hit_tokens(request)
            if hit > best_hit:
                best, best_hit = i, hit
        return best


ROUTERS = ("round-robin", "least-load", "prefix")


def make_router(name: str) -> Router:
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-load":
        return LeastLoadRouter()
    if name == "prefix":
        return PrefixAwareRouter()
    raise ValueError(f"routing must be one of {', '.join(ROUTERS)}, got {name!r}")
