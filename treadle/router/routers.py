"""Which replica serves a request: round-robin, least-load, or prefix-aware (docs/replicas.md).

Owns the routing decision and nothing else: a router sees each replica through a
`ReplicaLoad` (healthy or not, requests in flight there, its scheduler's waiting queue,
its KV usage) and the request through its prompt token ids and tenant. The prefix-aware
router also keeps one `PrefixTree` per replica of the prompts it sent there. Pure Python:
no Ray, no torch, no clock of its own (`now` is passed in), so a scripted sequence tests it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from treadle.router.prefix_tree import PrefixTree, chunk_hashes

ROUTINGS = ("round-robin", "least-load", "prefix")


class NoReplicaError(RuntimeError):
    """No healthy replica can take the request."""


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router reads of one replica."""

    index: int
    healthy: bool = True
    num_in_flight: int = 0
    """Requests this front end has sent there and not seen finish (exact, immediate)."""
    num_waiting: int = 0
    """The replica's scheduler queue at its last report."""
    kv_usage: float = 0.0
    """Fraction of its KV blocks in use at its last report."""

    @property
    def depth(self) -> int:
        return max(self.num_in_flight, self.num_waiting)


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    matched_tokens: int = 0
    reason: str = ""
    """'prefix' (the longest recorded prefix), 'balance' (least load: no useful prefix,
    or the prefix's replica was too busy) or the router's name."""


class Router(Protocol):
    name: str

    def route(self, prompt_token_ids: list[int], tenant: str | None,
              replicas: Sequence[ReplicaLoad], now: float,
              lora_name: str | None = None) -> RouteDecision: ...

    def forget(self, replica: int) -> None:
        """The replica lost its cache (it died or restarted)."""


def _healthy(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoReplicaError("no healthy engine replica")
    return healthy


def _least_loaded(candidates: Sequence[ReplicaLoad]) -> ReplicaLoad:
    return min(candidates, key=lambda r: (r.depth, r.kv_usage, r.index))


class RoundRobinRouter:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, prompt_token_ids, tenant, replicas, now, lora_name=None) -> RouteDecision:
        healthy = {r.index for r in _healthy(replicas)}
        n = len(replicas)
        for step in range(n):
            i = replicas[(self._next + step) % n].index
            if i in healthy:
                self._next = (self._next + step + 1) % n
                return RouteDecision(i, reason=self.name)
        raise NoReplicaError("no healthy engine replica")  # unreachable: healthy is non-empty

    def forget(self, replica: int) -> None:
        pass


class LeastLoadRouter:
    name = "least-load"

    def route(self, prompt_token_ids, tenant, replicas, now, lora_name=None) -> RouteDecision:
        return RouteDecision(_least_loaded(_healthy(replicas)).index, reason=self.name)

    def forget(self, replica: int) -> None:
        pass


@dataclass
class PrefixRouterOptions:
    """The prefix router's parameters (flags `--route-*`, docs/replicas.md)."""

    chunk_size: int = 16
    """Tokens per tree node: the engines' KV block size (only whole blocks are cached)."""
    capacity_tokens: int = 1 << 20
    """Tokens the tree of one replica holds before LRU leaves go: that replica's KV cache
    size is the natural value (the server passes it)."""
    ttl_s: float = 300.0
    """Seconds after its last use an entry ages out."""
    min_match_tokens: int = 16
    """A recorded prefix shorter than this is no reason to pick a replica."""
    balance_abs: int = 4
    """The prefix's replica is skipped when its depth exceeds the least loaded one's by
    more than this many requests ..."""
    balance_rel: float = 1.5
    """... and by more than this factor (depth > balance_rel * least depth)."""
    max_kv_usage: float = 0.95
    """A replica whose KV usage is above this is skipped for a prefix hit."""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "capacity_tokens", "min_match_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.balance_abs < 0:
            raise ValueError(f"route_balance_abs must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 1:
            raise ValueError(f"route_balance_rel must be >= 1, got {self.balance_rel}")
        if not 0 < self.max_kv_usage <= 1:
            raise ValueError(f"route_max_kv_usage must be in (0, 1], got {self.max_kv_usage}")
        if not self.ttl_s > 0:
            raise ValueError(f"route_ttl must be > 0 seconds, got {self.ttl_s}")


class PrefixAwareRouter:
    """The longest recorded prefix among replicas that are not too busy; least load when
    no replica has a useful prefix. Every routed prompt is recorded at its replica."""

    name = "prefix"

    def __init__(self, options: PrefixRouterOptions | None = None) -> None:
        self.options = options or PrefixRouterOptions()
        self._trees: dict[int, PrefixTree] = {}

    def tree(self, replica: int) -> PrefixTree:
        tree = self._trees.get(replica)
        if tree is None:
            o = self.options
            tree = self._trees[replica] = PrefixTree(o.chunk_size, o.capacity_tokens, o.ttl_s)
        return tree

    def _too_busy(self, replica: ReplicaLoad, least: ReplicaLoad) -> bool:
        o = self.options
        if replica.kv_usage > o.max_kv_usage:
            return True
        over = replica.depth - least.depth
        return over > o.balance_abs and replica.depth > o.balance_rel * least.depth

    def _matched(self, replica: ReplicaLoad, hashes: list[bytes], now: float,
                 prompt_token_ids: list[int], tenant: str | None,
                 lora_name: str | None) -> int:
        """Tokens of the prompt the router expects `replica` to hold: here, its tree of
        the prompts sent there (KVEventRouter: what the replica's events say it holds)."""
        return self.tree(replica.index).match(hashes, now)

    def route(self, prompt_token_ids, tenant, replicas, now,
              lora_name: str | None = None) -> RouteDecision:
        """`tenant` and `lora_name` (the request's adapter, if any) salt the prompt's
        block hashes (`route_salt`): no match across tenants or adapters."""
        candidates = _healthy(replicas)
        least = _least_loaded(candidates)
        hashes = chunk_hashes(prompt_token_ids, self.options.chunk_size,
                              route_salt(tenant, lora_name))
        best, best_match = None, 0
        for replica in candidates:
            matched = self._matched(replica, hashes, now, prompt_token_ids, tenant, lora_name)
            if matched < self.options.min_match_tokens or matched < best_match:
                continue
            if matched == best_match and best is not None \
                    and (replica.depth, replica.index) >= (best.depth, best.index):
                continue
            if self._too_busy(replica, least):
                continue
            best, best_match = replica, matched
        if best is None:  # no useful prefix: the least loaded, then the emptiest tree
            best = min(candidates, key=lambda r: (r.depth, r.kv_usage,
                                                  self.tree(r.index).num_tokens, r.index))
            decision = RouteDecision(best.index, 0, "balance")
        else:
            decision = RouteDecision(best.index, best_match, "prefix")
        self.tree(best.index).insert(hashes, now)
        return decision

    def forget(self, replica: int) -> None:
        self.tree(replica).clear()


def route_salt(tenant: str | None, lora_name: str | None) -> str | None:
    """The salt a routing tree keys a request's blocks by: its tenant, and its adapter."""
    return tenant if lora_name is None else f"{tenant}\x00{lora_name}"


def make_router(name: str, options: PrefixRouterOptions | None = None) -> Router:
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-load":
        return LeastLoadRouter()
    if name == "prefix":
        return PrefixAwareRouter(options)
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {name!r}")
