"""LoRA adapters over HTTP: which model a request names, what /v1/models lists, and vLLM's
runtime routes POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns the mapping from a request's `model` field to the base model or one of the engine's
adapters (engine/lora_registry.py), under the caller's key: a key limited to some models
(keys file field `models`, server/auth.py) sees only those in /v1/models, and any other
name, another tenant's adapter included, is the same 404 as a name that does not exist
(no oracle for which adapters exist). The runtime routes exist only with
`--enable-lora-runtime-updates`, take vLLM's bodies (closed: an unknown key is a 400) and
answer as vLLM does (plain-text success, OpenAI-style errors; a taken name is a 409 and a
path with no adapter a 404, where vLLM answers 400 for both); a key limited to some models
may not load or unload.
Loading checks the adapter's files against the model (treadle/lora.py) off the event
loop; the worker reads its weights when a step first needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from treadle.lora import LoRAError, LoRARequest
from treadle.server.auth import Tenant
from treadle.server.errors import error_response


class UnknownModel(LookupError):
    """The model a request names does not exist for its key."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} does not exist; GET /v1/models lists the models "
                         "this key may use")


def resolve_model(engine, tenant: Tenant, name: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model, also when no model is
    given); UnknownModel when the name is neither, or not this key's."""
    base = engine.model_name
    if name is None or name == base:
        if not tenant.may_use(base):
            raise UnknownModel(base)
        return None
    lora = engine.get_lora(name) if engine.lora_enabled else None
    if lora is None or not tenant.may_use(name):
        raise UnknownModel(name)
    return lora


def model_cards(engine, tenant: Tenant, created: int, max_model_len: int,
                vocab_size: int) -> list[dict]:
    """/v1/models entries this key may see: the base model, then each adapter with the
    base as its parent (vLLM's fields)."""
    base = engine.model_name
    cards = []
    if tenant.may_use(base):
        cards.append({"id": base, "object": "model", "created": created, "owned_by": "treadle",
                      "root": str(engine.model_dir), "parent": None,
                      "max_model_len": max_model_len, "vocab_size": vocab_size})
    if engine.lora_enabled:
        for lora in engine.list_loras():
            if tenant.may_use(lora.lora_name):
                cards.append({"id": lora.lora_name, "object": "model", "created": created,
                              "owned_by": "treadle", "root": lora.lora_path, "parent": base,
                              "max_model_len": max_model_len, "vocab_size": vocab_size})
    return cards


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


def lora_router(engine, authorize: Callable[[Request], Tenant]) -> APIRouter:
    """The runtime load / unload routes (`authorize`: the caller's Tenant, or an APIError).
    Statuses: 200 plain text; 400 an adapter that does not fit the model (the message
    names what) or a malformed body; 403 a key limited to some models; 404 no adapter at
    the path (load) or of that name (unload); 409 the name is taken (load without
    load_inplace)."""
    router = APIRouter()

    def forbidden(tenant: Tenant) -> JSONResponse | None:
        if tenant.models is None:
            return None
        return error_response(403, "this API key is limited to some models and may not "
                              "load or unload adapters", None, "permission_error")

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        tenant = authorize(request)
        refused = forbidden(tenant)
        if refused is not None:
            return refused
        name = body.lora_name
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

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        tenant = authorize(request)
        name = body.lora_name
        lora = engine.get_lora(name)
        if lora is None or not tenant.may_use(name) or (
                body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
            return _not_found(name)
        refused = forbidden(tenant)
        if refused is not None:
            return refused
        engine.remove_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
