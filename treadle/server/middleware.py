"""ASGI middleware that runs before any route reads a body: authentication, body size.

Owns the two checks every request passes first, in this order: the API key (a 401 for
every path but /health and /metrics, before the body is even read, so a keyless caller
learns nothing about validation), then the body size (a 413 whether the size was
declared in Content-Length or only found while reading a chunked body). The tenant of
the key is left in `request.state.tenant` for the routes, the key's Tenant (with the
models it may use) in `request.state.key`. GETs under /dashboard also take the key as
the password of HTTP Basic auth, and their 401 asks for it, so that a browser prompts
once and its page's EventSource is let in; Basic is accepted nowhere else (a browser
sends cached Basic credentials on its own, which must never authorize a cross-site POST
to /v1). Pure ASGI: no engine.
"""

from __future__ import annotations

import base64
import binascii
import json

from treadle.server.auth import AuthError, KeyRing
from treadle.server.errors import error_body

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Paths served without a key (probes and scrapers)."""
DASHBOARD_PREFIX = "/dashboard"
_BASIC_CHALLENGE = b'Basic realm="treadle dashboard", charset="UTF-8"'


def _is_dashboard(scope) -> bool:
    path = scope.get("path") or ""
    return path == DASHBOARD_PREFIX or path.startswith(DASHBOARD_PREFIX + "/")


def _basic_as_bearer(header: str) -> str:
    """'Basic base64(user:key)' -> 'Bearer key' (the user name is ignored)."""
    try:
        decoded = base64.b64decode(header[len("Basic "):].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise AuthError("malformed Basic credentials") from None
    _, sep, key = decoded.partition(":")
    if not sep:
        raise AuthError("malformed Basic credentials: expected user:key")
    return f"Bearer {key}"


async def _send_error(send, status: int, message: str, kind: str | None = None,
                      headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message, kind=kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class AuthFirst:
    """Refuse a request without a valid key (401) before anything else looks at it."""

    def __init__(self, app, keyring: KeyRing) -> None:
        self.app, self.keyring = app, keyring

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if scope.get("path") in OPEN_PATHS:
            state["tenant"] = state["key"] = None
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or {}).get(b"authorization")
        dashboard = _is_dashboard(scope) and scope.get("method") in ("GET", "HEAD")
        try:
            text = header.decode("latin-1") if header is not None else None
            if dashboard and text is not None and text.startswith("Basic "):
                text = _basic_as_bearer(text)
            tenant = self.keyring.authenticate(text)
        except AuthError as exc:
            challenges = [(b"www-authenticate", b"Bearer")]
            if dashboard:
                challenges.append((b"www-authenticate", _BASIC_CHALLENGE))
            return await _send_error(send, 401, str(exc), "authentication_error", challenges)
        state["tenant"], state["key"] = tenant.name, tenant
        return await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuse bodies over the limit with 413: at once when Content-Length says so, else as
    soon as the chunks read so far pass it (the route's own answer is then dropped)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes (max_request_body_bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, 413, self._message())
        seen, exceeded, started = 0, False, False

        async def limited_receive():
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise _TooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if exceeded:  # whatever the route made of a truncated body is not the answer
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _TooLarge:
            pass
        if exceeded and not started:
            await _send_error(send, 413, self._message())
