"""The Batch API's routes: /v1/files and /v1/batches, as OpenAI defines them (thin).

Owns `BatchService` (one server's store and runner, or why the API is unavailable: the
state directory held by another server) and the routes: upload (multipart `file`,
`purpose`, optional `expires_after[anchor]` and `expires_after[seconds]`), list (cursor
pages: `after`, `limit`, `has_more`), retrieve, delete and read files; create (with
`output_expires_after`), retrieve, list and cancel batches. Each route parses, asks the store
(treadle/batch/store.py, in a thread) and answers; the caller's tenant comes from its key
(server/auth.py) and scopes every look-up, so another tenant's id is a 404 like an
unknown one. The runner (treadle/batch/runner.py) starts with the app and stops before
the engine; the lines themselves run through server/batch_lines.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal, Optional

from fastapi import FastAPI, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from treadle.batch.config import WINDOW_PATTERN, BatchConfig, window_seconds
from treadle.batch.runner import BatchRunner
from treadle.batch.store import BatchRequestError, BatchStore, StateDirInUse
from treadle.server.batch_lines import BATCH_ENDPOINTS, ServingLineExecutor
from treadle.server.errors import APIError
from treadle.server.protocol import integral_floats_as_ints
from treadle.server.routes import Route, add_routes
from treadle.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

MAX_METADATA_PAIRS = 16
MULTIPART_SLACK_BYTES = 1 << 20
"""What an upload's body may hold besides the file (boundaries, part headers, purpose)."""


ExpirySeconds = Annotated[int, Field(ge=3600, le=2_592_000)]
"""OpenAI's bounds of a file's lifetime: an hour to 30 days."""


class UploadForm(BaseModel):
    """POST /v1/files (multipart/form-data); an unknown field is a 400 naming it. The
    optional fields default to None without admitting null (a form has no null)."""

    model_config = ConfigDict(extra="forbid")
    file: UploadFile
    purpose: Literal["batch"]
    expires_after_anchor: Literal["created_at"] = Field(
        default=None, alias="expires_after[anchor]")
    expires_after_seconds: ExpirySeconds = Field(
        default=None, alias="expires_after[seconds]",
        description="the file is deleted this many seconds after its creation")


_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"$ref": "#/components/schemas/UploadForm"}}}}}


