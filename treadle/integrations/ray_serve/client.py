"""`ServeEngineClient`: treadle's engine replicas on Ray Serve, with the interface of one engine.

Owns, over the deployment handles of a treadle application's engine deployments (app.py:
one colocated deployment, or P/D's prefill and decode deployments), what the server
needs of an EngineClient (treadle/engine/client.py): requests go out through the handles
— Ray Serve routes each with treadle's router class (request_router.py) and streams its
outputs back —, a request whose replica dies before it sent a token is sent again (to
another replica: the dead one is out of routing at once), one that dies after ends with
an error naming the replica; P/D's flow (prefill and the first token on a prefill
replica, the rest on a decode replica that fetches the prompt's KV it lacks from that
prefill replica; what P/D does not carry runs whole on a decode replica); the fleet's
metrics (every replica's, labelled, and the front end's own); tenant weights and LoRA
adapters (the registry is here, with the adapters' ids; both are carried with every
call and applied by a replica when newer than its own, so a replica Ray Serve replaces
gets them back on its first call). It runs in `treadle serve --replicas` (launch.py)
and in the OpenAI ingress deployment of `build_openai_app`, and never decides where a
request goes.
"""

from __future__ import annotations

import logging
import threading
import time

from treadle.distributed.metrics import FrontEndMetrics, merge_expositions
from treadle.engine.client import EngineDeadError, EngineFailedError
from treadle.engine.llm import STRUCTURED_UNSUPPORTED
from treadle.integrations.ray_serve.registry import router_for
from treadle.lora import AdapterSpec, LoRARequest
from treadle.models.tokenizer import load_tokenizer
from treadle.router.routers import ReplicaLoad
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Sends of one request before its error is final: a replica that dies before the
request's first token does not cost the request."""
CONTROL_TIMEOUT_S = 60.0
"""Seconds a control call (info, metrics, an adapter check, a pinned call) may take."""


def replica_failure(exc: BaseException) -> bool:
    """Whether a call failed because its replica (its actor or its engine) is gone, as
    opposed to the request itself being refused."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError,
                            EngineDeadError))


def cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (a LoRAError, a ValueError)."""
    inner = getattr(exc, "cause", None)
    return inner if isinstance(inner, BaseException) else exc


def pd_applies(params: SamplingParams) -> bool:
    """Whether P/D carries this request: one sample, no logprobs of any kind, no grammar
    (a decode replica serves the others whole)."""
    return (params.n == 1 and params.logprobs is None and params.prompt_logprobs is None
            and params.structured_outputs is None)


def ended_with_first(first, params: SamplingParams) -> bool:
    """Whether a prefilled request's first output is its last (an error, one token, or
    a stop)."""
    return first.finished and (first.error is not None or params.max_tokens == 1
                               or first.outputs[0].finish_reason != "length")


class _Metrics:
    def __init__(self, client: "ServeEngineClient") -> None:
        self._client = client

    def exposition(self) -> bytes:
        return self._client.metrics_exposition()


