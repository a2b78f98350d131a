"""LoRA adapters over HTTP: which model a request names, what /v1/models lists, and vLLM's
runtime routes POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns the mapping from a request's `model` field to the base model or one of the engine's
adapters (engine/lora_registry.py), under the caller's key: a key limited to some models
(keys file field `models`, server/auth.py) sees only those in /v1/models, and any other
name, another tenant's adapter included, is the same 404 as a name that does not exist
(no oracle for which adapters exist). The runtime routes exist only with
`--enable-lora-runtime-updates`, take vLLM's bodies and answer as vLLM does (plain-text
success, OpenAI-style errors); a key limited to some models may not load or unload.
Loading checks the adapter's files against the model (treadle/lora.py) off the event
loop; the worker reads its weights when a step first needs them.
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from treadle.lora import LoRAError, LoRARequest
from treadle.server.auth import Tenant


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


def model_cards(engine, tenant: Tenant, created: int, max_model_len: int) -> list[dict]:
    """/v1/models entries this key may see: the base model, then each adapter with the
    base as its parent (vLLM's fields)."""
    base = engine.model_name
    cards = []
    if tenant.may_use(base):
        cards.append({"id": base, "object": "model", "created": created, "owned_by": "treadle",
                      "root": str(engine.core.model_dir), "parent": None,
                      "max_model_len": max_model_len})
    if engine.lora_enabled:
        for lora in engine.list_loras():
            if tenant.may_use(lora.lora_name):
                cards.append({"id": lora.lora_name, "object": "model", "created": created,
                              "owned_by": "treadle", "root": lora.lora_path, "parent": base,
                              "max_model_len": max_model_len})
    return cards


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=512)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=512)
    lora_int_id: Optional[int] = None


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _not_found(name: str) -> JSONResponse:
    return _error(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                  "NotFoundError")


def lora_router(engine, authorize: Callable[[Request], Tenant]) -> APIRouter:
    """The runtime load / unload routes (`authorize`: the caller's Tenant, or an APIError)."""
    router = APIRouter()

    def forbidden(tenant: Tenant) -> JSONResponse | None:
        if tenant.models is None:
            return None
        return _error(403, "this API key is limited to some models and may not load or "
                      "unload adapters", None, "permission_error")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        tenant = authorize(request)
        refused = forbidden(tenant)
        if refused is not None:
            return refused
        if not engine.lora_enabled:
            return _error(400, "this server serves no adapters: start it with --enable-lora",
                          "lora_name")
        if body.load_inplace:
            return _error(400, "load_inplace is not supported: unload the adapter, then "
                          "load it (it gets a new id)", "load_inplace")
        name = body.lora_name
        if name == engine.model_name or engine.get_lora(name) is not None:
            return _error(400, f"The lora adapter '{name}' has already been loaded.",
                          "lora_name")
        try:
            await run_in_threadpool(engine.add_lora, name, body.lora_path)
        except (LoRAError, ValueError) as exc:
            return _error(400, str(exc), "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        tenant = authorize(request)
        name = body.lora_name
        lora = engine.get_lora(name) if engine.lora_enabled else None
        if lora is None or not tenant.may_use(name) or (
                body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
            return _not_found(name)
        refused = forbidden(tenant)
        if refused is not None:
            return refused
        engine.remove_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
