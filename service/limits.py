"""Request-body size cap (Starlette has none: an unbounded POST would be read into memory),
and a deadline for receiving the body (a client trickling bytes must not hold a request,
and up to ``max_body_bytes`` of memory, forever).

A declared ``Content-Length`` over the cap is refused before a byte of the body is
read; a body without one (chunked) is counted as it streams and refused as soon as
it passes the cap. Both answer 413 in the service's error shape. A body still
incomplete ``timeout`` seconds after the request started answers 408. (Slow
*headers* are uvicorn's to bound: put a reverse proxy in front of a public server.)
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gmmlsh.service.errors import error_response


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` mid-stream; the HTTPException handler turns it into a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes (max_body_bytes)")


class BodyTimeout(HTTPException):
    """Raised from ``receive`` when the body is late; answered 408, connection closed."""

    def __init__(self, timeout: float):
        super().__init__(408, f"request body not received within {timeout:g} s (body_timeout)",
                         headers={"Connection": "close"})


def declared_refusal(scope: Scope, max_bytes: int) -> Response | None:
    """The answer to a request whose ``Content-Length`` is malformed (400) or over ``max_bytes``
    (413, closing the connection: the unread body is still on the wire); None to read on."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
            if declared < 0:
                return error_response(400, "invalid Content-Length header", field="Content-Length")
            if declared > max_bytes:
                return error_response(
                    413, f"request body of {declared} bytes is over the limit of {max_bytes} bytes "
                    "(max_body_bytes)", headers={"Connection": "close"})
            return None
    return None


def limited_receive(receive: Receive, max_bytes: int, timeout: float | None) -> Receive:
    """``receive`` that raises :class:`BodyTooLarge` once the body passes ``max_bytes`` and
    :class:`BodyTimeout` if it is still incomplete ``timeout`` seconds from now.

    The deadline is asyncio's own (``asyncio.timeout_at``: one timer), not an anyio cancel
    scope, which costs more a request (docs/tuning.md): the server runs on asyncio (uvloop) only."""
    seen = 0
    deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    done = False

    async def counting_receive() -> Message:
        nonlocal seen, done
        if done or deadline is None:  # after the body: e.g. waiting for a disconnect
            message = await receive()
        else:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(timeout) from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise BodyTooLarge(max_bytes)
            done = not message.get("more_body", False)
        return message

    return counting_receive


class BodyLimitMiddleware:
    """:func:`declared_refusal` and :func:`limited_receive` around every HTTP request of the
    full stack (the hot routes apply the same two themselves: :mod:`gmmlsh.service.hot`)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = declared_refusal(scope, self.max_bytes)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, limited_receive(receive, self.max_bytes, self.timeout), send)
