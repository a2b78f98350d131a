"""`treadle serve --replicas N` (and `--prefill-replicas/--decode-replicas`, `--ray-address`)
on Ray Serve: `start_replicas` starts or joins the Ray cluster, runs the engine
deployments of the Ray Serve application (app.py's `engine_graph`: the same deployments,
request router and client as `build_openai_app`) without Ray Serve's HTTP proxy, and
returns the `ServeEngineClient` over their handles. The `treadle serve` process is the
application's ingress: its own server (the socket it bound, its routes, its SIGTERM
drain) runs over the client, as over one engine.

Owns the cluster's start or join (Ray's token authentication named when a join is
refused), each replica's threads (its declared CPUs), the application's name and its
removal at shutdown. Nothing per request.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from treadle.config import EngineConfig
from treadle.distributed.config import ReplicaConfig

logger = logging.getLogger(__name__)


def replica_threads(config: EngineConfig, replicas: int, cluster_cpus: float) -> int:
    """Threads (and declared CPUs) per replica: --num-threads, else the cluster's CPUs
    shared out (at least one)."""
    if config.model.num_threads is not None:
        return config.model.num_threads
    return max(1, int(cluster_cpus) // replicas)


def _join_or_start(replica_config: ReplicaConfig) -> tuple[bool, bool]:
    """Ray up in this process (a cluster joined, or a local one started): (whether Ray
    was initialized here, whether the cluster was started here)."""
    import ray

    if ray.is_initialized():
        return False, False
    kwargs = {"include_dashboard": False}
    if replica_config.ray_address is not None:
        kwargs["address"] = replica_config.ray_address
        kwargs["runtime_env"] = {"env_vars": {
            k: v for k, v in os.environ.items() if k.startswith("TREADLE_") or k == "PYTHONPATH"}}
    else:
        kwargs["num_cpus"] = replica_config.ray_num_cpus
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        if replica_config.ray_address is None:
            raise
        raise ConnectionError(
            f"ray_address={replica_config.ray_address!r}: {exc}. A cluster started by `ray "
            "start` uses token authentication (Ray 2.59 and later): run treadle with "
            "RAY_AUTH_MODE=token, and the cluster's token in ~/.ray/auth_token or "
            "RAY_AUTH_TOKEN (docs/replicas.md)") from exc
    return True, replica_config.ray_address is None


def start_replicas(config: EngineConfig, replica_config: ReplicaConfig,
                   served_model_name: str | None = None, timeout: float = 600.0):
    """The engine replicas `replica_config` asks for, on Ray Serve, as one EngineClient
    (a connected ServeEngineClient); its `shutdown` deletes the application (and stops
    Ray when this call started it)."""
    import ray
    from ray import serve

    from treadle.integrations.ray_serve.app import DEPLOYMENTS, engine_graph
    from treadle.integrations.ray_serve.client import ServeEngineClient

    joined, started_cluster = _join_or_start(replica_config)
    name = f"treadle-{os.getpid()}"

    def stop() -> None:
        try:
            serve.delete(name)
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            logger.warning("could not delete the Ray Serve application %s: %s", name, exc)
        if started_cluster:  # a joined cluster's Serve stays: other apps may use it
            serve.shutdown()
        if joined:
            ray.shutdown()

    try:
        serve.start(proxy_location="Disabled")  # this process serves HTTP
        threads = replica_threads(config, len(replica_config.roles),
                                  ray.cluster_resources().get("CPU", 1))
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, num_threads=threads))
        graph = engine_graph(config, replica_config, served_model_name)
        serve.run(graph["decode" if replica_config.disaggregated else "both"], name=name,
                  route_prefix=None, logging_config={"enable_access_log": False})
        handles = {role: serve.get_deployment_handle(DEPLOYMENTS[role], name)
                   for role in graph}
        client = ServeEngineClient(handles, config, served_model_name, on_shutdown=stop,
                                   max_restarts=replica_config.replica_max_restarts)
        client.connect(timeout)
    except BaseException:
        stop()
        raise
    logger.info("%d replicas of %s on Ray Serve (application %s), %d threads each, "
                "routing %s", len(replica_config.roles), client.model_name, name, threads,
                replica_config.routing)
    return client
