"""``/neighbors``: nearest neighbours of a stored vector, or of vectors given in the query.

Both routes are *hot* (:mod:`gmmlsh.service.hot`): the server answers them through
:func:`get_neighbors` and :func:`post_search` without FastAPI's per-request machinery; the
FastAPI routes below document them and answer the requests the hot path leaves to the full
stack (CORS), through the same two functions.

A body query's vector is parsed by orjson and checked by the engine's compiled checks
(dimension, NaN/inf, all-zero), not number by number by pydantic; pydantic validates the
rest of the body (a few fields). Anything the fast parse does not take as it is (a non-number
in ``values``, JSON with NaN, malformed JSON) is parsed again by pydantic from the bytes, the
reference, whose error names the field. A body of ``Content-Type: application/octet-stream``
holds dense queries as raw little-endian float32, ``dim`` values a query, with the knobs in
the query string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qsl

import numpy as np
import orjson
from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.core import parallel
from gmmlsh.core.validate import DimensionError, VectorError
from gmmlsh.index.filters import Filter, compile_filter
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.results import QueryResult
from gmmlsh.service.deps import held_index
from gmmlsh.service.errors import ApiError, responses
from gmmlsh.service.lane import Job
from gmmlsh.service.parsing import located, media_type, parse_body
from gmmlsh.service.schemas import (
    SEARCH_BODY,
    NeighborsParams,
    NeighborsResponse,
    QueryParams,
    SearchBatch,
    SearchBatchResponse,
    SearchQuery,
    UrlParams,
)
from gmmlsh.service.settings import Settings

router = APIRouter(tags=["neighbors"])

#: The media type of a binary body: dense queries as raw little-endian float32.
BINARY = "application/octet-stream"
#: Bodies up to this size are parsed on the event loop (cheaper than a hop to a thread); larger
#: ones in a worker thread, so a 64 MiB batch never holds the loop.
_PARSE_INLINE = 64 * 1024

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
    "(16 KiB for the request line and headers together: a few thousand numbers): for longer or sparse "
    "vectors, or batches, use `POST /neighbors/search`.",
    responses=responses(401, 404, 422, 500, 503),
)
async def neighbors(request: Request, params: Annotated[NeighborsParams, Query()]) -> Response:
    return await answer_get(request, params)


@router.post(
    "/neighbors/search", response_model=NeighborsResponse | SearchBatchResponse,
    summary="Neighbours of queries given in the body (one, or a batch)",
    description="One query — `{\"id\": ...}`, `{\"values\": [...]}` (dense) or `{\"indices\": [...], "
    "\"values\": [...]}` (sparse), plus optional `k`, `mode`, `min_similarity`, `candidates`, `probes` — "
    "answers a NeighborsResponse; `{\"queries\": [...]}` (knobs at the top apply to every query unless "
    "one overrides them) answers `{\"results\": [...]}` in the same order.\n\n"
    f"Binary: with `Content-Type: {BINARY}` the body is dense queries as raw little-endian float32, `dim` "
    "values each (its length says how many), the knobs in the query string (`?k=10&mode=exact`); the answer "
    "is `{\"results\": [...]}`, one per query. It skips the JSON numbers both ways: the fastest way to send "
    "dense vectors (what `gmmlsh.Client` does).",
    responses=responses(401, 404, 408, 413, 422, 500, 503),
    openapi_extra={
        "parameters": [{"name": name, "in": "query", "required": False, "schema": schema,
                        "description": "binary body only (a JSON body carries its own)"}
                       for name, schema in UrlParams.model_json_schema()["properties"].items()],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/SearchRequest"}, "examples": _EXAMPLES},
            BINARY: {"schema": {"type": "string", "format": "binary"}}}},
    },
)
async def search(request: Request) -> Response:
    return await post_search(request)


# --- the handlers (the hot path calls these two) -------------------------------------------


def url_params(request: Request) -> dict[str, str]:
    """The query string as a dict (the last of repeated names), as Starlette's ``query_params``
    reads it; the common case (nothing percent-encoded) split directly, at a tenth of the cost."""
    qs = request.scope["query_string"]
    if b"%" in qs or b"+" in qs:
        return dict(parse_qsl(qs.decode("latin-1"), keep_blank_values=True))
    return {name: value for name, _, value in (p.partition("=") for p in qs.decode("latin-1").split("&") if p)}


async def get_neighbors(request: Request) -> Response:
    """``GET /neighbors``: the query string validated by :class:`NeighborsParams`, then answered."""
    try:
        params = NeighborsParams.model_validate(url_params(request))
    except ValidationError as exc:
        raise RequestValidationError(located(exc, "query")) from None
    return await answer_get(request, params)


async def answer_get(request: Request, params: NeighborsParams) -> Response:
    settings: Settings = request.app.state.settings
    if (params.id is None) == (params.vector is None):
        raise ApiError(422, "give exactly one of id (a stored vector) or vector (comma-separated numbers)",
                       field="vector")
    knobs = url_knobs(settings, params)
    target = Target(id=params.id) if params.id is not None else Target(vector=_dense_param(params.vector))
    async with held_index(request) as index:
        return _json(await _one(request, index, target, knobs, dense="vector"))


async def post_search(request: Request) -> Response:
    """``POST /neighbors/search``: a JSON body (one query or a batch) or a binary one."""
    settings: Settings = request.app.state.settings
    body = await request.body()
    try:
        params = UrlParams.model_validate(url_params(request))
    except ValidationError as exc:
        raise RequestValidationError(located(exc, "query")) from None
    if media_type(request) == BINARY:
        knobs = url_knobs(settings, params)
        async with held_index(request) as index:
            X = binary_queries(body, index.config.dim, settings.max_batch)
            if X.shape[0] == 1:
                one = await _one(request, index, Target(vector=X[0]), knobs, dense="body[0]")
                return _json(b'{"results":[' + one + b"]}")
            out = await run_in_threadpool(_batch_results, request, index, X, knobs)
            return _json(out)
    given = params.model_fields_set
    if given:
        raise ApiError(422, "knobs in the query string go with a binary body; a JSON body carries its own",
                       field=sorted(given)[0])
    parsed = parse_search(body) if len(body) <= _PARSE_INLINE else await run_in_threadpool(parse_search, body)
    query, vectors = parsed
    async with held_index(request) as index:
        if not isinstance(query, SearchBatch):
            target = query_target(query, vectors[0])
            return _json(await _one(request, index, target, resolve_knobs(settings, query)))
        out = await run_in_threadpool(search_batch, request, index, settings, query, vectors)
        return _json(out)


def _json(content: bytes) -> Response:
    return Response(content, media_type="application/json")


async def _one(request: Request, index: Index, target: Target, knobs: Knobs, dense: str = "values") -> bytes:
    """One query through the worker's query lane (:mod:`gmmlsh.service.lane`): its answer as JSON."""
    metrics = request.app.state.metrics

    def finish(r: QueryResult) -> bytes:
        metrics.candidates.labels(r.mode).observe(r.candidates)
        return orjson.dumps(result_dict(r))

    batchable = target.id is None and not target.sparse and knobs.filter is None
    job = Job(index=index, run=lambda: run_query(index, target, knobs, dense=dense), finish=finish,
              vector=target.vector if batchable else None, key=knobs if batchable else None)
    return await request.app.state.lane.answer(job)


