"""Request bodies read as RFC 8259 JSON, and nothing looser.

Python's `json` module, which FastAPI uses, reads more than JSON: a UTF-8 byte-order
mark, UTF-16 and UTF-32 bodies (it guesses the encoding), the literals `NaN`, `Infinity`
and `-Infinity`, and numbers of any length. OpenAI's API refuses all of them, and so
does this module: `loads_strict` raises `json.JSONDecodeError` naming what it found, which
the error handlers (server/errors.py) turn into a 400. `StrictJSONRoute` is the route
class of the app (server/api.py): every route that takes a JSON body reads it here. It
decides nothing about the body's fields (protocol.py does).
"""

from __future__ import annotations

import json
import math

from fastapi import Request
from fastapi.routing import APIRoute

MAX_NUMBER_CHARS = 64
"""Longest number literal accepted (a 64-bit integer has at most 20 characters)."""
_BOMS = {b"\xef\xbb\xbf": "UTF-8", b"\xff\xfe": "UTF-16 or UTF-32",
         b"\xfe\xff": "UTF-16", b"\x00\x00\xfe\xff": "UTF-32"}


def _fail(message: str, doc: str, pos: int = 0):
    raise json.JSONDecodeError(message, doc, pos)


def loads_strict(body: bytes):
    """The JSON value of `body`, which must be UTF-8 JSON text (RFC 8259 section 8.1)."""
    for bom, encoding in _BOMS.items():
        if body.startswith(bom):
            _fail(f"the body starts with a {encoding} byte-order mark; send UTF-8 without one",
                  "", 0)
    if b"\x00" in body[:4]:
        _fail("the body looks like UTF-16 or UTF-32 (NUL bytes); JSON must be UTF-8", "", 0)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(f"the body is not UTF-8 (byte {exc.start}); JSON must be UTF-8", "", exc.start)

    def constant(name: str):
        _fail(f"{name} is not a JSON value (RFC 8259 has no NaN or Infinity)", text,
              text.find(name))

    def number(literal: str, convert):
        if len(literal) > MAX_NUMBER_CHARS:
            _fail(f"a number of {len(literal)} characters; at most {MAX_NUMBER_CHARS}", text,
                  text.find(literal))
        value = convert(literal)
        if isinstance(value, float) and not math.isfinite(value):
            _fail(f"the number {literal} is out of range", text, text.find(literal))
        return value

    return json.loads(text, parse_constant=constant,
                      parse_int=lambda s: number(s, int),
                      parse_float=lambda s: number(s, float))


class StrictJSONRequest(Request):
    """A request whose JSON body is read by `loads_strict`."""

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """The app's route class: its handlers see a StrictJSONRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))
        return strict
