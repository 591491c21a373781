"""The HTTP/1.1 protocol the server speaks: uvicorn's httptools protocol, with a bounded head.

httptools parses in C where h11 parses in Python: less server CPU per request
(docs/tuning.md, "The HTTP server"). uvicorn bounds what h11 buffers
(``h11_max_incomplete_event_size``, 16 KiB) but not what httptools hands its callbacks: an
endless URL or header block would grow in memory. Here the request line and the headers
together are capped at :data:`MAX_HEAD_BYTES`, h11's default, so the ~16 KiB request line the
README and the API docs promise stays what it was: a longer request line answers 414, a
longer header block 431, in the API's error shape, and the connection is closed.
"""

from __future__ import annotations

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gmmlsh.service.errors import CODES

#: Bytes of a request's line and headers together.
MAX_HEAD_BYTES = 16 * 1024

_REASONS = {414: "URI Too Long", 431: "Request Header Fields Too Large"}


class _HeadTooLarge(Exception):
    """Raised from a parser callback: stops httptools mid-request."""


def head_refusal(status: int, what: str) -> bytes:
    """A whole answer, written by the protocol itself (the request never reaches the app)."""
    message = f"{what} over {MAX_HEAD_BYTES} bytes; send long vectors in a POST body (POST /neighbors/search)"
    body = orjson.dumps({"error": {"status": status, "code": CODES[status], "field": None, "message": message}})
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` refusing a request head over :data:`MAX_HEAD_BYTES`."""

    _head = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 414, "request line")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4, 431, "request headers")
        super().on_header(name, value)

    def _count(self, n: int, status: int, what: str) -> None:
        self._head += n
        if self._head > MAX_HEAD_BYTES:
            self.transport.write(head_refusal(status, what))
            self.transport.close()
            raise _HeadTooLarge  # httptools stops; uvicorn's own 400 is skipped below

    def send_400_response(self, msg: str) -> None:
        if not self.transport.is_closing():
            super().send_400_response(msg)