def _batch_results(request: Request, index: Index, X: np.ndarray, knobs: Knobs) -> bytes:
    """A binary batch of many queries, answered by one ``query_batch`` (in a worker thread)."""
    parallel.set_threads(request.app.state.settings.batch_threads)
    try:
        results = index.query_batch(X, **knobs.kwargs())
    except VectorError as exc:
        if exc.part is None:  # k, mode, ...: named as the query string names them
            raise
        raise type(exc)(f"body[{exc.row}]" if exc.row is not None else "body", exc.reason) from None
    return _encode_results(request, results)


def _encode_results(request: Request, results: list[QueryResult]) -> bytes:
    metrics = request.app.state.metrics
    for r in results:
        metrics.candidates.labels(r.mode).observe(r.candidates)
    return orjson.dumps({"results": [result_dict(r) for r in results]})


# --- parsing --------------------------------------------------------------------------------


def binary_queries(body: bytes, dim: int, max_batch: int) -> np.ndarray:
    """A binary body as an (n, dim) float32 array (native order, writable: the kernels' type)."""
    row = 4 * dim
    if not body or len(body) % row:
        raise DimensionError("body", f"a binary body is n × {dim} little-endian float32 values (n × {row} "
                             f"bytes); got {len(body)} bytes")
    n = len(body) // row
    if n > max_batch:
        raise ApiError(413, f"{n} queries in one request; the limit is {max_batch} (max_batch)", field="body")
    return np.frombuffer(body, dtype="<f4").astype(np.float32).reshape(n, dim)


