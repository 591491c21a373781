"""``/neighbors``: nearest neighbours of a stored vector, or of vectors given in the query."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.core.validate import NonFiniteError, VectorError, ZeroVectorError
from gmmlsh.index.filters import Filter, compile_filter
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.index.search import QueryResult
from gmmlsh.index.store.base import MAX_ID_BYTES
from gmmlsh.service.deps import IndexDep, MetricsDep, SettingsDep
from gmmlsh.service.errors import ApiError, ORJSONResponse, responses
from gmmlsh.service.parsing import located, parse_body
from gmmlsh.service.schemas import (
    MODE_HELP,
    SEARCH_BODY,
    Mode,
    NeighborsResponse,
    QueryParams,
    SearchBatch,
    SearchBatchResponse,
    SearchQuery,
)
from gmmlsh.service.settings import Settings

router = APIRouter(tags=["neighbors"])

_EXAMPLES = {
    "dense": {"value": {"values": [0.5, -1.0, 0.0, 2.0], "k": 5}},
    "sparse": {"value": {"indices": [0, 3], "values": [1.0, 0.25], "mode": "exact"}},
    "batch": {"value": {"k": 3, "queries": [{"id": "a"}, {"values": [1, 2, 3, 4]}]}},
}


@router.get(
    "/neighbors", response_model=NeighborsResponse,
    summary="Neighbours of a stored vector (id) or of a dense vector given in the URL",
    description="Give exactly one of `id` (the vector itself is left out of its neighbours) or `vector` "
    "(comma-separated numbers). A vector in the query string is limited by the server's request-line size "
    "(about 16 KiB with uvicorn's h11: a few thousand numbers): for longer or sparse vectors, or batches, "
    "use `POST /neighbors/search`.",
    responses=responses(401, 404, 422, 500, 503),
)
async def neighbors(
    index: IndexDep, settings: SettingsDep, metrics: MetricsDep,
    id: Annotated[str | None, Query(min_length=1, max_length=MAX_ID_BYTES, description="id of a stored vector")] = None,
    vector: Annotated[str | None, Query(description="dense query, e.g. 0.1,0,-2.5,...")] = None,
    k: Annotated[int | None, Query(ge=1, description="neighbours (≤ max_k)")] = None,
    mode: Annotated[Mode | None, Query(description=MODE_HELP)] = None,
    min_similarity: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
    candidates: Annotated[int | None, Query(ge=1, description="rerank budget (sketch, postings)")] = None,
    probes: Annotated[int | None, Query(ge=0, description="inverted lists scanned (sketch; 0: all)")] = None,
    filter: Annotated[str | None, Query(description="a metadata filter as JSON (see POST /neighbors/search)")]
    = None,
) -> Response:
    params = QueryParams.model_construct(k=k, mode=mode, min_similarity=min_similarity, candidates=candidates,
                                         probes=probes, filter=_json_param(filter, "filter"))
    out, r = await run_in_threadpool(neighbors_get, index, settings, params, id, vector)
    metrics.candidates.labels(r.mode).observe(r.candidates)
    return ORJSONResponse(out)


@router.post(
    "/neighbors/search", response_model=NeighborsResponse | SearchBatchResponse,
    summary="Neighbours of queries given in the body (one, or a batch)",
    description="One query — `{\"id\": ...}`, `{\"values\": [...]}` (dense) or `{\"indices\": [...], "
    "\"values\": [...]}` (sparse), plus optional `k`, `mode`, `min_similarity`, `candidates`, `probes` — "
    "answers a NeighborsResponse; `{\"queries\": [...]}` (knobs at the top apply to every query unless "
    "one overrides them) answers `{\"results\": [...]}` in the same order.",
    responses=responses(401, 404, 408, 413, 422, 500, 503),
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/SearchRequest"}, "examples": _EXAMPLES}}}},
)
async def search(request: Request, index: IndexDep, settings: SettingsDep, metrics: MetricsDep) -> Response:
    out, results = await run_in_threadpool(search_body, index, settings, await request.body())
    for r in results:
        metrics.candidates.labels(r.mode).observe(r.candidates)
    return ORJSONResponse(out)


# --- the blocking work ----------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    k: int
    mode: str
    min_similarity: float
    candidates: int | None
    probes: int | None
    filter: Filter | None = None

    def kwargs(self) -> dict:
        return {"k": self.k, "mode": self.mode, "min_similarity": self.min_similarity,
                "candidates": self.candidates, "probes": self.probes, "filter": self.filter}


def resolve_knobs(settings: Settings, q: QueryParams, base: QueryParams | None = None, prefix: str = "") -> Knobs:
    """Per-query value, else the batch's, else the server default; the service's own limit on k.
    Everything else about the knobs is the index's to check (its errors name the field)."""

    def pick(name: str) -> Any:
        v = getattr(q, name)
        return getattr(base, name) if v is None and base is not None else v

    k = pick("k") or settings.default_k
    if k > settings.max_k:
        raise ApiError(422, f"k={k} is over the limit of {settings.max_k} (max_k)", field=prefix + "k")
    ms = pick("min_similarity")
    spec = pick("filter")
    where = prefix + "filter" if q.filter is not None or base is None else "filter"
    return Knobs(int(k), pick("mode") or "auto", float(ms) if ms is not None else 0.0, pick("candidates"),
                 pick("probes"), compile_filter(spec, where) if spec is not None else None)


@dataclass(frozen=True)
class Target:
    """What a query asks about: a stored ``id``, or a vector (dense array, or sparse
    ``(indices, values)``) as the client sent it; the index validates it."""

    id: str | None = None
    vector: Any = None

    @property
    def sparse(self) -> bool:
        return isinstance(self.vector, tuple)


