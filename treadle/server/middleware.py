"""ASGI middleware that runs before any route reads a body: authentication, the body.

Owns the checks every request passes first, in this order: the API key (a Bearer
token, or an `x-api-key` header as Anthropic's clients send it; a 401 for
every path but /health and /metrics, before the body is even read, so a keyless caller
learns nothing about validation), then the body: its size (a 413 whether the size was
declared in Content-Length or only found while reading a chunked body) and its arrival
(a 408 when it stops arriving for body_read_timeout_s). The tenant of
the key is left in `request.state.tenant` for the routes, the key's Tenant (with the
models it may use) in `request.state.key`. GETs under /dashboard also take the key as
the password of HTTP Basic auth, and their 401 asks for it, so that a browser prompts
once and its page's EventSource is let in; Basic is accepted nowhere else (a browser
sends cached Basic credentials on its own, which must never authorize a cross-site POST
to /v1). Errors under /v1/messages are in Anthropic's shape (server/errors.py). Pure
ASGI: no engine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json

from treadle.server.auth import AuthError, KeyRing
from treadle.server.errors import error_body_for

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


async def _send_error(scope, send, status: int, message: str, kind: str | None = None,
                      headers: list | None = None) -> None:
    body = json.dumps(error_body_for(scope.get("path") or "", status, message,
                                     kind=kind)).encode()
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
        headers = dict(scope.get("headers") or {})
        header, api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        dashboard = _is_dashboard(scope) and scope.get("method") in ("GET", "HEAD")
        try:
            text = header.decode("latin-1") if header is not None else None
            if dashboard and text is not None and text.startswith("Basic "):
                text = _basic_as_bearer(text)
            tenant = self.keyring.authenticate(
                text, api_key.decode("latin-1") if api_key is not None else None)
        except AuthError as exc:
            challenges = [(b"www-authenticate", b"Bearer")]
            if dashboard:
                challenges.append((b"www-authenticate", _BASIC_CHALLENGE))
            return await _send_error(scope, send, 401, str(exc), "authentication_error",
                                     challenges)
        state["tenant"], state["key"] = tenant.name, tenant
        return await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


class BodyLimits:
    """Refuse bodies over the size limit with 413: at once when Content-Length says so,
    else as soon as the chunks read so far pass it; and bodies that stop arriving with
    408 (a body shorter than its Content-Length once held the connection open for good).
    In both cases the route's own answer is dropped."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float,
                 larger: dict[str, tuple[int, str]] | None = None) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s
        self.larger = larger or {}
        """Paths with their own limit: path -> (bytes, the option that sets it)."""

    def _message(self, limit: int, option: str) -> str:
        return f"request body exceeds {limit} bytes ({option})"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, option = self.larger.get(scope.get("path"),
                                        (self.max_bytes, "max_request_body_bytes"))
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_error(scope, send, 413, self._message(limit, option))
        seen, refused, started, done = 0, None, False, False

        async def limited_receive():
            nonlocal seen, refused, done
            if done:  # the body is read: what follows is the disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                refused = 408
                raise _TooSlow() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if seen > limit:
                    refused = 413
                    raise _TooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:  # whatever the route made of a truncated body is not the answer
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except (_TooLarge, _TooSlow):
            pass
        if refused == 413 and not started:
            await _send_error(scope, send, 413, self._message(limit, option))
        elif refused == 408 and not started:
            await _send_error(scope, send, 408, f"the request body did not arrive within "
                                                f"{self.read_timeout_s:g} s (body_read_timeout_s)",
                              headers=[(b"connection", b"close")])
