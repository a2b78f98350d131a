"""`treadle serve` options of the scale-out: replicas, the Ray cluster, routing (served by
the Ray Serve application of treadle/integrations/ray_serve).

Owns the frozen `ReplicaConfig` (its fields become `--replicas`, `--ray-address`,
`--routing`, `--route-*` ... flags) and its validation. It imports neither Ray nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.router.routers import ROUTINGS, PrefixRouterOptions


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ReplicaConfig:
    """Engine replicas on Ray behind one front end (docs/replicas.md)."""

    replicas: int = field(default=1, metadata=_help(
        "Engine replicas, one Ray Serve replica each, behind this one front end (1: the "
        "engine runs in this process, no Ray)"))
    ray_address: str | None = field(default=None, metadata=_help(
        "Join this running Ray cluster (e.g. 127.0.0.1:6379 or 'auto') instead of starting "
        "a local one; implies replicas on Ray even with --replicas 1"))
    ray_num_cpus: int | None = field(default=None, metadata=_help(
        "CPUs of the local Ray cluster started without --ray-address (all cores when not "
        "given)"))
    replica_num_gpus: float = field(default=0.0, metadata=_help(
        "GPUs each replica declares to Ray (its CPUs: --num-threads)"))
    replica_max_restarts: int = field(default=3, metadata=_help(
        "Ray Serve replaces a replica that dies; once every replica has died more than "
        "this many times and none serves, the server gives up (/health 503, exit 1)"))
    prefill_replicas: int = field(default=0, metadata=_help(
        "P/D disaggregation: replicas that only prefill (and sample the first token); "
        "needs --decode-replicas, replaces --replicas"))
    decode_replicas: int = field(default=0, metadata=_help(
        "P/D disaggregation: replicas that decode, taking each prompt's KV blocks (those "
        "they lack) from the prefill replica"))
    pd_max_held: int = field(default=16, metadata=_help(
        "P/D: requests whose prompt KV one prefill replica holds for the decode side at "
        "most; past it new prefills wait (decode replicas full)"))
    routing: str = field(default="prefix", metadata=_help(
        "Which replica a request goes to: round-robin, least-load, or prefix (the "
        "replica holding the longest prefix of its prompt, unless it is too busy)"))
    route_ttl: float = field(default=300.0, metadata=_help(
        "prefix routing: seconds after its last use a routed prompt ages out of the tree"))
    route_cache_tokens: int | None = field(default=None, metadata=_help(
        "prefix routing: tokens the tree of one replica holds (LRU beyond); the replica's "
        "KV cache size when not given"))
    route_min_match: int | None = field(default=None, metadata=_help(
        "prefix routing: the shortest recorded prefix (tokens) that picks a replica; one "
        "KV block when not given"))
    route_balance_abs: int = field(default=4, metadata=_help(
        "prefix routing: a replica with more requests than the least loaded one by more "
        "than this many ..."))
    route_balance_rel: float = field(default=1.5, metadata=_help(
        "prefix routing: ... and by more than this factor gets no prefix-routed request"))
    route_max_kv_usage: float = field(default=0.95, metadata=_help(
        "prefix routing: a replica whose KV usage is above this gets no prefix-routed request"))

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.prefill_replicas < 0 or self.decode_replicas < 0:
            raise ValueError("prefill_replicas and decode_replicas must be >= 0")
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ValueError("prefill_replicas and decode_replicas go together: P/D needs "
                             "at least one of each")
        if self.prefill_replicas and self.replicas != 1:
            raise ValueError("replicas: with prefill_replicas/decode_replicas the replicas "
                             "are those two counts; leave replicas at 1")
        if self.pd_max_held < 1:
            raise ValueError(f"pd_max_held must be >= 1, got {self.pd_max_held}")
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise ValueError(f"ray_num_cpus must be >= 1, got {self.ray_num_cpus}")
        if self.replica_num_gpus < 0:
            raise ValueError(f"replica_num_gpus must be >= 0, got {self.replica_num_gpus}")
        if self.replica_max_restarts < 0:
            raise ValueError(f"replica_max_restarts must be >= 0, got "
                             f"{self.replica_max_restarts}")
        for name in ("route_cache_tokens", "route_min_match"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 tokens, got {getattr(self, name)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, "
                             f"got {self.routing!r}")
        self.prefix_options(16, 1 << 20)  # the route_* bounds, checked now

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def roles(self) -> list[str]:
        """Each replica's role: both (colocated), or prefill / decode."""
        if self.disaggregated:
            return ["prefill"] * self.prefill_replicas + ["decode"] * self.decode_replicas
        return ["both"] * self.replicas

    @property
    def on_ray(self) -> bool:
        return self.replicas > 1 or self.ray_address is not None or self.disaggregated

    def prefix_options(self, block_size: int, kv_tokens: int) -> PrefixRouterOptions:
        """The prefix router's parameters for engines of this block size and KV size."""
        return PrefixRouterOptions(
            chunk_size=block_size,
            capacity_tokens=max(self.route_cache_tokens or kv_tokens, block_size),
            ttl_s=self.route_ttl,
            min_match_tokens=self.route_min_match or block_size,
            balance_abs=self.route_balance_abs, balance_rel=self.route_balance_rel,
            max_kv_usage=self.route_max_kv_usage)
