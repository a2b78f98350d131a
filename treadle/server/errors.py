"""Error answers in the OpenAI shape (and Anthropic's under /v1/messages), for every way
a request can fail.

Owns `APIError`, the one error body (`{"error": {"message", "type", "param", "code"}}`,
`param` naming a body field or null, never a character offset), Anthropic's shape of it
for the Messages API's paths (`{"type": "error", "error": {"type", "message"}}`, the type
from the status as Anthropic names it: `error_body_for`), and the exception handlers
that turn validation errors, unparseable bodies (invalid JSON or UTF-8, nesting too
deep), unknown routes and methods, and unexpected failures into that body. It does not
decide which requests are valid: protocol.py and validation.py do.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

logger = logging.getLogger(__name__)

_KIND_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


MAX_ECHO_CHARS = 64
"""Longest piece of a request (an id, a name) an error message quotes back."""
MAX_MESSAGE_CHARS = 2000
"""Longest error message answered; past it the message is cut (whatever it quotes)."""


def quoted(value: object) -> str:
    """`value` as an error message quotes it: repr, at most MAX_ECHO_CHARS of it (a 404
    once echoed a 50 KB request id back)."""
    text = repr(value)
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return f"{text[:MAX_ECHO_CHARS]}... ({len(str(value))} characters)"


def error_body(status: int, message: str, param: str | None = None,
               kind: str | None = None) -> dict:
    kind = kind or _KIND_OF_STATUS.get(status, "server_error" if status >= 500
                                       else "invalid_request_error")
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    if param is not None and len(param) > MAX_ECHO_CHARS:
        param = param[:MAX_ECHO_CHARS] + "..."
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


ANTHROPIC_PREFIX = "/v1/messages"
"""The Messages API's paths: their errors are in Anthropic's shape."""
_ANTHROPIC_KIND_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                             403: "permission_error", 404: "not_found_error",
                             405: "invalid_request_error", 413: "request_too_large",
                             429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body; its type named from the status as Anthropic names them
    (5xx: api_error)."""
    kind = _ANTHROPIC_KIND_OF_STATUS.get(status, "api_error" if status >= 500
                                         else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_body_for(path: str, status: int, message: str, param: str | None = None,
                   kind: str | None = None) -> dict:
    """The error body for a request to `path`: Anthropic's under /v1/messages."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, kind)


def error_response(status: int, message: str, param: str | None = None,
                   kind: str | None = None, headers: dict | None = None,
                   path: str = "") -> JSONResponse:
    return JSONResponse(error_body_for(path, status, message, param, kind),
                        status_code=status, headers=headers)


_FIELD_PREFIX = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


def error_field(message: str, default: str = "prompt") -> str:
    """The field an engine-side error message names first ("response_format.json_schema.
    schema: the grammar failed ..."), else `default`."""
    match = _FIELD_PREFIX.match(message)
    return match.group(1) if match else default


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[A-Za-z_][A-Za-z0-9_]*\])*\Z")
"""A field name, or a form field's bracketed one ("expires_after[seconds]")."""
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple", "set"}


def field_of(loc) -> str | None:
    """The dotted field path of a pydantic error location ("messages.0.content"), without
    the "body" root, pydantic's union-member tags ("str", "list[int]", ...) and dict keys."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif part == "body" and not parts:
            continue
        elif (isinstance(part, str) and _IDENTIFIER.match(part)
              and part.split("[")[0] not in _TYPE_TAGS):  # "list[TextPart]" is a union tag
            parts.append(part)
        elif isinstance(part, str) and part == "[key]":
            break
    return ".".join(parts) or None


def _most_specific(errors: list[dict]) -> dict:
    """Of a union's alternatives the error that got furthest into the input (the deepest
    location) says best what is wrong; ties keep pydantic's order."""
    return max(errors, key=lambda e: len(e.get("loc", ())))


def validation_error_response(exc: RequestValidationError, path: str = "") -> JSONResponse:
    status, message, field = validation_error(exc)
    return error_response(status, message, field, path=path)


def validation_error(exc: RequestValidationError) -> tuple[int, str, str | None]:
    """(status, message, field) of a body that did not validate."""
    errors = list(exc.errors())
    if not errors:
        return 400, "invalid request body", None
    first = errors[0] if errors[0].get("type") == "json_invalid" else _most_specific(errors)
    ctx = first.get("ctx") or {}
    if first.get("type") == "json_invalid":
        offset = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        where = f" (character {offset})" if offset is not None else ""
        return 400, f"body is not valid JSON: {ctx.get('error', 'decode error')}{where}", None
    field = field_of(first.get("loc", ()))
    inner = ctx.get("field")  # set by protocol.py's own errors on a whole model
    if inner:
        field = f"{field}.{inner}" if field else inner
    message = first.get("msg", "invalid value")
    if field is None and first.get("type") == "missing":
        return 400, "a JSON body is required", None
    if field is None and first.get("type") in ("model_attributes_type", "dict_type",
                                               "model_type"):
        return 400, "the body must be a JSON object (Content-Type: application/json)", None
    return 400, f"{field or 'body'}: {message}", field


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route of the app answers at the request's path."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        probe = getattr(route, "methods", None)
        if match != Match.NONE and probe:
            methods.update(probe)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers with an OpenAI error body (Anthropic's under /v1/messages)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind, exc.headers,
                              request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return validation_error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            return error_response(405, str(exc.detail), path=path,
                                  headers={"Allow": ", ".join(allowed_methods(app, request))})
        if exc.status_code == 400 and isinstance(exc.__cause__, (UnicodeDecodeError, ValueError)):
            message = "body is not valid UTF-8 JSON"  # FastAPI's "error parsing the body"
        elif exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            message = "body is nested too deeply to parse"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers, path=path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", kind="server_error",
                              path=request.url.path)
