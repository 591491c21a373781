"""The endpoints (DESIGN §3). Thin: each awaits one blocking call from :mod:`service.ops`
in the threadpool and wraps the result in an orjson response."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Query, Request
from gmmlsh.index.index import Index
from gmmlsh.service import ops
from gmmlsh.service.deps import get_index, get_metrics, get_settings, require_api_key
from gmmlsh.service.errors import ApiError, ORJSONResponse, responses
from gmmlsh.service.metrics import Metrics
from gmmlsh.service.schemas import (
    DeleteResponse,
    HealthResponse,
    Mode,
    NeighborsResponse,
    QueryParams,
    SearchBatchResponse,
    StatsResponse,
    UpsertResponse,
    VectorOut,
)
from gmmlsh.service.settings import Settings
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor
from starlette.responses import Response

#: Seconds /health waits for the store before answering 503.
HEALTH_TIMEOUT = 5.0

class _AnyPath(Convertor):
    """Starlette's ``path`` convertor, but matching newlines too: an id the API stores
    (``"a\nb"`` is valid JSON) must be addressable as ``/vectors/a%0Ab``."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("anypath", _AnyPath())

IndexDep = Annotated[Index, Depends(get_index)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]

public = APIRouter()
api = APIRouter(dependencies=[Depends(require_api_key)])


