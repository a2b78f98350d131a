"""`EngineDeployment`: one treadle engine as one Ray Serve deployment replica.

Owns what Ray Serve asks of a replica and what treadle's front end calls through
deployment handles: it builds an `EngineReplica` (replica.py) with the replica's index
(`index_offset` + its Ray Serve rank, so each replica publishes its KV events on its own
ports: `kv_events.for_replica`), and answers `check_health` (Ray Serve replaces a replica
whose engine loop died or stalled), `record_replica_metadata` (index, role, the addresses
of its KV events as the router can reach them), `record_routing_stats` (queue, running
batch, KV usage; every `ROUTING_STATS_PERIOD_S`), the streaming `generate`, P/D's calls
(a prefill replica's `prefill`, `export_kv`, `release`; a decode replica's
`generate_prefilled`, which fetches the KV from the prefill replica that served the
request through the prefill deployment's handle, pinned to it), and the control calls
the front end broadcasts (metrics, aborts, adapters). Every request carries the front
end's tenant weights and adapters, applied when newer than the replica's own, so a
replica Ray Serve starts afresh needs no replay. Calls that name `target_replica` are
pinned by the router (request_router.py). It decides nothing about routing and holds no
state of the fleet.
"""

from __future__ import annotations

import dataclasses
import logging

from treadle.config import EngineConfig
from treadle.integrations.ray_serve.replica import EngineReplica
from treadle.lora import LoRARequest
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ROUTING_STATS_PERIOD_S = 0.5
"""How often Ray Serve asks a replica for its routing stats (queue, KV usage)."""
HEALTH_CHECK_PERIOD_S = 2.0
"""How often Ray Serve calls check_health (a dead engine is replaced within this)."""


def reachable_endpoint(endpoint: str | None, node_ip: str) -> str | None:
    """The address a router on another process connects to for an engine publishing on
    `endpoint`: a bound tcp wildcard becomes the node's address, an ipc path stays (same
    node), anything else (inproc, or an endpoint the engine connects out to) is None."""
    from treadle.kv_events.publisher import binds

    if endpoint is None or not binds(endpoint) or endpoint.startswith("inproc://"):
        return None
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        return f"tcp://{node_ip}:{port}"
    return endpoint


class EngineDeployment:
    """The Ray Serve replica class (made a deployment by app.py)."""

    def __init__(self, config: EngineConfig, served_model_name: str | None = None,
                 role: str = "both", max_held: int = 16, index_offset: int = 0,
                 prefill=None) -> None:
        """`prefill`: a decode replica's handle of the prefill deployment (P/D)."""
        from ray import serve

        context = serve.get_replica_context()
        self.rank = context.rank.rank
        self.replica_id = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()
        self.index = index_offset + self.rank
        self.role = role
        self.replica = EngineReplica(config, served_model_name, self.index, role, max_held)
        self.prefill_handle = prefill
        self._weights_version = 0
        logger.info("treadle replica %d (%s, rank %d) is up", self.index, role, self.rank)

    # ----- what Ray Serve calls ------------------------------------------------------------

    def record_replica_metadata(self) -> dict:
        import ray

        kv = self.replica.engine.config.kv_events
        node_ip = ray.util.get_node_ip_address()
        return {"index": self.index, "role": self.role, "actor_name": self.actor_name,
                "kv_events_endpoint": reachable_endpoint(kv.kv_events_endpoint, node_ip),
                "kv_events_replay_endpoint": reachable_endpoint(
                    kv.kv_events_replay_endpoint, node_ip),
                "kv_events_topic": kv.kv_events_topic,
                "block_size": self.replica.engine.config.cache.block_size}

    def record_routing_stats(self) -> dict:
        return self.replica.routing_stats()

    def check_health(self) -> None:
        self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()

    # ----- requests ------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, tenant: str | None = None,
                       lora_request: LoRARequest | None = None, weights=None, loras=None,
                       **scheduling):
        """The request's outputs (streamed); `weights` = (version, {tenant: weight}) and
        `loras` = (version, [LoRARequest]): the front end's tenant weights and adapters,
        applied when newer than this replica's; `scheduling`: band and deadlines."""
        self._apply(weights, loras)
        async for output in self.replica.generate(request_id, prompt, prompt_token_ids,
                                                  params, priority, tenant, lora_request,
                                                  **scheduling):
            yield output

    def abort(self, request_id: str, target_replica: str | None = None) -> None:
        self.replica.abort(request_id)

    # ----- P/D ---------------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      params: SamplingParams, priority: int = 0, tenant: str | None = None,
                      lora_request: LoRARequest | None = None, weights=None, loras=None,
                      **scheduling):
        """Prefill role: (the first output, whether the prompt's KV is held here)."""
        self._apply(weights, loras)
        return await self.replica.prefill(request_id, prompt, prompt_token_ids, params,
                                          priority, tenant, lora_request, **scheduling)

    def export_kv(self, request_id: str, start: int, target_replica: str | None = None):
        return self.replica.export_kv(request_id, start)

    def release(self, request_id: str, target_replica: str | None = None) -> None:
        self.replica.release(request_id)

    async def generate_prefilled(self, request_id: str, prompt: str | None,
                                 prompt_token_ids: list[int], params: SamplingParams,
                                 priority: int, tenant: str | None,
                                 lora_request: LoRARequest | None, first,
                                 prefill_replica: str, weights=None, loras=None,
                                 **scheduling):
        """Decode role: the outputs after `first` of a request prefilled on the replica
        `prefill_replica` (its Ray Serve id), whose KV it fetches from there."""
        self._apply(weights, loras)
        handle = self.prefill_handle.options(method_name="export_kv")

        async def export(rid: str, start: int):
            return await handle.remote(rid, start, target_replica=prefill_replica)

        async for output in self.replica.generate_prefilled(
                request_id, prompt, prompt_token_ids, params, priority, tenant, lora_request,
                first, export, **scheduling):
            yield output

    def pd_stats(self, target_replica: str | None = None) -> dict:
        return {"index": self.index, **self.replica.pd_stats()}

    # ----- control calls (broadcast to every replica, or pinned) --------------------------

    def info(self, target_replica: str | None = None) -> dict:
        return {**self.replica.info(), "rank": self.rank, "replica_id": self.replica_id,
                "actor_name": self.actor_name}

    def metrics_text(self) -> tuple[int, bytes]:
        return self.index, self.replica.metrics_text()

    def abort_all(self, reason: str) -> None:
        self.replica.abort_all(reason)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.replica.set_tenant_weight(tenant, weight)

    def check_lora(self, name: str, path: str, target_replica: str | None = None):
        return self.replica.check_lora(name, path)

    def sync_loras(self, loras) -> None:
        self.replica.sync_loras(loras)

    def list_loras(self, target_replica: str | None = None) -> list[LoRARequest]:
        return self.replica.list_loras()

    def _apply(self, weights, loras) -> None:
        self.replica.sync_loras(loras)
        if weights is None or weights[0] <= self._weights_version:
            return
        for tenant, weight in weights[1].items():
            self.replica.set_tenant_weight(tenant, weight)
        self._weights_version = weights[0]


def with_replica_threads(config: EngineConfig, num_threads: int) -> EngineConfig:
    """The engine options of a replica that runs `num_threads` threads."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 num_threads=num_threads))
