"""``/vectors``: insert or replace, read back, delete."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor
from starlette.responses import Response

from gmmlsh.core.validate import VectorError
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.service import arrow_rows
from gmmlsh.service.deps import IndexDep, MetricsDep, SettingsDep
from gmmlsh.service.errors import ApiError, ORJSONResponse, responses
from gmmlsh.service.parsing import media_type, parse_body, request_field
from gmmlsh.service.schemas import UPSERT_BODY, DeleteResponse, UpsertResponse, VectorBatch, VectorOut
from gmmlsh.service.settings import Settings


class _AnyPath(Convertor):
    """Starlette's ``path`` convertor, matching newlines too: an id the API stores
    (``"a\\nb"`` is valid JSON) must be addressable as ``/vectors/a%0Ab``."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("anypath", _AnyPath())

router = APIRouter(tags=["vectors"])

_EXAMPLES = {
    "batch": {"value": {"vectors": [
        {"id": "a", "values": [0.5, -1.0, 0.0, 2.0], "metadata": {"label": 3}},
        {"id": "b", "indices": [0, 3], "values": [1.0, 0.25]}]}},
    "single": {"value": {"id": "c", "values": [0.1, 0.2, 0.3, 0.4]}},
}


@router.post(
    "/vectors", response_model=UpsertResponse,
    summary="Insert or replace vectors (one, or a batch)",
    description="Upsert by id: an existing id is replaced (`replaced` counts them). A batch is validated as "
    "a whole first and written atomically: if any vector is bad (wrong dimension, NaN/inf, all zeros, "
    "unsorted/duplicate/out-of-range indices) nothing is written and the 422 names it (e.g. "
    "`vectors[3].indices`). An id given twice in a batch is written once, with its last vector, and "
    "counted once. Dense vectors give `values`; sparse ones `indices` (strictly increasing) + `values`. "
    f"Binary: with `Content-Type: {arrow_rows.MEDIA}` the body is an uncompressed Arrow IPC stream with "
    "columns `id` (string or integer), `values` (a list of numbers a row), optionally `indices` (a list of "
    "integers, null for a dense row) and `metadata` (a JSON object as a string, or null): the same batch "
    "without spelling each number in decimal.",
    responses=responses(401, 408, 413, 422, 500, 503, 507),
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/UpsertRequest"}, "examples": _EXAMPLES},
        arrow_rows.MEDIA: {"schema": {"type": "string", "format": "binary"}}}}},
)
async def upsert_vectors(request: Request, index: IndexDep, settings: SettingsDep, metrics: MetricsDep) -> Response:
    out = await run_in_threadpool(upsert, index, settings, await request.body(), media_type(request))
    metrics.upserted.inc(out["upserted"])
    return ORJSONResponse(out)


@router.get("/vectors/{id:anypath}", response_model=VectorOut, summary="Read a stored vector back",
            description="In the shape it was given in: dense `values`, or sparse `indices` + `values` "
            "(float32, the stored precision).", responses=responses(401, 404, 422, 500, 503))
async def get_vector(id: str, index: IndexDep) -> Response:
    return ORJSONResponse(await run_in_threadpool(read_back, index, id))


@router.delete("/vectors/{id:anypath}", response_model=DeleteResponse,
               summary="Delete a vector everywhere (404 if unknown)", responses=responses(401, 404, 422, 500, 503))
async def delete_vector(id: str, index: IndexDep, metrics: MetricsDep) -> Response:
    out = await run_in_threadpool(delete, index, id)
    metrics.deleted.inc(out["deleted"])
    return ORJSONResponse(out)


# --- the blocking work --------------------------------------------------------------------


def upsert(index: Index, settings: Settings, body: bytes, media: str = "application/json") -> dict:
    """Parse (JSON, or an Arrow stream: :mod:`gmmlsh.service.arrow_rows`), then hand the rows to
    the index (it validates and hashes them, each stored in the shape it was sent in) and write
    them in one all-or-nothing batch."""
    if media == arrow_rows.MEDIA:
        table = arrow_rows.read_table(body)
        _check_count(table.num_rows, settings)
        ids, rows, meta = arrow_rows.rows_of(table)
        batch = True
    else:
        parsed = parse_body(UPSERT_BODY, body)
        batch = isinstance(parsed, VectorBatch)
        vectors = parsed.vectors if batch else [parsed]
        _check_count(len(vectors), settings)
        ids = [v.id for v in vectors]
        rows = [(v.indices, v.values) if v.indices is not None else v.values for v in vectors]
        meta = [v.metadata for v in vectors]
    for i, m in enumerate(meta or ()):
        if m is not None:
            _check_metadata(m, settings.max_metadata_bytes, f"vectors[{i}].metadata" if batch else "metadata")
    try:
        given = meta if meta is not None and any(m is not None for m in meta) else None
        prepared = index.prepare_rows(ids, rows, given)
    except VectorError as exc:
        raise type(exc)(request_field(exc, batch), exc.reason) from None
    written = index.write(prepared)
    return {"upserted": written.vectors, "replaced": written.replaced, "count": int(index.count())}


def _check_count(n: int, settings: Settings) -> None:
    if n == 0:
        raise ApiError(422, "no vectors: a batch holds at least one", field="vectors")
    if n > settings.max_batch:
        raise ApiError(413, f"{n} vectors in one request; the limit is {settings.max_batch} (max_batch)",
                       field="vectors")


def _check_metadata(meta: dict, limit: int, field: str) -> None:
    """Metadata comes back with every hit, so its size is capped; NaN/Infinity (which the
    body parser lets through) would be stored as null: refused instead."""
    try:
        size = len(orjson.dumps(meta))
    except TypeError as exc:  # e.g. an integer beyond 64 bits
        raise ApiError(422, f"not storable as JSON ({exc})", field=field) from None
    if size > limit:
        raise ApiError(422, f"{size} bytes as JSON; the limit is {limit} (max_metadata_bytes)", field=field)
    stack: list[Any] = [meta]
    while stack:
        x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            raise ApiError(422, f"{x} is not a JSON number", field=field)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def read_back(index: Index, ext_id: str) -> dict:
    sv = index.get(ext_id)
    out: dict[str, Any] = {"id": sv.id}
    if sv.indices is not None:
        out["indices"] = np.ascontiguousarray(sv.indices)
    out["values"] = np.ascontiguousarray(sv.values)
    out["metadata"] = sv.metadata
    return out


def delete(index: Index, ext_id: str) -> dict:
    if index.delete([ext_id]) == 0:
        raise UnknownIdError(ext_id)
    return {"deleted": 1, "count": int(index.count())}