def _body(schema: str, examples: dict) -> dict:
    """``openapi_extra`` for a body the route parses itself (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}, "examples": examples}}}}


def _observe(metrics: Metrics, results) -> None:
    for r in results:
        metrics.candidates.labels(r.mode).observe(r.candidates)


# --- vectors --------------------------------------------------------------------------


@api.post(
    "/vectors", response_model=UpsertResponse, tags=["vectors"],
    summary="Insert or replace vectors (one, or a batch)",
    description="Upsert by id: an existing id is replaced, its old bucket entries removed. "
    "A batch is validated as a whole first and written atomically: if any vector is bad "
    "(wrong dimension, NaN/inf, all zeros, unsorted/duplicate/out-of-range indices) nothing "
    "is written and the 422 names it (e.g. `vectors[3].indices`). Dense vectors give "
    "`values`; sparse ones `indices` (strictly increasing) + `values`.",
    responses=responses(401, 408, 413, 422, 500, 503),
    openapi_extra=_body("UpsertRequest", {
        "batch": {"value": {"vectors": [
            {"id": "a", "values": [0.5, -1.0, 0.0, 2.0], "metadata": {"label": 3}},
            {"id": "b", "indices": [0, 3], "values": [1.0, 0.25]}]}},
        "single": {"value": {"id": "c", "values": [0.1, 0.2, 0.3, 0.4]}},
    }),
)
async def upsert_vectors(request: Request, index: IndexDep, settings: SettingsDep,
                         metrics: MetricsDep) -> Response:
    body = await request.body()
    out = await run_in_threadpool(ops.upsert, index, settings, body)
    metrics.upserted.inc(out["upserted"])
    return ORJSONResponse(out)


@api.get(
    "/vectors/{id:anypath}", response_model=VectorOut, tags=["vectors"],
    summary="Read a stored vector back",
    description="Values come back as stored (float32 for dense storage).",
    responses=responses(401, 404, 422, 500, 503),
)
async def get_vector(id: str, index: IndexDep) -> Response:
    return ORJSONResponse(await run_in_threadpool(ops.get_vector, index, id))


@api.delete(
    "/vectors/{id:anypath}", response_model=DeleteResponse, tags=["vectors"],
    summary="Delete a vector everywhere (404 if unknown)",
    responses=responses(401, 404, 422, 500, 503),
)
async def delete_vector(id: str, index: IndexDep, metrics: MetricsDep) -> Response:
    out = await run_in_threadpool(ops.delete_vector, index, id)
    metrics.deleted.inc(out["deleted"])
    return ORJSONResponse(out)


# --- neighbours -------------------------------------------------------------------------


@api.get(
    "/neighbors", response_model=NeighborsResponse, tags=["neighbors"],
    summary="Neighbours of a stored vector (id) or of an ad-hoc dense vector",
    description="Give exactly one of `id` (the vector itself is excluded from its "
    "neighbours) or `vector` (comma-separated numbers). A vector in the query string is "
    "limited by the server's request-line size (about 16 KiB with uvicorn's h11, i.e. a "
    "few thousand numbers): for longer or sparse vectors, or for batches, use "
    "`POST /neighbors/search`.",
    responses=responses(401, 404, 422, 500, 503),
)
async def neighbors(
    index: IndexDep, settings: SettingsDep, metrics: MetricsDep,
    id: Annotated[str | None, Query(min_length=1, max_length=512,
                                    description="id of a stored vector")] = None,
    vector: Annotated[str | None, Query(description="dense query, e.g. 0.1,0,-2.5,...")] = None,
    k: Annotated[int | None, Query(ge=1, description="neighbours (≤ max_k)")] = None,
    mode: Annotated[Mode | None, Query(description="lsh (default), exact, nrff")] = None,
    min_similarity: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
    candidates: Annotated[int | None, Query(ge=1, description="rerank budget (lsh)")] = None,
    bands: Annotated[int | None, Query(ge=1, description="bands probed (lsh)")] = None,
) -> Response:
    params = QueryParams.model_construct(k=k, mode=mode, min_similarity=min_similarity,
                                         candidates=candidates, bands=bands)
    out, r = await run_in_threadpool(ops.neighbors_get, index, settings, params, id, vector)
    _observe(metrics, [r])
    return ORJSONResponse(out)


@api.post(
    "/neighbors/search", tags=["neighbors"],
    response_model=NeighborsResponse | SearchBatchResponse,
    summary="Neighbours of queries given in the body (one, or a batch)",
    description="One query — `{\"id\": ...}`, `{\"vector\": [...]}` or `{\"indices\": [...], "
    "\"values\": [...]}` plus optional `k`, `mode`, `min_similarity`, `candidates`, `bands` — "
    "answers a NeighborsResponse; `{\"queries\": [...]}` (knobs at the top apply to every "
    "query unless one overrides them) answers `{\"results\": [...]}` in the same order.",
    responses=responses(401, 404, 408, 413, 422, 500, 503),
    openapi_extra=_body("SearchRequest", {
        "dense": {"value": {"vector": [0.5, -1.0, 0.0, 2.0], "k": 5}},
        "sparse": {"value": {"indices": [0, 3], "values": [1.0, 0.25], "mode": "exact"}},
        "batch": {"value": {"k": 3, "queries": [{"id": "a"}, {"vector": [1, 2, 3, 4]}]}},
    }),
)
async def search(request: Request, index: IndexDep, settings: SettingsDep,
                 metrics: MetricsDep) -> Response:
    body = await request.body()
    out, results = await run_in_threadpool(ops.search, index, settings, body)
    _observe(metrics, results)
    return ORJSONResponse(out)


# --- housekeeping ------------------------------------------------------------------------


@public.get(
    "/health", response_model=HealthResponse, tags=["ops"],
    summary="Liveness and store reachability (never needs the API key)",
    responses=responses(500, 503),
)
async def health(index: IndexDep, settings: SettingsDep) -> Response:
    try:
        with anyio.fail_after(HEALTH_TIMEOUT):
            # abandon_on_cancel: a hung store must not hang the probe too.
            await anyio.to_thread.run_sync(index.ping, abandon_on_cancel=True)
    except TimeoutError:
        raise ApiError(503, f"the store did not answer within {HEALTH_TIMEOUT:g} s") from None
    return ORJSONResponse({"status": "ok", "backend": settings.backend})


@api.get(
    "/stats", response_model=StatsResponse, tags=["ops"],
    summary="Index size, parameters and store facts",
    responses=responses(401, 500, 503),
)
async def stats(index: IndexDep, settings: SettingsDep) -> Response:
    def collect() -> dict:
        out = {"backend": settings.backend, "config": index.config.to_dict()}
        out.update(index.stats() or {})
        if isinstance(out.get("store"), dict):  # no server file paths in responses
            out["store"] = {k: v for k, v in out["store"].items() if k != "path"}
        out["count"] = int(index.count())
        out["service"] = {
            "max_k": settings.max_k, "default_k": settings.default_k,
            "max_batch": settings.max_batch, "max_body_bytes": settings.max_body_bytes,
            "max_candidates": settings.max_candidates, "auth": settings.api_key is not None,
        }
        return out

    return ORJSONResponse(await run_in_threadpool(collect))


@api.get(
    "/metrics", tags=["ops"], response_class=Response,
    summary="Prometheus metrics (text exposition format)",
    responses={200: {"content": {"text/plain": {}}}, **responses(401, 500)},
)
async def metrics_endpoint(metrics: MetricsDep) -> Response:
    data, content_type = await run_in_threadpool(metrics.render)
    return Response(data, media_type=content_type)
