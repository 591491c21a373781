"""The router's FastAPI app: the REST API of one server over the search nodes of every group.

See :mod:`gmmlsh.service.router` for what it promises; the request parsing and every check
on a query are the single server's own functions (:mod:`gmmlsh.service.routes.neighbors`,
:mod:`gmmlsh.service.routes.vectors`), so an error names the same field either way.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import orjson
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.core.validate import VectorError
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.index.plan import check_options
from gmmlsh.index.records import SparseRow, as_stored, query_rows
from gmmlsh.index.search import query_codes
from gmmlsh.service.deps import require_api_key
from gmmlsh.service.errors import ApiError, ORJSONResponse, install_handlers
from gmmlsh.service.limits import BodyLimitMiddleware
from gmmlsh.service.opening import open_index
from gmmlsh.service.parsing import located, media_type
from gmmlsh.service.router.fanout import Fanout, NodeRefused, merge
from gmmlsh.service.routes import vectors
from gmmlsh.service.routes.neighbors import (
    BINARY,
    _dense_param,
    _json_param,
    binary_queries,
    client_field,
    parse_search,
    query_target,
    resolve_knobs,
    url_knobs,
    url_params,
)
from gmmlsh.service.schemas import NeighborsParams, SearchBatch, UrlParams
from gmmlsh.service.settings import Settings
from gmmlsh.service.wire import NodeQuery

log = logging.getLogger("gmmlsh.router")

#: Request headers: consistency (strong | session | eventual), a session's epoch, partial answers.
CONSISTENCY, SESSION, PARTIAL = "x-gmmlsh-consistency", "x-gmmlsh-session", "x-gmmlsh-partial"
#: Response header naming the groups a partial answer lacks.
MISSING = "X-Gmmlsh-Missing-Groups"
_LEVELS = ("strong", "session", "eventual")


def create_router_app(settings: Settings | None = None) -> FastAPI:
    """The router app (``settings=None``: from ``GMMLSH_*``). Needs ``redis_url``."""
    settings = settings or Settings()
    if not settings.redis_url:
        raise ValueError("redis_url: the router serves an index in Redis (set GMMLSH_REDIS_URL or --redis)")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        index = await run_in_threadpool(open_index, settings.model_copy(update={"group": None}))
        cluster = await run_in_threadpool(lambda: index.store.guarded(lambda r: index.store._cluster))
        make = aioredis.RedisCluster if cluster else aioredis.Redis
        client = make.from_url(settings.redis_url, socket_timeout=5.0)
        key = settings.api_key.get_secret_value() if settings.api_key is not None else None
        fanout = Fanout(client, settings.prefix, route_groups=settings.route_groups, hedge_after=settings.hedge_after,
                        timeout=settings.node_timeout, window=settings.route_window, api_key=key,
                        hasher=functools.partial(query_codes, config=index.config))
        await run_in_threadpool(fanout.hasher, np.ones((1, index.config.dim), np.float32))  # compiled or loaded now
        await fanout.start()
        app.state.index, app.state.fanout = index, fanout
        try:
            yield
        finally:
            await fanout.close()
            await client.aclose()
            await run_in_threadpool(index.close)

    app = FastAPI(title="gmmlsh router", lifespan=lifespan, default_response_class=ORJSONResponse, docs_url=None,
                  redoc_url=None)
    app.state.settings = settings
    install_handlers(app)

    async def refused(request: Request, exc: NodeRefused) -> Response:  # a node's 4xx, as it said it
        return Response(exc.body, status_code=exc.status, media_type="application/json")

    app.add_exception_handler(NodeRefused, refused)
    api = APIRouter(dependencies=[Depends(require_api_key)])

    @app.get("/ping")
    async def ping() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        fanout: Fanout = request.app.state.fanout
        G, groups = fanout.layout()
        missing = [g for g in range(G) if not groups.get(g)]
        if missing:
            raise ApiError(503, f"group{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {G} "
                           f"{'have' if len(missing) > 1 else 'has'} no live search node", code="group_unavailable",
                           headers={"Retry-After": "1"})
        return ORJSONResponse({"status": "ok", "backend": "redis", "groups": G,
                               "replicas": {str(g): len(groups[g]) for g in range(G)}})

    @api.get("/stats")
    async def stats(request: Request) -> Response:
        index: Index = request.app.state.index
        fanout: Fanout = request.app.state.fanout
        G, groups = fanout.layout()
        count = await run_in_threadpool(index.count)
        return ORJSONResponse({
            "backend": "redis", "role": "router", "pid": os.getpid(), "count": count,
            "config": index.config.to_dict(), "groups": G,
            "nodes": [{"url": r.url, "group": r.group, "groups": r.groups, "ready": r.ready, "inflight": r.inflight}
                      for r in fanout.replicas.values()],
            "calls": fanout.calls, "hedged": fanout.hedged, "hashed": fanout.hashed})

    @api.get("/neighbors")
    async def neighbors(request: Request) -> Response:
        try:
            params = NeighborsParams.model_validate(url_params(request))
        except ValidationError as exc:
            raise RequestValidationError(located(exc, "query")) from None
        if (params.id is None) == (params.vector is None):
            raise ApiError(422, "give exactly one of id (a stored vector) or vector (comma-separated numbers)",
                           field="vector")
        knobs = url_knobs(settings, params)
        target_vector = _dense_param(params.vector) if params.vector is not None else None
        q = await _prepare(request, params.id, target_vector, knobs, _json_param(params.filter, "filter"), "",
                           "vector")
        return await _answer(request, [q], single=True)

    @api.post("/neighbors/search")
    async def search(request: Request) -> Response:
        body = await request.body()
        index: Index = request.app.state.index
        dim = index.config.dim
        if media_type(request) == BINARY:
            try:
                params = UrlParams.model_validate(url_params(request))
            except ValidationError as exc:
                raise RequestValidationError(located(exc, "query")) from None
            knobs = url_knobs(settings, params)
            X = binary_queries(body, dim, settings.max_batch)
            try:
                X = as_stored(X, dim, "vectors")
            except VectorError as exc:
                raise type(exc)(exc.field.replace("vectors", "body"), exc.reason) from None
            flt = _json_param(params.filter, "filter")
            qs = [await _prepare(request, None, X[i], knobs, flt, "", f"body[{i}]") for i in range(X.shape[0])]
            return await _answer(request, qs, single=False)
        query, vecs = parse_search(body) if len(body) <= 1 << 16 else await run_in_threadpool(parse_search, body)
        if not isinstance(query, SearchBatch):
            target = query_target(query, vecs[0])
            return await _answer(request, [await _prepare(request, target.id, target.vector,
                                                          resolve_knobs(settings, query), query.filter, "")],
                                 single=True)
        if len(query.queries) > settings.max_batch:
            raise ApiError(413, f"{len(query.queries)} queries in one request; the limit is {settings.max_batch} "
                           "(max_batch)", field="queries")
        qs = []
        for i, (q, v) in enumerate(zip(query.queries, vecs, strict=True)):
            prefix = f"queries[{i}]."
            target = query_target(q, v, prefix)
            qs.append(await _prepare(request, target.id, target.vector, resolve_knobs(settings, q, query, prefix),
                                     q.filter if q.filter is not None else query.filter, prefix))
        return await _answer(request, qs, single=False)

    @api.post("/vectors")
    async def upsert(request: Request) -> Response:
        index: Index = request.app.state.index
        body = await request.body()
        media = media_type(request)
        out, epoch = await run_in_threadpool(_written, index, lambda: vectors.upsert(index, settings, body, media))
        return _session(out, epoch)

    @api.get("/vectors/{id:anypath}")
    async def get_vector(id: str, request: Request) -> Response:
        return ORJSONResponse(await run_in_threadpool(vectors.read_back, request.app.state.index, id))

    @api.delete("/vectors/{id:anypath}")
    async def delete_vector(id: str, request: Request) -> Response:
        index: Index = request.app.state.index
        out, epoch = await run_in_threadpool(_written, index, lambda: vectors.delete(index, id))
        return _session(out, epoch)

    app.include_router(api)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    return app


def _written(index: Index, write) -> tuple[dict, int | None]:
    """A write's answer and the epoch it bumped to (read in the thread that wrote)."""
    out = write()
    return out, index.store.last_epoch()


