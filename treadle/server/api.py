"""The OpenAI-compatible HTTP API (FastAPI): `build_app` assembles it, and decides nothing.

Owns the assembly, in this order: the serving object over the engine
(server/serving.py: the state and the steps every endpoint shares) in the app's state,
the error handlers (server/errors.py), the published schema (server/openapi.py), the
routes (server/routes.py, each reading its JSON body strictly: server/strict_json.py;
the Responses API's; the Batch API's when configured, server/batch_routes.py; the LoRA
runtime routes when enabled, server/lora_routes.py; the dashboard, request timelines and
OTLP spans when on, server/dashboard.py), then the middleware: the body's size and read
time, and authentication, added last so that it runs first (server/middleware.py). What
each endpoint does lives in its own module (server/completions.py, server/chat.py,
server/responses_api.py).
"""

from __future__ import annotations

from fastapi import FastAPI

from treadle.batch.config import BatchConfig
from treadle.engine.client import EngineClient
from treadle.server import lora_routes
from treadle.server.auth import KeyRing
from treadle.server.batch_routes import install_batch_api
from treadle.server.config import ServerConfig
from treadle.server.dashboard import install_observability
from treadle.server.errors import install_error_handlers
from treadle.server.middleware import AuthFirst, BodyLimits
from treadle.server.openapi import install_openapi
from treadle.server.routes import ROUTES, add_routes
from treadle.server.serving import OpenAIServing
from treadle.server.strict_json import StrictJSONRoute

__all__ = ["build_app"]


def build_app(engine: EngineClient, server_config: ServerConfig, keyring: KeyRing,
              batch_config: BatchConfig | None = None) -> FastAPI:
    """The app serving `engine`; its OpenAIServing is `app.state.serving`. With a
    batch_config whose batch_api is on, the Batch API too (`app.state.batch`)."""
    app = FastAPI(title="treadle", version="0.1.0",
                  description="OpenAI-compatible LLM serving with continuous batching")
    app.router.route_class = StrictJSONRoute  # bodies are RFC 8259 JSON (strict_json.py)
    serving = OpenAIServing(engine, server_config, keyring)
    app.state.serving = serving
    install_error_handlers(app)
    install_openapi(app, serving.limits, auth=keyring.enabled)
    add_routes(app, ROUTES)
    larger_bodies = {}
    if batch_config is not None and batch_config.batch_api:
        larger_bodies = install_batch_api(app, serving, batch_config)
    if server_config.enable_lora_runtime_updates:
        add_routes(app, lora_routes.ROUTES)
    install_observability(app, serving)
    app.add_middleware(BodyLimits, max_bytes=server_config.max_request_body_bytes,
                       read_timeout_s=server_config.body_read_timeout_s, larger=larger_bodies)
    app.add_middleware(AuthFirst, keyring=keyring)  # added last: runs first
    return app
