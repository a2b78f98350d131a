"""The front end's view of N engine replicas on Ray, with the interface of one AsyncEngine.

Owns starting (or joining) the Ray cluster, one `EngineReplica` actor per replica with its
resources declared (CPUs = the engine's threads, GPUs as configured) and Ray's
`max_restarts`, the routing of each request (treadle/router), the streaming of its
outputs back (a Ray streaming generator per request), aborts (the client went away, or
shutdown), and the replicas' health: a thread asks every replica for its load every
`poll_interval_s`; a replica whose actor died is out of routing at once (its in-flight
requests end with an error) and back in once its restarted actor answers again, with the
adapters and tenant weights it was given replayed. It is an EngineClient
(treadle/engine/client.py), as an AsyncEngine is: the server uses the two alike.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from treadle.compat import check_disaggregation
from treadle.config import EngineConfig
from treadle.distributed.actor import EngineReplica
from treadle.distributed.config import ReplicaConfig
from treadle.distributed.metrics import FrontEndMetrics, merge_expositions
from treadle.engine.client import EngineDeadError, EngineFailedError
from treadle.engine.llm import STRUCTURED_UNSUPPORTED
from treadle.lora import LoRARequest
from treadle.models.tokenizer import load_tokenizer
from treadle.router.routers import NoReplicaError, ReplicaLoad, make_router
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 15.0
"""A replica that has not answered a load query for this long is out of routing (a hang;
a death is seen at once)."""


class ReplicaDiedError(EngineFailedError):
    """The replica serving a request died (its actor, or its engine loop)."""

    def __init__(self, replica: int, doing: str) -> None:
        super().__init__(f"engine replica {replica} died while {doing}")
        self.replica = replica


class _Replica:
    """One actor and what the front end knows of it."""

    def __init__(self, index: int, actor, role: str = "both") -> None:
        self.index, self.actor, self.role = index, actor, role
        self.healthy = False
        self.in_flight = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.pending = None
        self.stalled: str | None = None
        """Its engine's stall (engine/watchdog.py) as of the last poll: out of routing."""
        self.answered_at = time.monotonic()
        self.deaths = 0

    def view(self) -> ReplicaLoad:
        return ReplicaLoad(self.index, self.healthy and not self.stalled, self.in_flight,
                           self.num_waiting, self.kv_usage)


class _Metrics:
    """`exposition()` as the server calls it: every replica's, labelled, and our own."""

    def __init__(self, replica_set: "ReplicaSet") -> None:
        self._set = replica_set

    def exposition(self) -> bytes:
        return self._set.metrics_exposition()


def _pd_applies(params: SamplingParams) -> bool:
    """Whether P/D carries this request: one sample, no logprobs of any kind, no grammar
    (a decode replica serves the others whole)."""
    return (params.n == 1 and params.logprobs is None and params.prompt_logprobs is None
            and params.structured_outputs is None)


def _check_pd_engine(config: EngineConfig) -> None:
    check_disaggregation(config)  # feature combinations (treadle/compat.py)


def _exporter(actor):
    """What a decode replica awaits for the prefill replica's KV: its export_kv call."""
    return lambda request_id, start: actor.export_kv.remote(request_id, start)


