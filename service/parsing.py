"""Request bodies from bytes, and the field paths errors name.

Bodies are parsed in a worker thread (``TypeAdapter.validate_json``: one pass from
bytes) so a 64 MiB batch never blocks the event loop; a 422 never echoes the input.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request

from gmmlsh.core.validate import VectorError


def parse_body(adapter: TypeAdapter, body: bytes) -> Any:
    """Bytes → model in one pass; errors become the usual 422 (input never echoed)."""
    if not body.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "a JSON body is required"}])
    try:
        return adapter.validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(located(exc, "body")) from None


def media_type(request: Request) -> str:
    """A request body's media type: lower case, parameters (``; charset=…``) dropped."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def located(exc: ValidationError, where: str) -> list[dict]:
    """Pydantic's errors with their location under ``where`` (body, query), inputs dropped."""
    errors = exc.errors(include_url=False, include_input=False, include_context=True)
    for e in errors:
        e["loc"] = (where, *e["loc"])
    return errors


def request_field(exc: VectorError, batch: bool) -> str:
    """The field of an index error about a row of a write (its ``row`` and ``part``) as the
    request names it: ``vectors[3].values`` in a batch, ``values`` for a single vector."""
    if exc.row is None or exc.part is None:
        return exc.field
    return f"vectors[{exc.row}].{exc.part}" if batch else exc.part
