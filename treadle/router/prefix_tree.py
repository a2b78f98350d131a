"""An approximate radix tree of the prompts routed to one replica (docs/replicas.md).

Owns, per replica, what the router believes that replica's prefix cache holds: a tree
over fixed-size chunks of token ids (one chunk = `chunk_size` tokens, the engine's KV
block size), each node named by the chained hash of the chunks from the root to it. The
chain starts from a per-tenant salt, so one tenant's prompts never match another's and
routing reveals nothing across tenants. It is approximate in the ways the real cache is
not visible from outside: the engine may have evicted a block the tree still lists, and a
prompt's last partial chunk is never recorded. Entries age out (`ttl_s` since last use)
and the least recently used leaves go first when the tree holds more than
`capacity_tokens`. Nodes are kept in a dict keyed by chain hash with a child count: a
leaf is a node with no children, and a parent is always used at least as recently as
its children, so eviction in LRU order removes leaves before their parents.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass


def chunk_hashes(token_ids: list[int], chunk_size: int, salt: str | None) -> list[bytes]:
    """The chained hashes of the full chunks of `token_ids` (the last partial chunk,
    which no cache can share, is left out), starting from the salt's root."""
    parent = hashlib.blake2b(("salt:" + (salt or "")).encode(), digest_size=16).digest()
    hashes = []
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        chunk = array("q", token_ids[start:start + chunk_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass
class _Node:
    parent: bytes | None
    tick: int
    """Logical time of the last use (orders eviction)."""
    used_at: float
    """Wall time of the last use (ages the node out)."""
    children: int = 0


class PrefixTree:
    """The prompts routed to one replica, chunk by chunk."""

    def __init__(self, chunk_size: int, capacity_tokens: int, ttl_s: float) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if capacity_tokens < chunk_size:
            raise ValueError(f"capacity_tokens must be >= chunk_size ({chunk_size}), "
                             f"got {capacity_tokens}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.chunk_size, self.capacity_tokens, self.ttl_s = chunk_size, capacity_tokens, ttl_s
        self._nodes: dict[bytes, _Node] = {}
        self._tick = 0

    @property
    def num_tokens(self) -> int:
        return len(self._nodes) * self.chunk_size

    def match(self, hashes: list[bytes], now: float) -> int:
        """Tokens of the longest recorded prefix of a prompt (its chunk hashes); entries
        older than the ttl do not count."""
        matched = 0
        for h in hashes:
            node = self._nodes.get(h)
            if node is None or now - node.used_at > self.ttl_s:
                break
            matched += 1
        return matched * self.chunk_size

    def insert(self, hashes: list[bytes], now: float) -> None:
        """Record a prompt routed here (refreshing the prefix it shares)."""
        parent = None
        new = []
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                node = self._nodes[h] = _Node(parent, 0, now)
                if parent is not None:
                    self._nodes[parent].children += 1
            new.append(node)
            parent = h
        for node in reversed(new):  # deepest first: a parent ends up newer than its children
            self._tick += 1
            node.tick, node.used_at = self._tick, now
        self.expire(now)
        if self.num_tokens > self.capacity_tokens:
            self._evict(self.num_tokens - self.capacity_tokens)

    def expire(self, now: float) -> int:
        """Drop the nodes unused for longer than the ttl; returns how many."""
        old = [h for h, node in self._nodes.items() if now - node.used_at > self.ttl_s]
        old.sort(key=lambda h: self._nodes[h].tick)
        for h in old:
            self._remove(h)
        return len(old)

    def _evict(self, tokens: int) -> None:
        for h in sorted(self._nodes, key=lambda h: self._nodes[h].tick):
            if tokens <= 0:
                return
            if self._nodes[h].children == 0:
                self._remove(h)
                tokens -= self.chunk_size

    def _remove(self, h: bytes) -> None:
        node = self._nodes.pop(h, None)
        if node is not None and node.parent in self._nodes:
            self._nodes[node.parent].children -= 1

    def clear(self) -> None:
        self._nodes.clear()