class ServeEngineClient:
    """A treadle application's engine deployments, served as one engine."""

    def __init__(self, handles: dict, config, served_model_name: str | None = None,
                 on_shutdown=None, max_restarts: int | None = None) -> None:
        """`handles`: role ("both", or "prefill" and "decode") -> DeploymentHandle;
        `config`: the engines' EngineConfig (None: the first replica's, once connected);
        `on_shutdown`: what `shutdown` does after this client stops (launch.py: delete the
        application and leave Ray when this process started them); `max_restarts`: deaths
        of every replica index after which, with none in routing, the fleet is dead
        (`error`; None: never)."""
        self.handles = handles
        self.config = config
        self.served_model_name = served_model_name
        self._on_shutdown = on_shutdown
        self.max_restarts = max_restarts
        self._error: BaseException | None = None
        self.metrics = _Metrics(self)
        # the engines' facts, from their info (connect / connect_async)
        self.info = self.limits = self.tokenizer = self.eos_token_id = None
        self.model_name = self.model_dir = None
        self.supports_structured_outputs = self.lora_enabled = False
        self._num_in_flight = 0
        self._stopped = False
        self._weights: dict[str, float] = {}
        self._weights_version = 0
        self._loras: dict[str, LoRARequest] = {}
        self._loras_version = 0
        self._next_lora_id = 1
        self._seen: set[int] = set()
        self.routers: dict = {}

    # ----- start-up ----------------------------------------------------------------------

    def connect(self, timeout: float = 600.0) -> "ServeEngineClient":
        """Ask every replica for its info (from a thread without an event loop)."""
        infos = []
        for handle in self.handles.values():
            handle.info.remote().result(timeout_s=timeout)  # Ray Serve makes the router
            infos += handle.broadcast("info").results(timeout_s=timeout)
        self._take_infos(infos)
        return self

    async def connect_async(self, timeout: float = 600.0) -> "ServeEngineClient":
        infos = []
        for handle in self.handles.values():
            await handle.info.remote()  # a routed call: Ray Serve makes the router here
            infos += await handle.broadcast("info").results_async(timeout_s=timeout)
        self._take_infos(infos)
        return self

    def _take_infos(self, infos: list[dict]) -> None:
        first = min(infos, key=lambda i: i["index"])
        self.info = first
        self.config = self.config or first["config"]  # a client of a running application
        self.limits = min((i["limits"] for i in infos), key=lambda lim: lim.num_kv_tokens)
        self.model_name = first["model_name"]
        self.eos_token_id = first["eos_token_id"]
        self.model_dir = first["model_dir"]
        self.tokenizer = load_tokenizer(first["model_dir"])
        self.supports_structured_outputs = first["supports_structured_outputs"]
        self.lora_enabled = first["lora_enabled"]
        self.front_metrics = FrontEndMetrics(self.model_name)
        for role, handle in self.handles.items():
            router = router_for(handle.app_name, handle.deployment_name)
            if router is None:
                raise RuntimeError(f"no treadle request router for {handle.deployment_name}")
            router.front_metrics = self.front_metrics
            router.use_kv_capacity(self.limits.num_kv_tokens)
            self.routers[role] = router
        for i in infos:
            self._seen.add(i["index"])
            self.front_metrics.set_healthy(i["index"], True)

    # ----- the engine interface the server uses (EngineClient) --------------------------

    def start(self) -> None:
        """Nothing to start: the replicas step from their construction."""

    def step_thread_cpus(self) -> set[int] | None:
        """None: the engines step in their replicas' processes, not here."""
        return None

    @property
    def error(self) -> BaseException | None:
        """Why the fleet is dead: every replica index died more than `max_restarts` times
        and none is in routing (the server then exits), or None."""
        if self._error is None and self.max_restarts is not None and self._seen and all(
                not any(v.healthy for v in r.replica_views()) for r in self.routers.values()):
            deaths = {i: n for r in self.routers.values() for i, n in r.deaths.items()}
            if all(deaths.get(i, 0) > self.max_restarts for i in self._seen):
                self._error = EngineDeadError("every engine replica died past its restarts")
        return self._error

    @property
    def is_alive(self) -> bool:
        """Every deployment has a replica in routing, and this client runs."""
        return self.error is None and not self._stopped and all(
            any(v.healthy for v in router.replica_views()) for router in self.routers.values())

    @property
    def stalled(self) -> str | None:
        """Never: a replica whose engine stalls fails Ray Serve's health check
        (EngineReplica.check_health), which takes it out of routing and replaces it."""
        return None

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def replicas(self) -> list[ReplicaLoad]:
        """Every replica index ever seen: its view when in routing, else unhealthy."""
        views = {v.index: v for router in self.routers.values() for v in router.replica_views()}
        self._seen |= set(views)
        return [views.get(i, ReplicaLoad(i, healthy=False)) for i in sorted(self._seen)]

    @property
    def tenant_weights(self) -> dict[str, float]:
        return dict(self._weights)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Recorded here; every call carries the weights and a replica applies newer ones."""
        self._weights[tenant] = weight
        self._weights_version += 1

    def weights_arg(self):
        return (self._weights_version, dict(self._weights)) if self._weights else None

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, tenant: str | None = None,
                       lora_request: LoRARequest | None = None, **scheduling):
        """The request's outputs from the replica Ray Serve's router (treadle's) picks;
        leaving early cancels it there (its engine aborts it). `scheduling`: band and
        deadlines (AsyncEngine.generate's), to the replica."""
        if not self.is_alive:
            raise EngineDeadError("no engine replica is running")
        if params.structured_outputs is not None and not self.supports_structured_outputs:
            raise ValueError(STRUCTURED_UNSUPPORTED)
        self._num_in_flight += 1
        try:
            args = (request_id, prompt, prompt_token_ids, params, priority, tenant, lora_request)
            if "prefill" not in self.handles:
                outputs = self.stream("both", "generate", args, scheduling=scheduling)
            elif pd_applies(params):
                outputs = self._generate_pd(args, scheduling)
            else:  # what P/D does not carry runs whole on a decode replica
                outputs = self.stream("decode", "generate", args, scheduling=scheduling)
            async for output in outputs:
                yield output
        finally:
            self._num_in_flight -= 1

    async def _generate_pd(self, args: tuple, scheduling: dict):
        """Prefill (and the first token) on a prefill replica, the rest on a decode
        replica that takes the prompt's KV blocks it lacks from that prefill replica."""
        import dataclasses

        request_id, params = args[0], args[3]
        first, uid = await self._prefill(args, scheduling)
        try:
            if ended_with_first(first, params):
                yield first
                return
            yield dataclasses.replace(first, finished=False, outputs=[
                dataclasses.replace(c, finish_reason=None) for c in first.outputs])
            async for output in self.stream("decode", "generate_prefilled", args,
                                            extra=(first, uid), retry=False,
                                            scheduling=scheduling):
                yield output
        finally:
            # idempotent: the decode side's export released it already, unless the
            # request ended before (first token final, abort, decode replica died)
            self.pinned("prefill", uid, "release", request_id)

    async def _prefill(self, args: tuple, scheduling: dict):
        """(The first output, the prefill replica's id): sent again when the replica
        dies before answering (nothing was sent to the client yet)."""
        request_id, prompt_token_ids = args[0], args[2]
        handle = self.handles["prefill"].options(method_name="prefill")
        router = self.routers["prefill"]
        for attempt in range(MAX_ATTEMPTS):
            response = handle.remote(*args, weights=self.weights_arg(),
                                     loras=self.loras_arg(), **scheduling)
            done = False
            try:
                first, _ = await response
                done = True
                first.prompt_token_ids = first.prompt_token_ids or prompt_token_ids
                where = router.where.get(request_id)
                if where is None:
                    raise EngineFailedError("the prefill replica is not known")
                return first, where[1]
            except Exception as exc:  # noqa: BLE001 - sorted out below
                if not replica_failure(exc):
                    raise
                index = self.replica_failed("prefill", request_id)
                if attempt == MAX_ATTEMPTS - 1:
                    raise EngineFailedError(f"engine replica {index} died while prefilling "
                                            "the request") from None
                if index is not None:
                    self.front_metrics.record_retry(index)
                logger.warning("prefill replica %s failed before request %s's first token "
                               "(%s): sending it again", index, request_id,
                               type(exc).__name__)
            finally:
                if not done:
                    response.cancel()
                router.where.pop(request_id, None)

    async def stream(self, role: str, method: str, args: tuple, extra: tuple = (),
                     retry: bool = True, scheduling: dict | None = None):
        """One call's outputs, streamed; sent again (up to MAX_ATTEMPTS) when its replica
        fails before the first output, an EngineFailedError naming it when after."""
        request_id, prompt_token_ids = args[0], args[2]
        handle = self.handles[role].options(stream=True, method_name=method)
        for attempt in range(MAX_ATTEMPTS):
            sent = finished = False
            response = handle.remote(*args, *extra, weights=self.weights_arg(),
                                     loras=self.loras_arg(), **(scheduling or {}))
            try:
                async for output in response:
                    if output.prompt_token_ids is None:
                        output.prompt_token_ids = prompt_token_ids
                    sent, finished = True, output.finished
                    yield output
                    if finished:
                        return
                raise EngineFailedError("a replica ended the request without a final output")
            except Exception as exc:  # noqa: BLE001 - sorted out below
                if not replica_failure(exc):
                    raise
                index = self.replica_failed(role, request_id)
                if sent or not retry or attempt == MAX_ATTEMPTS - 1:
                    raise EngineFailedError(f"engine replica {index} died while serving the "
                                            "request") from None
                if index is not None:
                    self.front_metrics.record_retry(index)
                logger.warning("replica %s failed before request %s's first token (%s): "
                               "sending it again", index, request_id, type(exc).__name__)
            finally:
                if not finished:
                    response.cancel()
                self.routers[role].where.pop(request_id, None)

    def replica_failed(self, role: str, request_id: str) -> int | None:
        """The replica that served `request_id` failed: out of routing at once."""
        router = self.routers[role]
        where = router.where.get(request_id)
        if where is None:
            return None
        index, uid = where
        router.mark_dead(uid)
        return index

    def abort(self, request_id: str) -> None:
        """End a request early on the replica serving it (leaving its stream does too)."""
        for role, router in self.routers.items():
            where = router.where.get(request_id)
            if where is not None:
                self.pinned(role, where[1], "abort", request_id)

    def abort_all(self, reason: str) -> None:
        """End every in-flight request on every replica with `reason`."""
        for handle in self.handles.values():
            _in_thread(lambda h=handle: h.broadcast("abort_all", reason).results(
                timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True))

    def pinned(self, role: str, replica_id: str, method: str, *args):
        """A call to one replica (DeploymentResponse), or None when it is not in routing."""
        router = self.routers[role]
        if replica_id in router.dead or replica_id not in router.replica_ids().values():
            return None
        return getattr(self.handles[role], method).remote(*args, target_replica=replica_id)

    def call(self, index: int, method: str, *args, timeout: float = CONTROL_TIMEOUT_S):
        """Replica `index`'s answer to `method(*args)` (tests and tools; blocking)."""
        for role, router in self.routers.items():
            uid = router.replica_ids().get(index)
            if uid is not None:
                return getattr(self.handles[role], method).remote(
                    *args, target_replica=uid).result(timeout_s=timeout)
        raise KeyError(f"no replica {index} in routing")

    def actor(self, index: int):
        """Replica `index`'s Ray actor (tests kill it)."""
        import ray

        for router in self.routers.values():
            name = router.actor_name(index)
            if name is not None:
                return ray.get_actor(name, namespace="serve")
        raise KeyError(f"no replica {index} in routing")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving; the application goes too when this process started it."""
        if self._stopped:
            return
        self._stopped = True
        if self._on_shutdown is not None:
            self._on_shutdown()

    def record_steps(self, max_steps: int = 2048, max_finished: int = 1000):
        """No recorder: the steps are the replicas' (a ValueError saying what to turn off)."""
        raise ValueError("the dashboard, request timelines and OTLP spans read one engine's "
                         "steps: with replicas, serve with --no-dashboard --request-timelines 0"
                         " and no --otlp-traces-endpoint")

    def metrics_exposition(self) -> bytes:
        """Every replica's metrics with a `replica` label, and the front end's (blocking:
        the server calls it in a thread)."""
        texts = []
        for handle in self.handles.values():
            for item in handle.broadcast("metrics_text").results(
                    timeout_s=5, return_exceptions=True):
                if not isinstance(item, BaseException):
                    texts.append(item)
        return merge_expositions(sorted(texts, key=lambda t: t[0]), self.front_metrics.registry)

    # ----- adapters: the registry is here; every call carries it -------------------------

    def loras_arg(self):
        return (self._loras_version, list(self._loras.values())) if self._loras_version \
            else None

    def add_lora(self, name: str, path: str) -> AdapterSpec:
        """Register an adapter for every replica (checked against the model on one
        first: LoRAError naming what does not fit), under an id this client gives it.
        Blocking: from a thread without an event loop."""
        spec = self.check_lora(name, path)
        lora = LoRARequest(name, self._next_lora_id, path, self.model_name)
        self._next_lora_id += 1
        self._loras[name] = lora
        self._sync_loras()
        return spec

    def check_lora(self, name: str, path: str) -> AdapterSpec:
        """Check an adapter's files on one replica, registering nothing (blocking)."""
        if not self.lora_enabled:
            raise ValueError("enable_lora is off: these engines serve no adapters")
        handle = next(iter(self.handles.values()))
        try:
            return handle.check_lora.remote(name, path).result(timeout_s=CONTROL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the replica's own error, unwrapped
            raise cause(exc) from None

    def remove_lora(self, name: str) -> LoRARequest | None:
        """Forget an adapter (the replicas drop it in the background, and on their next
        call at the latest); requests running with it finish with it."""
        removed = self._loras.pop(name, None)
        if removed is not None:
            self._sync_loras()
        return removed

    def get_lora(self, name: str) -> LoRARequest | None:
        """The adapter registered under `name`, or None."""
        return self._loras.get(name)

    def list_loras(self) -> list[LoRARequest]:
        """Every registered adapter, by id."""
        return sorted(self._loras.values(), key=lambda lora: lora.lora_int_id)

    def _sync_loras(self) -> None:
        """A new version of the registry, sent to every replica now (in the background:
        requests carry it anyway)."""
        self._loras_version += 1
        arg = self.loras_arg()
        for handle in self.handles.values():
            _in_thread(lambda h=handle: h.broadcast("sync_loras", arg).results(
                timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True))

    def pd_stats(self) -> list[dict]:
        """P/D: each decode replica's transfers and landings (benchmarks, tests;
        blocking)."""
        return sorted(self.handles["decode"].broadcast("pd_stats").results(
            timeout_s=CONTROL_TIMEOUT_S), key=lambda s: s["index"])

    # ----- waiting (tests, tools) ---------------------------------------------------------

    def wait_healthy(self, index: int, timeout: float = 120.0) -> bool:
        """Wait until replica `index` is in routing again; whether it came in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r.index == index and r.healthy for r in self.replicas):
                return True
            time.sleep(0.1)
        return False


def _in_thread(fn) -> None:
    """Run a blocking control call without waiting for it (from any thread or loop)."""
    threading.Thread(target=fn, name="treadle-serve-control", daemon=True).start()
