"""Prefix-aware routing on what the replicas say they hold: their KV events (docs/replicas.md).

Owns `KVEventRouter`, the `prefix` router used when the replicas publish KV events
(`--kv-events-endpoint`): a replica's matched prefix is what its prefix cache holds by
its events — a `PrefixIndex`, the interface of treadle/kv_events/index.py's
`KVEventIndex` (`longest_prefix(replica_id, token_ids, cache_salt, lora_id, lora_name)`)
— instead of what the router sent there. Events only follow a prefill, so a prompt routed
a moment ago is not in them yet: a burst of one new prefix would spread over every
replica. So the router also keeps, per replica, the prompts it sent there in the last
`pending_ttl_s` seconds (a `PrefixTree` with that TTL), and a replica's match is the
longer of the two. The choice among matches (too busy, ties, the fallback) is the prefix
router's. Pure Python, like every router here: no Ray, no ZMQ (the index is handed in).
"""

from __future__ import annotations

from typing import Protocol

from treadle.router.routers import PrefixAwareRouter, PrefixRouterOptions, ReplicaLoad


class PrefixIndex(Protocol):
    """Where a replica's cached prefixes are known (KVEventIndex implements it)."""

    def longest_prefix(self, replica_id: str, token_ids: list[int],
                       cache_salt: str | None = None, lora_id: int | None = None,
                       lora_name: str | None = None) -> int:
        """Tokens of `token_ids` the replica's prefix cache would serve."""


PENDING_TTL_S = 10.0
"""How long a routed prompt counts as on its replica before its events confirm it: longer
than a prefill under load plus the events' way back (a step, then the socket)."""


class KVEventRouter(PrefixAwareRouter):
    """The prefix router, matching on a replica's KV events (and its last seconds' routes).
    Replica `i` of the routers' views is `str(i)` in the index."""

    name = "prefix"

    def __init__(self, index: PrefixIndex, options: PrefixRouterOptions | None = None,
                 pending_ttl_s: float = PENDING_TTL_S) -> None:
        options = options or PrefixRouterOptions()
        super().__init__(PrefixRouterOptions(
            chunk_size=options.chunk_size, capacity_tokens=options.capacity_tokens,
            ttl_s=min(options.ttl_s, pending_ttl_s),
            min_match_tokens=options.min_match_tokens, balance_abs=options.balance_abs,
            balance_rel=options.balance_rel, max_kv_usage=options.max_kv_usage))
        self.index = index

    def _matched(self, replica: ReplicaLoad, hashes, now, prompt_token_ids, tenant,
                 lora_name) -> int:
        recent = super()._matched(replica, hashes, now, prompt_token_ids, tenant, lora_name)
        cached = self.index.longest_prefix(str(replica.index), prompt_token_ids,
                                           cache_salt=tenant, lora_name=lora_name)
        return max(recent, cached)
