"""Request bodies from bytes, and the field paths errors name.

Bodies are parsed in a worker thread (``TypeAdapter.validate_json``: one pass from
bytes) so a 64 MiB batch never blocks the event loop; a 422 never echoes the input.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError


def parse_body(adapter: TypeAdapter, body: bytes) -> Any:
    """Bytes → model in one pass; errors become the usual 422 (input never echoed)."""
    if not body.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "a JSON body is required"}])
    try:
        return adapter.validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(located(exc, "body")) from None


def located(exc: ValidationError, where: str) -> list[dict]:
    """Pydantic's errors with their location under ``where`` (body, query), inputs dropped."""
    errors = exc.errors(include_url=False, include_input=False, include_context=True)
    for e in errors:
        e["loc"] = (where, *e["loc"])
    return errors


_ROW_FIELD = re.compile(r"^(vectors|ids|metadata)\[(\d+)\](.*)$")
_ATTR = {"vectors": "values", "ids": "id", "metadata": "metadata"}


def request_field(field: str, batch: bool, rows: list[int] | None = None) -> str:
    """An index field of a write (``vectors[3]``, ``ids[3]``, ``metadata[3]``, ``vectors[3].indices``)
    as the request names it: ``vectors[3].values`` in a batch, ``values`` for a single vector.
    ``rows``: the request position of each row the index was given (when given a part)."""
    m = _ROW_FIELD.match(field)
    if m is None:
        return field
    kind, row, rest = m.groups()
    name = rest[1:] if kind == "vectors" and rest.startswith(".") else _ATTR[kind] + rest
    pos = rows[int(row)] if rows is not None else int(row)
    return f"vectors[{pos}].{name}" if batch else name