class _JSONModel(BaseModel):
    """A closed, strict JSON body; 2.0 is the integer 2, as in JSON Schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data):
        return integral_floats_as_ints(data)


class ExpiresAfter(_JSONModel):
    anchor: Literal["created_at"]
    seconds: ExpirySeconds


class CreateBatchRequest(_JSONModel):
    """POST /v1/batches (an unknown field is a 400 naming it)."""
    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Literal[tuple(BATCH_ENDPOINTS)]  # type: ignore[valid-type]
    completion_window: str = Field(pattern=WINDOW_PATTERN, description=(
        "OpenAI's '24h', or any whole number of seconds, minutes or hours ('90m', '3600s')"))
    metadata: Optional[dict[Annotated[str, Field(max_length=64)],
                            Annotated[str, Field(max_length=512)]]] = Field(
        default=None, max_length=MAX_METADATA_PAIRS)
    output_expires_after: Optional[ExpiresAfter] = Field(default=None, description=(
        "the output and error files are deleted this long after they are made"))


class BatchService:
    """One server's Batch API: its store and runner, or the reason it has none."""

    def __init__(self, serving: OpenAIServing, config: BatchConfig) -> None:
        self.serving, self.config = serving, config
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self.unavailable: str | None = None
        try:
            self.store = BatchStore(config.state_path)
        except (StateDirInUse, OSError) as exc:
            self.unavailable = str(exc)
            logger.warning("the Batch API is off: %s", exc)
            return
        engines = len(getattr(serving.engine, "replicas", None) or [None])  # replicas on Ray
        window = config.window(serving.engine.config.scheduler.max_num_seqs * engines)
        self.runner = BatchRunner(self.store, ServingLineExecutor(serving), window,
                                  config.batch_max_lines, paused=self._paused)
        logger.info("Batch API: state in %s; up to %d lines in flight", self.store.root, window)

    def _paused(self) -> bool:
        return self.serving.shutting_down or not self.serving.engine.is_alive

    async def startup(self) -> None:
        if self.runner is not None:
            self.runner.start()

    async def shutdown(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.store.close()

    async def call(self, request: Request, method: str, *args):
        """(tenant, the store's `method` for it) in a thread; BatchRequestError -> APIError."""
        if self.store is None:
            raise APIError(503, f"the Batch API is not available: {self.unavailable}",
                           kind="server_error")
        tenant = self.serving.authorize(request)
        try:
            return await asyncio.to_thread(getattr(self.store, method), tenant.name, *args)
        except BatchRequestError as exc:
            raise APIError(exc.status, exc.message, exc.param,
                           kind="rate_limit_error" if exc.status == 429
                           else "invalid_request_error") from None


def _service(request: Request) -> BatchService:
    return request.app.state.batch


def _not_found(what: str, param: str, value: str) -> APIError:
    return APIError(404, f"{param}: no {what} {value!r}", param, kind="not_found_error")


def _page(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


# ----- files ------------------------------------------------------------------------------

async def upload_file(form: Annotated[UploadForm, Form()], request: Request):
    service = _service(request)
    config = service.config
    return await service.call(request, "add_file", form.file.filename or "upload.jsonl",
                              form.purpose, form.file.file, config.batch_max_file_bytes,
                              config.batch_max_lines, form.expires_after_seconds)


async def list_files(request: Request, purpose: Optional[str] = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     order: Literal["asc", "desc"] = "desc", after: Optional[str] = None):
    files, has_more = await _service(request).call(request, "list_files", purpose, after,
                                                   limit, order)
    return _page(files, has_more)


async def retrieve_file(file_id: str, request: Request):
    found = await _service(request).call(request, "get_file", file_id)
    if found is None:
        raise _not_found("file", "file_id", file_id)
    return found


async def delete_file(file_id: str, request: Request):
    if not await _service(request).call(request, "delete_file", file_id):
        raise _not_found("file", "file_id", file_id)
    return {"id": file_id, "object": "file", "deleted": True}


async def file_content(file_id: str, request: Request):
    path = await _service(request).call(request, "file_path", file_id)
    if path is None or not path.exists():
        raise _not_found("file", "file_id", file_id)
    return FileResponse(path, media_type="application/octet-stream")


# ----- batches ----------------------------------------------------------------------------

async def create_batch(body: CreateBatchRequest, request: Request):
    service = _service(request)
    models = service.serving.authorize(request).models
    batch = await service.call(request, "create_batch",
                               None if models is None else sorted(models), body.input_file_id,
                               body.endpoint, body.completion_window,
                               window_seconds(body.completion_window), body.metadata,
                               service.config.batch_max_open_per_tenant,
                               body.output_expires_after and body.output_expires_after.seconds)
    service.runner.wake()
    return batch


async def retrieve_batch(batch_id: str, request: Request):
    found = await _service(request).call(request, "get_batch", batch_id)
    if found is None:
        raise _not_found("batch", "batch_id", batch_id)
    return found


async def list_batches(request: Request, after: Optional[str] = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20):
    batches, has_more = await _service(request).call(request, "list_batches", after, limit)
    return _page(batches, has_more)


async def cancel_batch(batch_id: str, request: Request):
    service = _service(request)
    found = await service.call(request, "cancel_batch", batch_id)
    if found is None:
        raise _not_found("batch", "batch_id", batch_id)
    service.runner.wake()
    return found


ROUTES = (
    Route("POST", "/v1/files", upload_file, openapi_extra=_UPLOAD_BODY),
    Route("GET", "/v1/files", list_files),
    Route("GET", "/v1/files/{file_id}", retrieve_file),
    Route("DELETE", "/v1/files/{file_id}", delete_file),
    Route("GET", "/v1/files/{file_id}/content", file_content, FileResponse),
    Route("POST", "/v1/batches", create_batch),
    Route("GET", "/v1/batches", list_batches),
    Route("GET", "/v1/batches/{batch_id}", retrieve_batch),
    Route("POST", "/v1/batches/{batch_id}/cancel", cancel_batch),
)


ROUTE_ERRORS = {
    ("/v1/files", "post"): (400, 413, 503),
    ("/v1/files", "get"): (400, 404, 503),
    ("/v1/files/{file_id}", "get"): (404, 503),
    ("/v1/files/{file_id}", "delete"): (404, 503),
    ("/v1/files/{file_id}/content", "get"): (404, 503),
    ("/v1/batches", "post"): (400, 404, 429, 503),
    ("/v1/batches", "get"): (400, 404, 503),
    ("/v1/batches/{batch_id}", "get"): (404, 503),
    ("/v1/batches/{batch_id}/cancel", "post"): (404, 409, 503),
}
"""Each route's error statuses, for the published schema (server/openapi.py)."""
OTHER_CONTENT = {"/v1/files/{file_id}/content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
"""The file content route answers bytes, not JSON."""


def install_batch_api(app: FastAPI, serving: OpenAIServing,
                      config: BatchConfig) -> dict[str, tuple[int, str]]:
    """Add the routes and the runner's start and stop; the larger body limit uploads
    need (path -> (bytes, the option that sets it)) for the size middleware."""
    service = BatchService(serving, config)
    app.state.batch = service
    add_routes(app, ROUTES)
    app.router.on_startup.append(service.startup)
    app.router.on_shutdown.append(service.shutdown)
    return {"/v1/files": (config.batch_max_file_bytes + MULTIPART_SLACK_BYTES,
                          "batch_max_file_bytes")}
