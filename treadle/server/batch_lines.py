"""One Batch API line run through the serving object, exactly as a live request would be.

Owns BATCH_ENDPOINTS, the endpoints a batch may target (URL -> the request body's model
and the endpoint function the live route calls: a new one is a line here), and
`ServingLineExecutor`, the runner's line executor (treadle/batch/runner.py). A line's
body is parsed by the same pydantic model as the live route's and handed to the same
endpoint function with the same serving object (server/serving.py), over a request that
has no socket: its tenant is the batch's owner, its band "batch" (the engine's lowest:
idle capacity only; the serving object also keeps batch lines out of the live overload
bounds), and its client "goes away" when the line is cut off (the batch cancelled or
expired, the server stopping), which aborts it in the engine before the next step, as a
live disconnect does. Every error is the body and status a live call would have had.
It stores nothing (the runner records outcomes).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from treadle.batch.lines import InputLine
from treadle.batch.runner import LineResult, Owner
from treadle.server import protocol, responses_api
from treadle.server.auth import Tenant
from treadle.server.chat import create_chat_completion
from treadle.server.completions import create_completion
from treadle.server.errors import APIError, error_body, validation_error_response
from treadle.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

BATCH_BAND = "batch"
"""The engine band batch lines ask for (the lowest: idle capacity only)."""

BATCH_ENDPOINTS = {
    "/v1/chat/completions": (protocol.ChatCompletionRequest, create_chat_completion),
    "/v1/completions": (protocol.CompletionRequest, create_completion),
    "/v1/responses": (responses_api.ResponsesRequest, responses_api.create_response),
}
"""The endpoints a batch may target: URL -> (body model, the live route's function)."""


def line_request(endpoint: str, owner: Owner, cut_off: asyncio.Event) -> Request:
    """A request with no socket, as the endpoint functions read one: the owner's tenant
    (set by the key middleware for a live call), the batch band, no headers; its client
    disconnects when `cut_off` is set."""
    async def receive() -> dict:
        await cut_off.wait()
        return {"type": "http.disconnect"}

    tenant = Tenant(owner.tenant, models=None if owner.models is None
                    else frozenset(owner.models))
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": endpoint, "raw_path": endpoint.encode(), "query_string": b"",
             "headers": [], "client": None, "server": None,
             "state": {"key": tenant, "tenant": tenant.name, "band": BATCH_BAND}}
    return Request(scope, receive)


def _error(status: int, message: str, param: str | None = None) -> LineResult:
    return LineResult(status, error_body(status, message, param))


class ServingLineExecutor:
    """Runs batch lines through `serving` (the LineExecutor of treadle/batch/runner.py)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def __call__(self, line: InputLine, owner: Owner,
                       cut_off: asyncio.Event) -> LineResult | None:
        if cut_off.is_set():
            return None
        body_model, run = BATCH_ENDPOINTS[line.url]
        limit = self.serving.config.max_request_body_bytes
        if len(line.body.encode("utf-8")) > limit:
            return _error(413, f"request body exceeds {limit} bytes (max_request_body_bytes)")
        data = json.loads(line.body)
        if data.get("stream"):
            return _error(400, "stream: a batch line is answered with one body; streaming is "
                          "not available in a batch", "stream")
        try:
            body = body_model.model_validate(data)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
            response = validation_error_response(RequestValidationError(errors))
            return LineResult(response.status_code, json.loads(response.body))
        try:
            answer = await run(self.serving, body, line_request(line.url, owner, cut_off))
        except APIError as exc:
            return LineResult(exc.status, error_body(exc.status, exc.message, exc.param,
                                                     exc.kind))
        except Exception as exc:  # what a live call would get: a 500, logged
            logger.exception("batch line %r failed", line.custom_id)
            return _error(500, f"internal error: {type(exc).__name__}")
        if isinstance(answer, Response):  # 499: cut off before its answer
            return None
        return LineResult(200, answer)
