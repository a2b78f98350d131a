"""`TreadleRequestRouter`: treadle's routing as a Ray Serve request router.

Ray Serve builds one of these inside every deployment handle of a treadle engine
deployment (its `request_router_config` names the class) and asks it, per request,
`choose_replicas`. It owns turning Ray Serve's view of the replicas into treadle's
(`ReplicaLoad`: the replica's index from its metadata, the requests this router sent
there and has not seen complete, its queue and KV usage from its routing stats) and
handing the decision to a router of treadle/router: round-robin, least-load, or prefix —
on the replicas' KV events (`KVEventRouter` over a `KVEventIndex` that follows each
replica's publisher, added as replicas join) when they publish them, else on the tree of
the prompts sent. Calls naming `target_replica` (pinned aborts and control calls) go
to that replica or nowhere. Calls without a prompt (control calls) go to the
replica with the fewest requests in flight.

The front end in the same process (client.py) finds its router in registry.py (Ray Serve
pickles this module by value with the class: no state of the process can live here); it
records the routing decisions in the
front end's metrics and learns which replica serves a request and which ones died.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from treadle.integrations.ray_serve import registry
from treadle.router.routers import (NoReplicaError, PrefixRouterOptions, ReplicaLoad,
                                    RouteDecision, make_router)

logger = logging.getLogger(__name__)

PROMPT_METHODS = {"generate": 2, "prefill": 2, "generate_prefilled": 2}
"""Methods whose calls carry a prompt, and the position of its token ids among the args
(request_id, prompt, prompt_token_ids, params, priority, tenant, lora_request, ...)."""

class TreadleRequestRouter(RequestRouter):
    """treadle's routing behind Ray Serve's request-router interface."""

    def initialize_state(self, routing: str = "prefix", prefix: dict | None = None,
                         kv_events: bool = False, kv_events_topic: str = "",
                         kv_capacity_default: bool = False, **_: Any) -> None:
        self.routing = routing
        self.kv_capacity_default = kv_capacity_default
        """Whether the prefix tree's capacity is the replicas' KV cache (route_cache_tokens
        not given): set by `use_kv_capacity` once the front end knows it."""
        self.options = PrefixRouterOptions(**prefix) if prefix else PrefixRouterOptions()
        self.index = None
        """The KVEventIndex the prefix router routes on (replicas with KV events)."""
        if routing == "prefix" and kv_events:
            from treadle.kv_events.index import KVEventIndex
            from treadle.router.kv_aware import KVEventRouter

            self.index = KVEventIndex(self.options.chunk_size, kv_events_topic)
            self.router = KVEventRouter(self.index, self.options)
        else:
            self.router = make_router(routing, self.options)
        self.front_metrics = None
        """The front end's FrontEndMetrics, when one attached (client.py)."""
        self.where: dict[str, tuple[int, str]] = {}
        """treadle request id -> (index, id) of the replica its last call went to."""
        self.dead: set[str] = set()
        """Replica ids a failed call showed dead, out of routing until Ray Serve drops them."""
        self._in_flight: dict[str, int] = {}
        self._routed: dict[str, str] = {}
        """Ray Serve's internal request id -> replica id, for calls routed and running."""
        self._decisions: dict[str, RouteDecision] = {}
        self._followed: dict[int, str] = {}
        """Replica index -> the replica id whose KV events the index follows."""
        self._present: set[int] = set()
        """The replica indexes in Ray Serve's last list."""
        self.deaths: dict[int, int] = {}
        """Replica index -> how many times a replica of that index was seen dead."""
        registry.register(self._deployment_id.app_name, self._deployment_id.name, self)

    def use_kv_capacity(self, num_kv_tokens: int) -> None:
        """The replicas' KV tokens, from the front end: the prefix trees' capacity unless
        route_cache_tokens was given (before the first routed prompt)."""
        options = getattr(self.router, "options", None)
        if self.kv_capacity_default and options is not None:
            self.router.options = dataclasses.replace(
                options, capacity_tokens=max(num_kv_tokens, options.chunk_size))

    # ----- what the front end reads ----------------------------------------------------------

    def replica_views(self) -> list[ReplicaLoad]:
        """Every replica in routing, as treadle's routers see it (by index)."""
        return sorted(self._views(list(self.curr_replicas.values())).values(),
                      key=lambda view: view.index)

    def replica_ids(self) -> dict[int, str]:
        """Replica index -> id, of the replicas in routing."""
        return {index: r.replica_id.unique_id
                for r in self.curr_replicas.values()
                if (index := r.replica_metadata.get("index")) is not None}

    def actor_name(self, index: int) -> str | None:
        for r in self.curr_replicas.values():
            if r.replica_metadata.get("index") == index:
                return r.replica_metadata.get("actor_name")
        return None

    def mark_dead(self, replica_id: str) -> None:
        """A call found the replica dead: out of routing now (Ray Serve removes it soon)."""
        if replica_id in self.dead:
            return
        self.dead.add(replica_id)
        index = next((r.replica_metadata.get("index") for r in self.curr_replicas.values()
                      if r.replica_id.unique_id == replica_id), None)
        if index is not None:
            self.deaths[index] = self.deaths.get(index, 0) + 1
            self.router.forget(index)
            if self.front_metrics is not None:
                self.front_metrics.record_death(index)
                self.front_metrics.set_healthy(index, False)

    # ----- Ray Serve's interface ---------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self.dead &= live
        present = {r.replica_metadata.get("index") for r in replicas} - {None}
        if self.front_metrics is not None:  # gone without a failed call (idle, downscaled)
            for index in self._present - present:
                self.front_metrics.set_healthy(index, False)
        self._present = present
        for r in replicas:
            index = r.replica_metadata.get("index")
            if index is None:
                continue
            if self.front_metrics is not None and r.replica_id.unique_id not in self.dead:
                self.front_metrics.set_healthy(index, True)
            if self.index is not None and self._followed.get(index) != r.replica_id.unique_id:
                self._follow(index, r)

    def on_replica_actor_died(self, replica_id) -> None:
        self.mark_dead(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        live = [r for r in candidate_replicas if r.replica_id.unique_id not in self.dead]
        if pending_request is None:
            return [live] if live else []
        target = pending_request.kwargs.get("target_replica")
        if target is not None:
            return [[r for r in live if r.replica_id.unique_id == target]] \
                if any(r.replica_id.unique_id == target for r in live) else []
        position = PROMPT_METHODS.get(pending_request.metadata.call_method)
        if position is None or not live:
            return [sorted(live, key=lambda r: self._in_flight.get(r.replica_id.unique_id,
                                                                   0))[:1]] if live else []
        args = pending_request.args
        tenant, lora = args[5], args[6]
        by_index = {r.replica_metadata.get("index"): r for r in live}
        views = self._views(live)
        try:
            decision = self.router.route(args[position], tenant, list(views.values()),
                                         time.monotonic(),
                                         lora_name=None if lora is None else lora.lora_name)
        except NoReplicaError:
            return []
        self._decisions[pending_request.metadata.internal_request_id] = decision
        return [[by_index[decision.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        uid = replica_id.unique_id
        internal = pending_request.metadata.internal_request_id
        self._routed[internal] = uid
        self._in_flight[uid] = self._in_flight.get(uid, 0) + 1
        decision = self._decisions.pop(internal, None)
        if pending_request.metadata.call_method in PROMPT_METHODS:
            replica = self.curr_replicas.get(replica_id)
            index = None if replica is None else replica.replica_metadata.get("index")
            if index is not None:
                self.where[pending_request.args[0]] = (index, uid)
            if decision is not None and self.front_metrics is not None:
                self.front_metrics.record_route(decision.replica, decision.reason,
                                                decision.matched_tokens)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._decisions.pop(internal_request_id, None)
        uid = self._routed.pop(internal_request_id, None)
        if uid is not None:
            self._in_flight[uid] = max(0, self._in_flight.get(uid, 0) - 1)

    # ----- helpers -----------------------------------------------------------------------------

    def _views(self, replicas: list[RunningReplica]) -> dict[int, ReplicaLoad]:
        views = {}
        for r in replicas:
            index = r.replica_metadata.get("index")
            if index is None:
                continue
            uid = r.replica_id.unique_id
            stats = r.routing_stats or {}
            views[index] = ReplicaLoad(index, uid not in self.dead, self._in_flight.get(uid, 0),
                                       int(stats.get("num_waiting", 0)),
                                       float(stats.get("kv_usage", 0.0)))
        return views

    def _follow(self, index: int, replica: RunningReplica) -> None:
        meta = replica.replica_metadata
        endpoint = meta.get("kv_events_endpoint")
        if endpoint is None:
            return
        try:
            self.index.add_replica(str(index), endpoint, meta.get("kv_events_replay_endpoint"))
        except Exception as exc:  # noqa: BLE001 - routing goes on, on recent routes only
            logger.warning("replica %d: cannot follow its KV events at %s (%s)", index,
                           endpoint, exc)
            return
        self._followed[index] = replica.replica_id.unique_id
        logger.info("routing on replica %d's KV events from %s", index, endpoint)
