"""Request-body size cap (Starlette has none: an unbounded POST would be read into memory).

A declared ``Content-Length`` over the cap is refused before a byte of the body is
read; a body without one (chunked) is counted as it streams and refused as soon as
it passes the cap. Both answer 413 in the service's error shape.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_response


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` mid-stream; the HTTPException handler turns it into a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes (max_body_bytes)")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    response = error_response(400, "invalid Content-Length header",
                                              field="Content-Length")
                    await response(scope, receive, send)
                    return
                if declared > self.max_bytes:
                    # Connection: close, since the unread body is still on the wire.
                    response = error_response(
                        413, f"request body of {declared} bytes is over the limit of "
                        f"{self.max_bytes} bytes (max_body_bytes)",
                        headers={"Connection": "close"},
                    )
                    await response(scope, receive, send)
                    return
                break
        seen = 0
        limit = self.max_bytes

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)
