"""`build_openai_app`: treadle's OpenAI server over treadle engines, as a Ray Serve app.

Owns the application's shape: the engine deployments (deployment.py's `EngineDeployment`,
one engine per Ray Serve replica: Ray Serve health-checks it — `check_health` —, replaces
it when it dies, scales it on its ongoing requests, drains it on a downscale or a
redeploy) — one colocated deployment, or P/D's prefill and decode deployments, the decode
one holding the prefill one's handle to fetch KV — whose handles route with treadle's
router class (request_router.py), and an ingress deployment serving treadle's own OpenAI
routes (server/api.py's `build_app`) over a `ServeEngineClient` (client.py) of those
handles. `treadle serve --replicas` runs the same engine deployments (`engine_graph`)
with its own process as the ingress (launch.py). It decides the deployments' options
(resources, health-check period, routing stats period), nothing per request.
docs/deploy.md's Ray Serve section says how to run it.
"""

from __future__ import annotations

from typing import Any

from treadle.config import EngineConfig
from treadle.distributed.config import ReplicaConfig

ENGINE_DEPLOYMENT = "TreadleEngine"
PREFILL_DEPLOYMENT = "TreadlePrefill"
DECODE_DEPLOYMENT = "TreadleDecode"
DEPLOYMENTS = {"both": ENGINE_DEPLOYMENT, "prefill": PREFILL_DEPLOYMENT,
               "decode": DECODE_DEPLOYMENT}
"""Each role's engine deployment."""
INGRESS_DEPLOYMENT = "TreadleOpenAI"
DRAIN_POLL_S = 0.2
"""How often a replica Ray Serve is removing looks whether its requests are done (Ray
Serve's default, 2 s, makes every removal last 2 s at least)."""
ROUTER_CLASS = "treadle.integrations.ray_serve.request_router.TreadleRequestRouter"
"""By name: Ray Serve imports it in each handle's process (the class, pickled, would carry
its module's map of routers)."""


