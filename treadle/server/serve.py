"""`treadle serve`: start the engine, serve the API with uvicorn, shut down gracefully.

Owns the process lifecycle. On SIGTERM or SIGINT the server stops accepting work (new
requests get 503), lets in-flight requests finish for up to `shutdown_timeout` seconds,
aborts whatever is left with an error event on its stream, and exits with status 0. When
the engine itself dies (a worker process gone or hung), its requests have already failed
and /health answers 503; the server keeps answering for ENGINE_DEATH_GRACE_S (so that
clients and health checks see why), then exits with status 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import uvicorn

from treadle.engine.gc_freeze import freeze_startup_heap
from treadle.batch.config import BatchConfig
from treadle.compat import check_serving
from treadle.config import EngineConfig
from treadle.server.config import ServerConfig
from treadle.engine.async_engine import AsyncEngine
from treadle.engine.client import EngineClient
from treadle.server.api import build_app
from treadle.server.auth import KeyRing
from treadle.server.http_protocol import bounded_head_protocol
from treadle.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

ENGINE_DEATH_GRACE_S = 2.0
"""Seconds the server stays up (answering 503) after its engine died."""


class _GracefulServer(uvicorn.Server):
    """uvicorn, with a drain phase between the signal and the exit."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self._serving, self._engine, self._timeout = serving, serving.engine, shutdown_timeout
        self._draining = False
        self.engine_died_at: float | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:  # said once the server answers, not before
            for sock in sockets or []:
                host, port = sock.getsockname()[:2]
                logger.info("serving %s on http://%s:%d", self._engine.model_name,
                            f"[{host}]" if ":" in host else host, port)

    async def on_tick(self, counter: int) -> bool:
        if self._engine.error is not None and not self._draining:
            if self.engine_died_at is None:
                self.engine_died_at = time.monotonic()
                logger.error("the engine died (%s): exiting in %.0f s", self._engine.error,
                             ENGINE_DEATH_GRACE_S)
            elif time.monotonic() - self.engine_died_at > ENGINE_DEATH_GRACE_S:
                self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: exit now
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self._serving.shutting_down = True
        logger.info("shutting down: draining %d in-flight requests (up to %.0f s)",
                    self._engine.num_in_flight, self._timeout)
        asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self._timeout
        while self._engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._engine.num_in_flight:
            logger.warning("aborting %d requests still in flight", self._engine.num_in_flight)
            self._engine.abort_all("server shutting down")
            for _ in range(100):  # let the error events reach their clients
                if not self._engine.num_in_flight:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
        self.should_exit = True


def parse_lora_modules(entries: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules` entries, `name=path` or JSON `{"name": ..., "path": ...}` (vLLM's
    two forms), as (name, path) pairs."""
    modules = []
    for entry in entries or []:
        if entry.lstrip().startswith("{"):
            try:
                item = json.loads(entry)
                name, path = item["name"], item["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules: {entry!r} is not JSON with 'name' and "
                                 "'path'") from None
        else:
            name, sep, path = entry.partition("=")
            if not sep:
                raise ValueError(f"lora_modules: {entry!r} must look like name=path")
        if not name or not path:
            raise ValueError(f"lora_modules: {entry!r} needs a name and a path")
        modules.append((str(name), str(path)))
    return modules


def make_engine(engine_config: EngineConfig, server_config: ServerConfig,
                replica_config=None, start_replicas=None) -> EngineClient:
    """One AsyncEngine in this process, or, when replica_config asks for replicas on Ray,
    `start_replicas(engine_config, replica_config, served_model_name)`'s EngineClient
    (`treadle serve` passes treadle.integrations.ray_serve's: the server never imports
    the stacks above it)."""
    if replica_config is None or not replica_config.on_ray:
        return AsyncEngine(engine_config, server_config.served_model_name)
    if start_replicas is None:
        raise ValueError("replicas on Ray: no start_replicas given (treadle serve passes "
                         "treadle.integrations.ray_serve.launch.start_replicas)")
    return start_replicas(engine_config, replica_config, server_config.served_model_name)


def serve(engine_config: EngineConfig, server_config: ServerConfig,
          replica_config=None, batch_config: BatchConfig | None = None,
          *, sock: socket.socket, start_replicas=None) -> int:
    """Serve until SIGTERM / SIGINT (exit status 0) or the engine's death (1). `sock`: the
    listening socket of host:port, bound by the caller before the engine started
    (`treadle serve` binds it first: treadle/cli/preflight.py `bind_port`);
    `start_replicas`: what makes the replicas' EngineClient (make_engine)."""
    keyring = KeyRing.from_options(server_config.api_key, server_config.api_keys_file)
    lora_modules = parse_lora_modules(server_config.lora_modules)
    check_serving(engine_config, server_config, replica_config)  # treadle/compat.py
    engine = make_engine(engine_config, server_config, replica_config, start_replicas)
    try:
        for name, path in lora_modules:  # LoRAError (a ValueError) names what does not fit
            if name == engine.model_name or engine.get_lora(name) is not None:
                raise ValueError(f"lora_modules: the name {name!r} is taken")
            engine.add_lora(name, path)
            logger.info("serving LoRA adapter %r from %s", name, path)
    except BaseException:
        engine.shutdown()
        raise
    for tenant, weight in keyring.tenants().items():  # the `fair` policy's shares
        engine.set_tenant_weight(tenant, weight)
    engine.start()
    app = build_app(engine, server_config, keyring, batch_config)
    app.state.serving.grammars.warm_up()  # before any request: its GIL time stalls nobody
    freeze_startup_heap("the server")
    head = server_config.max_header_bytes  # h11's own buffer above it: ours answers 431
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level="info", timeout_graceful_shutdown=5,
                            http=bounded_head_protocol(head),
                            h11_max_incomplete_event_size=head + 64 * 1024)
    server = _GracefulServer(config, app.state.serving, server_config.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 1 if server.engine_died_at is not None else 0
