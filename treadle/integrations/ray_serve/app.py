"""`build_openai_app`: treadle's OpenAI server over N treadle engines, as a Ray Serve app.

Owns the application's shape: an engine deployment (deployment.py's `EngineDeployment`,
one engine per Ray Serve replica: Ray Serve health-checks it — `check_health` —, restarts
it, scales it on its ongoing requests, drains it on a downscale or a redeploy) whose
handles route with treadle's router class (request_router.py), and an ingress deployment
serving treadle's own OpenAI routes (server/api.py's `build_app`) over a
`ServeEngineClient` (client.py) of that deployment's handle. It decides the deployments'
options (resources, health-check period, routing stats period), nothing per request.
docs/deploy.md's Ray Serve section says how to run it.
"""

from __future__ import annotations

from typing import Any

from treadle.config import EngineConfig

ENGINE_DEPLOYMENT = "TreadleEngine"
INGRESS_DEPLOYMENT = "TreadleOpenAI"
ROUTER_CLASS = "treadle.integrations.ray_serve.request_router.TreadleRequestRouter"
"""By name: Ray Serve imports it in each handle's process (the class, pickled, would carry
its module's map of routers)."""


def build_openai_app(engine_kwargs: dict, *, num_replicas: int | str = 1,
                     autoscaling_config: dict | None = None, routing: str = "prefix",
                     served_model_name: str | None = None,
                     server_kwargs: dict | None = None, num_gpus_per_replica: float = 0,
                     api_keys: list[str] | None = None) -> Any:
    """A Ray Serve application (`serve.run(app)` starts it) serving treadle's OpenAI API.

    `engine_kwargs`: the engine options (`EngineConfig.from_options`: model, dtype,
    num_kv_blocks, num_threads — each replica's CPUs —, kv_events_endpoint, ...);
    `num_replicas` and `autoscaling_config` are Ray Serve's (autoscaling counts a
    replica's ongoing requests, target_ongoing_requests); `routing`: round-robin,
    least-load or prefix (on the replicas' KV events when kv_events_endpoint is set);
    `server_kwargs`: ServerConfig options (the dashboard, request timelines and OTLP spans
    read one engine's steps: off here)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from treadle.distributed.config import ReplicaConfig
    from treadle.integrations.ray_serve.deployment import (HEALTH_CHECK_PERIOD_S,
                                                           ROUTING_STATS_PERIOD_S,
                                                           EngineDeployment)

    config = EngineConfig.from_options(**engine_kwargs)
    if config.lora.enable_lora:
        raise ValueError("build_openai_app: enable_lora is not served on Ray Serve yet "
                         "(treadle serve --replicas serves adapters; docs/deploy.md)")
    ReplicaConfig(routing=routing)  # checks the routing's name
    prefix = ReplicaConfig(routing=routing).prefix_options(
        config.cache.block_size, 1 << 20)
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={"routing": routing, "prefix": vars(prefix),
                               "kv_events": config.kv_events.enabled,
                               "kv_events_topic": config.kv_events.kv_events_topic},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    scaling = {"autoscaling_config": autoscaling_config} if autoscaling_config is not None \
        else {"num_replicas": num_replicas}
    engine = serve.deployment(
        EngineDeployment, name=ENGINE_DEPLOYMENT, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        max_ongoing_requests=100_000, request_router_config=router,
        ray_actor_options={"num_cpus": config.model.num_threads or 1,
                           "num_gpus": num_gpus_per_replica},
        **scaling)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name=INGRESS_DEPLOYMENT,
                               max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(config, served_model_name), config, served_model_name,
                        dict(server_kwargs or {}), api_keys)


class OpenAIIngress:
    """The ingress replica: treadle's OpenAI app over the engine deployment's handle."""

    def __init__(self, engine_handle, config: EngineConfig, served_model_name: str | None,
                 server_kwargs: dict, api_keys: list[str] | None) -> None:
        from treadle.integrations.ray_serve.client import ServeEngineClient

        self.client = ServeEngineClient({"both": engine_handle}, config, served_model_name)
        self.server_kwargs = {"dashboard": False, "request_timelines": 0, **server_kwargs}
        if served_model_name is not None:
            self.server_kwargs.setdefault("served_model_name", served_model_name)
        self.api_keys = api_keys

    async def __serve_build_asgi_app__(self):
        from treadle.server.api import build_app
        from treadle.server.auth import KeyRing
        from treadle.server.config import ServerConfig

        await self.client.connect_async()
        return build_app(self.client, ServerConfig(**self.server_kwargs),
                         KeyRing.from_options(self.api_keys, None))