def engine_graph(config: EngineConfig, replica_config: ReplicaConfig,
                 served_model_name: str | None,
                 scaling: dict | None = None) -> dict[str, Any]:
    """Role -> bound engine deployment: {"both": ...} with `replica_config.replicas`
    replicas (or `scaling`: Ray Serve's num_replicas or autoscaling_config), or P/D's
    {"prefill": ..., "decode": ...} (the decode deployment bound with the prefill
    deployment's handle). Each replica declares `config.model.num_threads` CPUs and
    `replica_config.replica_num_gpus` GPUs."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from treadle.integrations.ray_serve.deployment import (HEALTH_CHECK_PERIOD_S,
                                                           ROUTING_STATS_PERIOD_S,
                                                           EngineDeployment)

    def deployment(role: str, routing: str, scaling: dict):
        prefix = replica_config.prefix_options(config.cache.block_size, 1 << 20)
        router = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "routing": routing, "prefix": vars(prefix),
                "kv_capacity_default": replica_config.route_cache_tokens is None,
                "kv_events": config.kv_events.enabled and role != "decode",
                "kv_events_topic": config.kv_events.kv_events_topic},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
        return serve.deployment(
            EngineDeployment, name=DEPLOYMENTS[role],
            health_check_period_s=HEALTH_CHECK_PERIOD_S, max_ongoing_requests=100_000,
            graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
            request_router_config=router,
            ray_actor_options={"num_cpus": config.model.num_threads or 1,
                               "num_gpus": replica_config.replica_num_gpus},
            **scaling)

    if not replica_config.disaggregated:
        return {"both": deployment("both", replica_config.routing, scaling or {
            "num_replicas": replica_config.replicas}).bind(config, served_model_name)}
    if scaling:
        raise ValueError("num_replicas, autoscaling_config: P/D's prefill and decode "
                         "replicas are fixed counts (prefill_replicas, decode_replicas)")
    from treadle.compat import check_disaggregation

    check_disaggregation(config)
    prefill = deployment("prefill", replica_config.routing,
                         {"num_replicas": replica_config.prefill_replicas}).bind(
        config, served_model_name, "prefill", replica_config.pd_max_held, 0)
    decode = deployment("decode", "least-load",
                        {"num_replicas": replica_config.decode_replicas}).bind(
        config, served_model_name, "decode", replica_config.pd_max_held,
        replica_config.prefill_replicas, prefill=prefill)
    return {"prefill": prefill, "decode": decode}


def build_openai_app(engine_kwargs: dict, *, num_replicas: int | str = 1,
                     autoscaling_config: dict | None = None, routing: str = "prefix",
                     served_model_name: str | None = None,
                     server_kwargs: dict | None = None, num_gpus_per_replica: float = 0,
                     api_keys: list[str] | None = None, prefill_replicas: int = 0,
                     decode_replicas: int = 0, pd_max_held: int = 16,
                     lora_modules: list[tuple[str, str]] | None = None) -> Any:
    """A Ray Serve application (`serve.run(app)` starts it) serving treadle's OpenAI API.

    `engine_kwargs`: the engine options (`EngineConfig.from_options`: model, dtype,
    num_kv_blocks, num_threads — each replica's CPUs —, kv_events_endpoint, enable_lora,
    ...); `num_replicas` and `autoscaling_config` are Ray Serve's (autoscaling counts a
    replica's ongoing requests, target_ongoing_requests); `routing`: round-robin,
    least-load or prefix (on the replicas' KV events when kv_events_endpoint is set);
    `prefill_replicas` and `decode_replicas` (both, or neither): P/D instead of
    colocated replicas; `lora_modules`: (name, path) adapters served from the start;
    `server_kwargs`: ServerConfig options (the dashboard, request timelines and OTLP spans
    read one engine's steps: off here)."""
    from ray import serve

    config = EngineConfig.from_options(**engine_kwargs)
    replica_config = ReplicaConfig(
        routing=routing, replica_num_gpus=num_gpus_per_replica,
        prefill_replicas=prefill_replicas, decode_replicas=decode_replicas,
        pd_max_held=pd_max_held)
    scaling = None
    if not replica_config.disaggregated:
        scaling = {"autoscaling_config": autoscaling_config} if autoscaling_config \
            else {"num_replicas": num_replicas}
    elif autoscaling_config is not None or num_replicas != 1:
        raise ValueError("num_replicas, autoscaling_config: with prefill_replicas and "
                         "decode_replicas the replicas are those two counts")
    graph = engine_graph(config, replica_config, served_model_name, scaling)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name=INGRESS_DEPLOYMENT,
                               max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(config, served_model_name, dict(server_kwargs or {}), api_keys,
                        list(lora_modules or []), **graph)


class OpenAIIngress:
    """The ingress replica: treadle's OpenAI app over the engine deployments' handles."""

    def __init__(self, config: EngineConfig, served_model_name: str | None,
                 server_kwargs: dict, api_keys: list[str] | None,
                 lora_modules: list[tuple[str, str]], **handles) -> None:
        from treadle.integrations.ray_serve.client import ServeEngineClient

        self.client = ServeEngineClient(handles, config, served_model_name)
        self.server_kwargs = {"dashboard": False, "request_timelines": 0, **server_kwargs}
        if served_model_name is not None:
            self.server_kwargs.setdefault("served_model_name", served_model_name)
        self.api_keys = api_keys
        self.lora_modules = lora_modules

    async def __serve_build_asgi_app__(self):
        import asyncio

        from treadle.server.api import build_app
        from treadle.server.auth import KeyRing
        from treadle.server.config import ServerConfig

        await self.client.connect_async()
        for name, path in self.lora_modules:  # blocking calls: off the event loop
            await asyncio.to_thread(self.client.add_lora, name, path)
        return build_app(self.client, ServerConfig(**self.server_kwargs),
                         KeyRing.from_options(self.api_keys, None))