def connect_endpoint(endpoint: str | None, host: str) -> str | None:
    """Where a subscriber on another node reaches an endpoint an engine binds:
    tcp://*:PORT (or 0.0.0.0) on `host`; ipc://, inproc:// and tcp://HOST:PORT as given."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://{host}:{port}" if bound in ("*", "0.0.0.0", "") else endpoint


def replica_threads(config: EngineConfig, replicas: int, cluster_cpus: float) -> int:
    """Threads (and declared CPUs) per replica: --num-threads, else the cluster's CPUs
    shared out (at least one)."""
    if config.model.num_threads is not None:
        return config.model.num_threads
    return max(1, int(cluster_cpus) // replicas)


def stalled_replicas(replicas) -> str | None:
    """The set's stall: every healthy replica's reason when all of them are stalled."""
    healthy = [r for r in replicas if r.healthy]
    if healthy and all(r.stalled for r in healthy):
        return "; ".join(f"replica {r.index}: {r.stalled}" for r in healthy)
    return None


class ReplicaSet:
    """N engine replicas behind one router, served as one engine."""

    poll_interval_s = 0.2

    def __init__(self, config: EngineConfig, replica_config: ReplicaConfig,
                 served_model_name: str | None = None) -> None:
        self.replica_config = replica_config
        self._started_ray = False
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False}
            if replica_config.ray_address is not None:
                kwargs["address"] = replica_config.ray_address
                kwargs["runtime_env"] = {"env_vars": {
                    k: v for k, v in os.environ.items()
                    if k.startswith("TREADLE_") or k == "PYTHONPATH"}}
            else:
                kwargs["num_cpus"] = replica_config.ray_num_cpus
            try:
                ray.init(**kwargs)
            except ConnectionError as exc:
                if replica_config.ray_address is None:
                    raise
                raise ConnectionError(
                    f"ray_address={replica_config.ray_address!r}: {exc}. A cluster started "
                    "by `ray start` uses token authentication (Ray 2.59 and later): run "
                    "treadle with RAY_AUTH_MODE=token, and the cluster's token in "
                    "~/.ray/auth_token or RAY_AUTH_TOKEN (docs/replicas.md)") from exc
            self._started_ray = True
        roles = replica_config.roles
        n = len(roles)
        if replica_config.disaggregated:
            _check_pd_engine(config)
        threads = replica_threads(config, n, ray.cluster_resources().get("CPU", 1))
        self.config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, num_threads=threads))
        remote = ray.remote(EngineReplica).options(
            num_cpus=threads, num_gpus=replica_config.replica_num_gpus,
            max_restarts=replica_config.replica_max_restarts, max_task_retries=0,
            max_concurrency=10_000)
        self._replicas = [_Replica(i, remote.remote(self.config, served_model_name, i, role,
                                                    replica_config.pd_max_held), role)
                          for i, role in enumerate(roles)]
        try:
            infos = ray.get([r.actor.info.remote() for r in self._replicas])
        except BaseException:
            self._kill_all()
            raise
        info = infos[0]
        self.info = info
        self.limits = min((i["limits"] for i in infos), key=lambda lim: lim.num_kv_tokens)
        self.model_name = info["model_name"]
        self.eos_token_id = info["eos_token_id"]
        self.model_dir = info["model_dir"]
        """The checkpoint folder the replicas loaded (/v1/models' root)."""
        self.tokenizer = load_tokenizer(info["model_dir"])
        self.supports_structured_outputs = info["supports_structured_outputs"]
        self.lora_enabled = info["lora_enabled"]
        self.kv_index = None
        """The KVEventIndex following every replica's KV events (prefix routing with
        --kv-events-endpoint), or None: the router then routes on the prompts it sent."""
        self.router = self._make_router(config)
        """Routes among the colocated replicas, or (P/D) among the prefill replicas."""
        self.decode_router = make_router("least-load")
        """P/D: routes among the decode replicas."""
        self.front_metrics = FrontEndMetrics(self.model_name)
        self.metrics = _Metrics(self)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._where: dict[str, _Replica] = {}
        self._loras: dict[str, LoRARequest] = {}
        self._lora_paths: dict[str, str] = {}
        self._weights: dict[str, float] = {}
        self._stop = threading.Event()
        for r in self._replicas:
            self._set_healthy(r, True)
        self._poller = threading.Thread(target=self._poll, name="treadle-replicas", daemon=True)
        self._poller.start()
        logger.info("%d replicas of %s on Ray, %d threads each, routing %s", n,
                    self.model_name, threads, replica_config.routing)

    def _make_router(self, config: EngineConfig):
        """The prefix router on the replicas' KV events when they publish them (each
        replica on its own port: `for_replica`), else the configured router."""
        rc = self.replica_config
        options = rc.prefix_options(self.limits.block_size, self.limits.num_kv_tokens)
        if rc.routing != "prefix" or not config.kv_events.enabled:
            return make_router(rc.routing, options)
        from treadle.kv_events.index import KVEventIndex
        from treadle.router.kv_aware import KVEventRouter

        self.kv_index = KVEventIndex(self.limits.block_size, config.kv_events.kv_events_topic)
        for r in self._replicas:
            self._follow_events(r)
        return KVEventRouter(self.kv_index, options)

    def _follow_events(self, replica: _Replica) -> None:
        """(Re)subscribe the index to the replica's events: afresh after a restart."""
        events = self.config.kv_events.for_replica(replica.index)
        host = ray.get(replica.actor.__ray_call__.remote(
            lambda _: ray.util.get_node_ip_address()), timeout=60)
        self.kv_index.add_replica(
            str(replica.index), connect_endpoint(events.kv_events_endpoint, host),
            connect_endpoint(events.kv_events_replay_endpoint, host))

    # ----- the engine interface the server uses (EngineClient) ----------------------------

    def start(self) -> None:
        """Nothing to start: the replicas step from their construction."""

    @property
    def is_alive(self) -> bool:
        """Some replica is healthy and the set has not been shut down."""
        return self.error is None and not self._stop.is_set() \
            and any(r.healthy for r in self._replicas)

    @property
    def stalled(self) -> str | None:
        """Why no replica makes progress (every healthy one stalled: GET /ready 503), or
        None while one does."""
        return stalled_replicas(self._replicas)

    @property
    def num_in_flight(self) -> int:
        """Requests routed to a replica and not yet finished."""
        return sum(r.in_flight for r in self._replicas)

    @property
    def replicas(self) -> list[ReplicaLoad]:
        return [r.view() for r in self._replicas]

    def actor(self, index: int):
        """Replica `index`'s actor handle (tests and tools)."""
        return self._replicas[index].actor

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, tenant: str | None = None,
                       lora_request: LoRARequest | None = None, **scheduling):
        """The request's outputs from the replica the router picks; leaving early aborts
        it there. A replica that dies before the request's first output is one replica
        the request tries: it goes to another healthy one (each at most once); one that
        dies after ends it with EngineFailedError (ReplicaDiedError): its tokens were
        sent, and a second run could not continue them token for token. `scheduling`:
        band, slo_ttft_ms, slo_tpot_ms (AsyncEngine.generate's), to the replica."""
        if not self.is_alive:
            raise EngineDeadError("no engine replica is running")
        if params.structured_outputs is not None and not self.supports_structured_outputs:
            raise ValueError(STRUCTURED_UNSUPPORTED)
        sent = False
        for attempt in range(len(self._replicas)):
            try:
                async for output in self._generate_once(request_id, prompt, prompt_token_ids,
                                                        params, priority, tenant,
                                                        lora_request, scheduling):
                    sent = True
                    yield output
                return
            except ReplicaDiedError as exc:
                if sent or attempt == len(self._replicas) - 1 or not self.is_alive:
                    raise
                self.front_metrics.record_retry(exc.replica)
                logger.warning("request %s: %s before its first output; retrying it on "
                               "another replica", request_id, exc)

    async def _generate_once(self, request_id, prompt, prompt_token_ids, params, priority,
                             tenant, lora_request, scheduling: dict):
        """One try of the request, on the replicas the routers pick now."""
        if self.replica_config.disaggregated:
            if _pd_applies(params):
                async for output in self._generate_pd(request_id, prompt, prompt_token_ids,
                                                      params, priority, tenant, lora_request,
                                                      scheduling):
                    yield output
                return
            group = "decode"  # what P/D does not carry runs whole on a decode replica
        else:
            group = "both"
        replica = self._route(prompt_token_ids, tenant, lora_request, group)
        self._where[request_id] = replica
        stream = replica.actor.generate.remote(request_id, prompt, prompt_token_ids, params,
                                               priority, tenant, lora_request, **scheduling)
        try:
            async for output in self._stream(replica, request_id, prompt_token_ids, stream):
                yield output
        finally:
            self._where.pop(request_id, None)

    async def _generate_pd(self, request_id, prompt, prompt_token_ids, params, priority,
                           tenant, lora_request, scheduling: dict):
        """Prefill (and the first token) on a prefill replica, the rest on a decode
        replica that takes the prompt's KV blocks it lacks from the prefill replica."""
        prefill = self._route(prompt_token_ids, tenant, lora_request, "prefill")
        self._where[request_id] = prefill
        prefilling = True
        try:
            try:
                first, _ = await prefill.actor.prefill.remote(
                    request_id, prompt, prompt_token_ids, params, priority, tenant, lora_request,
                    **scheduling)
                prefilling = False
            except RayActorError as exc:
                self._replica_died(prefill, exc)
                raise ReplicaDiedError(prefill.index, "prefilling the request") from None
            finally:
                with self._lock:
                    prefill.in_flight -= 1
            if first.finished and (first.error is not None or params.max_tokens == 1
                                   or first.outputs[0].finish_reason != "length"):
                yield first  # it ended with its first token
                return
            yield dataclasses.replace(first, finished=False, outputs=[
                dataclasses.replace(c, finish_reason=None) for c in first.outputs])
            decode = self._route(prompt_token_ids, tenant, lora_request, "decode")
            self._where[request_id] = decode
            stream = decode.actor.generate_prefilled.remote(
                request_id, prompt, prompt_token_ids, params, priority, tenant, lora_request,
                first, _exporter(prefill.actor), **scheduling)
            async for output in self._stream(decode, request_id, prompt_token_ids, stream):
                yield output
        finally:
            if prefill.healthy:
                if prefilling:  # the client went away during the prefill
                    prefill.actor.abort.remote(request_id)
                # idempotent: the decode side's export released it already, unless the
                # request ended before (first token final, abort, decode replica died)
                prefill.actor.release.remote(request_id)
            self._where.pop(request_id, None)

    async def _stream(self, replica: _Replica, request_id: str, prompt_token_ids, stream):
        """A replica's outputs of one request from its Ray streaming generator."""
        finished = False
        try:
            async for ref in stream:
                output = await ref
                if output.prompt_token_ids is None:
                    output.prompt_token_ids = prompt_token_ids
                finished = output.finished
                yield output
                if finished:
                    return
            raise EngineFailedError(f"replica {replica.index} ended the request without a "
                                    "final output")
        except RayActorError as exc:
            self._replica_died(replica, exc)
            raise ReplicaDiedError(replica.index, "serving the request") from None
        finally:
            with self._lock:
                replica.in_flight -= 1
            if not finished and replica.healthy:
                replica.actor.abort.remote(request_id)

    def pd_stats(self) -> list[dict]:
        """P/D: each decode replica's transfers and landings (benchmarks, tests)."""
        return ray.get([r.actor.pd_stats.remote() for r in self._replicas
                        if r.role == "decode" and r.healthy])

    def abort(self, request_id: str) -> None:
        """End a request early on the replica serving it."""
        replica = self._where.get(request_id)
        if replica is not None:
            replica.actor.abort.remote(request_id)

    def abort_all(self, reason: str) -> None:
        """End every in-flight request, on every healthy replica, with `reason`."""
        for r in self._replicas:
            if r.healthy:
                r.actor.abort_all.remote(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop polling, kill the actors, and Ray if this set started it."""
        self._stop.set()
        self._poller.join(timeout)
        if self.kv_index is not None:
            self.kv_index.close()
        self._kill_all()
        if self._started_ray:
            ray.shutdown()

    def record_steps(self, max_steps: int = 2048, max_finished: int = 1000):
        """No recorder: the steps are the replicas' (a ValueError saying what to turn off)."""
        raise ValueError("the dashboard, request timelines and OTLP spans read one engine's "
                         "steps: with replicas, serve with --no-dashboard --request-timelines 0"
                         " and no --otlp-traces-endpoint")

    def metrics_exposition(self) -> bytes:
        """Every healthy replica's metrics with a `replica` label, and the front end's."""
        alive = [r for r in self._replicas if r.healthy]
        texts = []
        for r, ref in zip(alive, [r.actor.metrics_text.remote() for r in alive]):
            try:
                texts.append((r.index, ray.get(ref, timeout=5)))
            except (RayActorError, GetTimeoutError):
                continue
        return merge_expositions(texts, self.front_metrics.registry)

    # ----- tenants and adapters: every replica gets every call ----------------------------

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Set a tenant's weight on every replica (replayed to a restarted one)."""
        self._weights[tenant] = weight
        ray.get([r.actor.set_tenant_weight.remote(tenant, weight) for r in self._replicas])

    @property
    def tenant_weights(self) -> dict[str, float]:
        """The weights this set gave its replicas (a copy)."""
        return dict(self._weights)

    def add_lora(self, name: str, path: str):
        """Register an adapter on every healthy replica (replayed to a restarted one)."""
        specs = ray.get([r.actor.add_lora.remote(name, path) for r in self._replicas
                         if r.healthy])
        self._lora_paths[name] = path
        self._refresh_loras()
        return specs[0]

    def check_lora(self, name: str, path: str):
        """Check an adapter's files on one healthy replica, registering nothing."""
        return ray.get(self._any_healthy().actor.check_lora.remote(name, path))

    def remove_lora(self, name: str):
        """Forget an adapter on every healthy replica."""
        removed = ray.get([r.actor.remove_lora.remote(name) for r in self._replicas
                           if r.healthy])
        self._lora_paths.pop(name, None)
        self._refresh_loras()
        return removed[0]

    def get_lora(self, name: str) -> LoRARequest | None:
        """The adapter registered under `name` (as the replicas last listed it), or None."""
        return self._loras.get(name)

    def list_loras(self) -> list[LoRARequest]:
        """Every registered adapter."""
        return list(self._loras.values())

    def _refresh_loras(self) -> None:
        loras = ray.get(self._any_healthy().actor.list_loras.remote())
        self._loras = {lora.lora_name: lora for lora in loras}

    # ----- routing and health ---------------------------------------------------------------

    def _route(self, prompt_token_ids: list[int], tenant: str | None,
               lora_request: LoRARequest | None, role: str = "both") -> _Replica:
        lora_name = None if lora_request is None else lora_request.lora_name
        router = self.decode_router if role == "decode" else self.router
        with self._lock:
            views = [r.view() for r in self._replicas if r.role == role]
            try:
                decision = router.route(prompt_token_ids, tenant, views, time.monotonic(),
                                        lora_name)
            except NoReplicaError as exc:
                raise EngineDeadError(str(exc)) from None
            replica = self._replicas[decision.replica]
            replica.in_flight += 1
        self.front_metrics.record_route(decision.replica, decision.reason,
                                        decision.matched_tokens)
        return replica

    def _any_healthy(self) -> _Replica:
        for r in self._replicas:
            if r.healthy:
                return r
        raise EngineDeadError("no engine replica is running")

    def _set_healthy(self, replica: _Replica, healthy: bool) -> None:
        replica.healthy = healthy
        self.front_metrics.set_healthy(replica.index, healthy)

    def _replica_died(self, replica: _Replica, exc: BaseException | None) -> None:
        with self._lock:
            if not replica.healthy:
                return
            self._set_healthy(replica, False)
            replica.deaths += 1
            self.router.forget(replica.index)  # its prefix cache is gone with it
            self.decode_router.forget(replica.index)
        self.front_metrics.record_death(replica.index)
        logger.error("engine replica %d is down (%s); Ray restarts it up to %d times",
                     replica.index, type(exc).__name__ if exc else "no answer",
                     self.replica_config.replica_max_restarts)
        if replica.deaths > self.replica_config.replica_max_restarts \
                and not any(r.healthy for r in self._replicas):
            self.error = EngineDeadError("every engine replica died past its restarts")

    def _rejoin(self, replica: _Replica) -> None:
        """A restarted replica answers again: give it what the others were given."""
        try:
            ray.get([replica.actor.set_tenant_weight.remote(t, w)
                     for t, w in self._weights.items()]
                    + [replica.actor.add_lora.remote(n, p) for n, p in self._lora_paths.items()],
                    timeout=60)
            if self.kv_index is not None:
                self._follow_events(replica)
        except (RayActorError, GetTimeoutError):
            return
        with self._lock:
            self._set_healthy(replica, True)
        logger.info("engine replica %d is back", replica.index)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            for r in self._replicas:
                if r.pending is None:
                    r.pending = r.actor.load.remote()
            pending = [r.pending for r in self._replicas]
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=self.poll_interval_s)
            ready = set(ready)
            now = time.monotonic()
            for r in self._replicas:
                if r.pending not in ready:
                    if r.healthy and now - r.answered_at > HEALTH_TIMEOUT_S:
                        self._replica_died(r, None)
                    continue
                ref, r.pending = r.pending, None
                try:
                    load = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - died, or its engine did
                    self._replica_died(r, exc)
                    continue
                r.answered_at = now
                r.num_waiting, r.kv_usage = load["num_waiting"], load["kv_usage"]
                r.stalled = load.get("stalled")
                if not r.healthy and load["alive"] and not self._stop.is_set():
                    self._rejoin(r)

    def _kill_all(self) -> None:
        for r in self._replicas:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
