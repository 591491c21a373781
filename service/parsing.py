"""Request bodies from bytes, and the field paths errors name.

Bodies are parsed in a worker thread (``TypeAdapter.validate_json``: one pass from
bytes) so a 64 MiB batch never blocks the event loop; a 422 never echoes the input.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from gmmlsh.core.validate import VectorError


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


def reprefix(exc: VectorError, prefix: str) -> VectorError:
    """The index names a field as the library sees it (``vectors[3]``, ``vector``); name it
    as the client sent it (``vectors[3].values``, ``queries[1].values``)."""
    field = exc.field
    if field.startswith("vectors[") and "]" in field and not prefix:
        return type(exc)(field + ".values", exc.reason)
    if field in ("vector", "vectors[0]"):
        field = "values"
    if prefix and not field.startswith(prefix):
        field = prefix + field
    return type(exc)(field, exc.reason)


_ROW_FIELD = re.compile(r"^(vectors|ids|metadata)\[(\d+)\](.*)$")
_ATTR = {"vectors": "values", "ids": "id", "metadata": "metadata"}


def request_field(field: str, batch: bool) -> str:
    """An index field of a write (``vectors[3]``, ``ids[3]``, ``metadata[3]``) as the request
    names it: ``vectors[3].values`` in a batch, ``values`` for a single vector."""
    m = _ROW_FIELD.match(field)
    if m is None:
        return field
    kind, row, rest = m.groups()
    name = _ATTR[kind] + rest
    return f"vectors[{row}].{name}" if batch else name