def parse_search(body: bytes) -> tuple[SearchQuery | SearchBatch, list[np.ndarray | None]]:
    """A JSON search body: the model (without its vectors' values) and each query's values as an
    array (None where a query has none), in order. See the module for the two parsers."""
    fast = _parse_fast(body)
    if fast is not None:
        return fast
    parsed = parse_body(SEARCH_BODY, body)
    queries = parsed.queries if isinstance(parsed, SearchBatch) else [parsed]
    return parsed, [np.asarray(q.values, dtype=np.float64) if q.values is not None else None for q in queries]


_NUMBERS = {float, int}


def _parse_fast(body: bytes) -> tuple[SearchQuery | SearchBatch, list[np.ndarray | None]] | None:
    """orjson for the bytes, numpy for each ``values`` list of numbers, pydantic for the rest;
    None when anything is not plainly well-formed (the reference parser then says what)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    queries = data.get("queries") if "queries" in data else [data]
    if not isinstance(queries, list) or not all(isinstance(q, dict) for q in queries):
        return None
    vectors: list[np.ndarray | None] = []
    for q in queries:
        values = q.get("values")
        if values is None:
            vectors.append(None)
            continue
        if type(values) is not list or not set(map(type, values)) <= _NUMBERS:
            return None
        try:
            vectors.append(np.array(values, dtype=np.float64))
        except OverflowError:  # an integer beyond float64
            return None
    for q in queries:
        q.pop("values", None)
    try:
        parsed = SEARCH_BODY.validate_python(data)
    except ValidationError as exc:
        raise RequestValidationError(located(exc, "body")) from None
    return parsed, vectors


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


def url_knobs(settings: Settings, params: UrlParams) -> Knobs:
    """The knobs of a query string, its ``filter`` JSON parsed (422 naming it if it is not JSON)."""
    return knobs_of(settings, params.k, params.mode, params.min_similarity, params.candidates, params.probes,
                    _json_param(params.filter, "filter"), "", "filter")


def resolve_knobs(settings: Settings, q: QueryParams, base: QueryParams | None = None, prefix: str = "") -> Knobs:
    """Per-query value, else the batch's, else the server default."""

    def pick(name: str) -> Any:
        v = getattr(q, name)
        return getattr(base, name) if v is None and base is not None else v

    where = prefix + "filter" if q.filter is not None or base is None else "filter"
    return knobs_of(settings, pick("k"), pick("mode"), pick("min_similarity"), pick("candidates"), pick("probes"),
                    pick("filter"), prefix, where)


def knobs_of(settings: Settings, k: int | None, mode: str | None, min_similarity: float | None,
             candidates: int | None, probes: int | None, spec: Any, prefix: str, where: str) -> Knobs:
    """The server's defaults for what is not given, and the service's own limit on k. Everything
    else about the knobs is the index's to check (its errors name the field)."""
    k = k or settings.default_k
    if k > settings.max_k:
        raise ApiError(422, f"k={k} is over the limit of {settings.max_k} (max_k)", field=prefix + "k")
    return Knobs(int(k), mode or "auto", float(min_similarity) if min_similarity is not None else 0.0, candidates,
                 probes, compile_filter(spec, where) if spec is not None else None)


