"""LoRA adapters over HTTP: vLLM's runtime routes POST /v1/load_lora_adapter and
/v1/unload_lora_adapter.

The routes exist only with `--enable-lora-runtime-updates`, take vLLM's bodies (closed:
an unknown key is a 400) and answer as vLLM does (plain-text success, OpenAI-style
errors; a taken name is a 409 and a path with no adapter a 404, where vLLM answers 400
for both); a key limited to some models (keys file field `models`, server/auth.py) may
not load or unload, and unloading another tenant's adapter is the same 404 as unloading
one that does not exist. Loading checks the adapter's files against the model
(treadle/lora.py) off the event loop; the worker reads its weights when a step first
needs them. Which model a request names, and what /v1/models lists, is the serving
object's (server/serving.py); the adapters themselves are the engine's
(engine/lora_registry.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from treadle.lora import LoRAError
from treadle.server.auth import Tenant
from treadle.server.errors import error_response
from treadle.server.routes import Route
from treadle.server.serving import OpenAIServing, serving_of


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=512)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False
    """Replace an adapter of that name already loaded (it gets a new id)."""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=512)
    lora_int_id: Optional[int] = None


ROUTE_ERRORS = {
    ("/v1/load_lora_adapter", "post"): (400, 403, 404, 409, 413, 503),
    ("/v1/unload_lora_adapter", "post"): (400, 403, 404, 413, 503),
}
"""The statuses the runtime routes can answer (server/openapi.py documents them)."""


def _not_found(name: str) -> JSONResponse:
    return error_response(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                          "NotFoundError")


def _has_adapter_config(path: str) -> bool:
    try:
        return (Path(path) / "adapter_config.json").is_file()
    except (OSError, ValueError):  # a name the OS cannot take (a NUL byte, too long)
        return False


def _forbidden(tenant: Tenant) -> JSONResponse | None:
    if tenant.models is None:
        return None
    return error_response(403, "this API key is limited to some models and may not "
                          "load or unload adapters", None, "permission_error")


async def load_adapter(serving: OpenAIServing, body: LoadLoRAAdapterRequest,
                       request: Request):
    """Statuses: 200 plain text; 400 an adapter that does not fit the model (the message
    names what); 403 a key limited to some models; 404 no adapter at the path; 409 the
    name is taken (without load_inplace) or is the base model's."""
    tenant = serving.authorize(request)
    refused = _forbidden(tenant)
    if refused is not None:
        return refused
    engine, name = serving.engine, body.lora_name
    if name == engine.model_name:
        return error_response(409, f"'{name}' is the base model's name", "lora_name")
    loaded = engine.get_lora(name)
    if loaded is not None and not body.load_inplace:
        return error_response(409, f"The lora adapter '{name}' has already been loaded.",
                              "lora_name")
    if not await run_in_threadpool(_has_adapter_config, body.lora_path):
        return error_response(404, f"no LoRA adapter at {body.lora_path!r} (no "
                              "adapter_config.json)", "lora_path", "NotFoundError")
    try:
        # Checked before the old one is dropped: a failed in-place load keeps it.
        await run_in_threadpool(engine.check_lora, name, body.lora_path)
        if loaded is not None:
            engine.remove_lora(name)
        await run_in_threadpool(engine.add_lora, name, body.lora_path)
    except (LoRAError, ValueError) as exc:
        return error_response(400, str(exc), "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def unload_adapter(serving: OpenAIServing, body: UnloadLoRAAdapterRequest, request: Request):
    """Statuses: 200 plain text; 403 a key limited to some models; 404 no adapter of that
    name (or of that id), or one the key may not use."""
    tenant = serving.authorize(request)
    name = body.lora_name
    lora = serving.engine.get_lora(name)
    if lora is None or not tenant.may_use(name) or (
            body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
        return _not_found(name)
    refused = _forbidden(tenant)
    if refused is not None:
        return refused
    serving.engine.remove_lora(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    return await load_adapter(serving_of(request), body, request)


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    return unload_adapter(serving_of(request), body, request)


ROUTES = (
    Route("POST", "/v1/load_lora_adapter", load_lora_adapter, PlainTextResponse),
    Route("POST", "/v1/unload_lora_adapter", unload_lora_adapter, PlainTextResponse),
)
"""The runtime routes, added only with --enable-lora-runtime-updates (a malformed body
is a 400 too)."""