def _session(out: dict, epoch: int | None) -> Response:
    """A write's answer with its session token (the epoch it bumped), in the body and a header."""
    if epoch is None:
        return ORJSONResponse(out)
    return ORJSONResponse({**out, "session": epoch}, headers={"X-Gmmlsh-Session": str(epoch)})


async def _prepare(request: Request, ext_id: str | None, vector: Any, knobs, flt: dict | None, prefix: str,
                   dense: str = "values") -> NodeQuery:
    """A query checked as one server checks it (its knobs, its vector; an id's vector read from
    Redis), before anything is sent to a node."""
    index: Index = request.app.state.index
    try:
        k, mode, min_sim = check_options(knobs.k, knobs.mode, knobs.min_similarity, knobs.candidates, knobs.probes)
    except VectorError as exc:
        raise type(exc)(prefix + exc.field, exc.reason) from None
    if ext_id is not None:
        try:
            stored = await run_in_threadpool(index.get, ext_id)
        except UnknownIdError:
            raise ApiError(404, f"no vector with id {ext_id!r}", field=prefix + "id") from None
        vec: np.ndarray | SparseRow = (stored.values if stored.indices is None else
                                       SparseRow(np.asarray(stored.indices, np.int32), stored.values, index.config.dim))
    else:
        try:
            X = query_rows(vector, index.config.dim)
        except VectorError as exc:
            raise client_field(exc, prefix, dense) from None
        if isinstance(X, SparseRow):
            vec = X
        elif hasattr(X, "indices"):  # a 1-row CSR
            vec = SparseRow(X.indices.astype(np.int32), X.data.astype(np.float32), index.config.dim)
        else:
            vec = np.asarray(X[0], dtype=np.float32)
    return NodeQuery(vec, k, mode, min_sim, knobs.candidates, knobs.probes, ext_id, flt)