@dataclass(frozen=True)
class Target:
    """What a query asks about: a stored ``id``, or a vector (dense array, or sparse
    ``(indices, values)``) as the client sent it; the index validates it."""

    id: str | None = None
    vector: Any = None

    @property
    def sparse(self) -> bool:
        return isinstance(self.vector, tuple)


def query_target(q: SearchQuery, values: np.ndarray | None, prefix: str = "") -> Target:
    """The one thing a query names (exactly one of id, dense values, sparse indices + values)."""
    if q.id is not None and (values is not None or q.indices is not None):
        raise ApiError(422, "give exactly one of id, values (dense), or indices + values (sparse)",
                       field=prefix + "id")
    if q.id is not None:
        return Target(id=q.id)
    if values is None:
        raise ApiError(422, "indices without values" if q.indices is not None else
                       "give exactly one of id, values (dense), or indices + values (sparse)",
                       field=prefix + ("values" if q.indices is not None else "id"))
    return Target(vector=(np.asarray(q.indices, dtype=np.int64), values) if q.indices is not None else values)


def client_field(exc: VectorError, prefix: str = "", dense: str = "values") -> VectorError:
    """An index error about a query's vector (its ``part``) named as the client sent it: the
    ``indices`` or ``values`` of a sparse vector, ``dense`` for the values of a dense one
    (``values``, or ``vector`` in a query string); other fields (``k``, ``mode``) as they are."""
    if exc.part in ("values", "indices"):
        field = "indices" if exc.part == "indices" else dense
    else:
        field = exc.name
    return type(exc)(prefix + field, exc.reason)


def run_query(index: Index, target: Target, knobs: Knobs, prefix: str = "", dense: str = "values") -> QueryResult:
    try:
        if target.id is not None:
            return index.query(id=target.id, **knobs.kwargs())
        return index.query(target.vector, **knobs.kwargs())
    except UnknownIdError:
        raise ApiError(404, f"no vector with id {target.id!r}", field=prefix + "id") from None
    except VectorError as exc:
        raise client_field(exc, prefix, dense) from None


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


def search_batch(request: Request, index: Index, settings: Settings, parsed: SearchBatch,
                 vectors: list[np.ndarray | None]) -> bytes:
    """A ``{"queries": [...]}`` body, answered in a worker thread."""
    parallel.set_threads(settings.batch_threads)
    if len(parsed.queries) > settings.max_batch:
        raise ApiError(413, f"{len(parsed.queries)} queries in one request; the limit is {settings.max_batch} "
                       "(max_batch)", field="queries")
    prefixes = [f"queries[{i}]." for i in range(len(parsed.queries))]
    targets = [query_target(q, v, p) for q, v, p in zip(parsed.queries, vectors, prefixes, strict=True)]
    knobs = [resolve_knobs(settings, q, parsed, p) for q, p in zip(parsed.queries, prefixes, strict=True)]
    return _encode_results(request, _answer_batch(index, targets, knobs, prefixes))


def _answer_batch(index: Index, targets: list[Target], knobs: list[Knobs], prefixes: list[str]) -> list[QueryResult]:
    """Dense queries of one length with the same knobs go to the index as one ``query_batch``
    (answered together, in parallel); any other batch is answered query by query."""
    dim = index.config.dim
    if len(targets) > 1 and len(set(knobs)) == 1 and all(
            t.id is None and not t.sparse and t.vector.shape == (dim,) for t in targets):
        try:
            return index.query_batch(np.stack([t.vector for t in targets]), **knobs[0].kwargs())
        except VectorError as exc:
            raise client_field(exc, prefixes[exc.row] if exc.row is not None else "") from None
    return [run_query(index, t, kn, p) for t, kn, p in zip(targets, knobs, prefixes, strict=True)]
