"""The HTTP/1.1 connection protocol `treadle serve` runs under uvicorn: h11, with the
request head bounded.

uvicorn answers a request head that overflows h11's buffer with a plain-text 400 (or,
under load, the client saw a TCP reset), where HTTP names the case 431 Request Header
Fields Too Large. `bounded_head_protocol(max_bytes)` makes uvicorn's h11 protocol answer a
head (request line and headers) over `max_bytes` with a 431 in the OpenAI error shape, and
close. Everything else is uvicorn's. It knows nothing of routes or the engine.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from treadle.server.errors import error_body

_END_OF_HEAD = b"\r\n\r\n"


class BoundedHeadH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, counting the bytes of each request head it receives."""

    max_head_bytes = 64 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._tail = b""

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # between requests: this is a head
            window = self._tail + data
            end = window.find(_END_OF_HEAD)
            head_part = len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            self._head_bytes += head_part
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()
                return
            self._tail = window[-3:] if end < 0 else b""
            if end >= 0:
                self._head_bytes = 0
        else:
            self._head_bytes, self._tail = 0, b""
        super().data_received(data)

    def _refuse_head(self) -> None:
        body = json.dumps(error_body(
            431, f"the request head exceeds {self.max_head_bytes} bytes (max_header_bytes)",
            kind="invalid_request_error")).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body)
        self.transport.close()


def bounded_head_protocol(max_bytes: int) -> type[BoundedHeadH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...) for heads of at most max_bytes."""
    return type("BoundedHeadH11Protocol", (BoundedHeadH11Protocol,),
                {"max_head_bytes": max_bytes})