async def _answer(request: Request, queries: list[NodeQuery], single: bool) -> Response:
    """Scatter, merge, answer (503 naming missing groups unless partial answers were asked for)."""
    headers = request.headers
    level = headers.get(CONSISTENCY, "strong").strip().lower()
    if level not in _LEVELS:
        raise ApiError(422, f"unknown consistency {level!r}; expected one of {', '.join(_LEVELS)}",
                       field="X-Gmmlsh-Consistency")
    session = None
    if headers.get(SESSION) is not None:
        try:
            session = int(headers[SESSION])
        except ValueError:
            raise ApiError(422, "a session token is the whole number a write answered", field="X-Gmmlsh-Session") \
                from None
    partial = headers.get(PARTIAL, "").strip().lower() in ("1", "true", "yes")
    fanout: Fanout = request.app.state.fanout
    per_query, missing, G = await fanout.search(queries, session=session if level != "eventual" else None,
                                                strong=level == "strong")
    if missing and not partial:
        names = ", ".join(map(str, missing))
        raise ApiError(503, f"group{'s' if len(missing) > 1 else ''} {names} of {G} "
                       f"{'have' if len(missing) > 1 else 'has'} no live search node; retry, or send "
                       "X-Gmmlsh-Partial: true to be answered by the other groups", code="group_unavailable",
                       headers={"Retry-After": "1"})
    results = []
    for q, answers in zip(queries, per_query, strict=True):
        mode, candidates, hits = merge(answers, q.k)
        out: dict[str, Any] = {"mode": mode, "k": q.k, "candidates": candidates, "neighbors": [
            {"id": n, "similarity": s, "metadata": orjson.Fragment(m) if m else None} for s, n, m in hits]}
        if missing:
            out["missing_groups"] = missing
        results.append(out)
    extra = {MISSING: ",".join(map(str, missing))} if missing else None
    body = results[0] if single else ({"results": results, "missing_groups": missing} if missing
                                      else {"results": results})
    return Response(orjson.dumps(body), media_type="application/json", headers=extra)