def query_target(q: SearchQuery, prefix: str = "") -> Target:
    """The one thing a query names (exactly one of id, dense values, sparse indices + values)."""
    if q.id is not None and (q.values is not None or q.indices is not None):
        raise ApiError(422, "give exactly one of id, values (dense), or indices + values (sparse)",
                       field=prefix + "id")
    if q.id is not None:
        return Target(id=q.id)
    if q.values is None:
        raise ApiError(422, "indices without values" if q.indices is not None else
                       "give exactly one of id, values (dense), or indices + values (sparse)",
                       field=prefix + ("values" if q.indices is not None else "id"))
    values = np.asarray(q.values, dtype=np.float64)
    return Target(vector=(np.asarray(q.indices, dtype=np.int64), values) if q.indices is not None else values)


_VECTOR_FIELD = re.compile(r"^vectors?(\[(\d+)\])?$")


def client_field(exc: VectorError, prefix: str = "", sparse: bool = False, dense: str = "values") -> VectorError:
    """The index names a query's vector ``vector`` (``vectors[i]`` in a batch); name it as the
    client sent it: ``values`` (``dense``), or ``indices`` for the structure of a sparse vector."""
    field = exc.field
    if _VECTOR_FIELD.match(field) or field == "values":
        if sparse:
            field = "values" if isinstance(exc, NonFiniteError | ZeroVectorError) else "indices"
        else:
            field = dense
    return type(exc)(prefix + field, exc.reason)


def run_query(index: Index, target: Target, knobs: Knobs, prefix: str = "", dense: str = "values") -> QueryResult:
    try:
        if target.id is not None:
            return index.query(id=target.id, **knobs.kwargs())
        return index.query(target.vector, **knobs.kwargs())
    except UnknownIdError:
        raise ApiError(404, f"no vector with id {target.id!r}", field=prefix + "id") from None
    except VectorError as exc:
        raise client_field(exc, prefix, target.sparse, dense) from None


def result_dict(r: QueryResult) -> dict:
    return {"mode": r.mode, "k": r.k, "candidates": int(r.candidates),
            "neighbors": [{"id": n.id, "similarity": float(n.similarity), "metadata": n.metadata}
                          for n in r.neighbors]}


def _json_param(text: str | None, field: str) -> Any:
    """A JSON query parameter, parsed (422 naming it if it is not JSON)."""
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ApiError(422, f"not valid JSON: {exc}", field=field) from None


def _dense_param(text: str) -> np.ndarray:
    """``vector=0.1,0.2,...`` → float64 (NaN/inf pass here; the index refuses them)."""
    parts = text.replace(" ", "").split(",")
    out = np.empty(len(parts))
    for i, p in enumerate(parts):
        try:
            out[i] = float(p)
        except ValueError:
            raise ApiError(422, f"position {i} is not a number; vector is a comma-separated list of numbers",
                           field="vector") from None
    return out


def neighbors_get(index: Index, settings: Settings, params: QueryParams, ext_id: str | None,
                  vector: str | None) -> tuple[dict, QueryResult]:
    if (ext_id is None) == (vector is None):
        raise ApiError(422, "give exactly one of id (a stored vector) or vector (comma-separated numbers)",
                       field="vector")
    if ext_id is not None:
        try:
            SearchQuery(id=ext_id)  # the id rules (e.g. under MAX_ID_BYTES characters but over MAX_ID_BYTES bytes)
        except ValidationError as exc:
            raise RequestValidationError(located(exc, "query")) from None
    target = Target(id=ext_id) if ext_id is not None else Target(vector=_dense_param(vector))
    r = run_query(index, target, resolve_knobs(settings, params), dense="vector")
    return result_dict(r), r


def search_body(index: Index, settings: Settings, body: bytes) -> tuple[dict, list[QueryResult]]:
    parsed = parse_body(SEARCH_BODY, body)
    if not isinstance(parsed, SearchBatch):
        r = run_query(index, query_target(parsed), resolve_knobs(settings, parsed))
        return result_dict(r), [r]
    if len(parsed.queries) > settings.max_batch:
        raise ApiError(413, f"{len(parsed.queries)} queries in one request; the limit is {settings.max_batch} "
                       "(max_batch)", field="queries")
    prefixes = [f"queries[{i}]." for i in range(len(parsed.queries))]
    targets = [query_target(q, p) for q, p in zip(parsed.queries, prefixes, strict=True)]
    knobs = [resolve_knobs(settings, q, parsed, p) for q, p in zip(parsed.queries, prefixes, strict=True)]
    results = _answer_batch(index, targets, knobs, prefixes)
    return {"results": [result_dict(r) for r in results]}, results


def _answer_batch(index: Index, targets: list[Target], knobs: list[Knobs], prefixes: list[str]) -> list[QueryResult]:
    """Dense queries of one length with the same knobs go to the index as one ``query_batch``
    (answered together, in parallel); any other batch is answered query by query."""
    dim = index.config.dim
    if len(targets) > 1 and len(set(knobs)) == 1 and all(
            t.id is None and not t.sparse and t.vector.shape == (dim,) for t in targets):
        try:
            return index.query_batch(np.stack([t.vector for t in targets]), **knobs[0].kwargs())
        except VectorError as exc:
            m = _VECTOR_FIELD.match(exc.field)
            raise client_field(exc, prefixes[int(m.group(2))] if m and m.group(2) else "") from None
    return [run_query(index, t, kn, p) for t, kn, p in zip(targets, knobs, prefixes, strict=True)]
