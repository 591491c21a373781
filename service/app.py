"""The FastAPI application factory.

``create_app(settings)`` builds an app; nothing is opened at import time. The
index is opened in the lifespan, i.e. once in *each* uvicorn worker process after
it starts (an LMDB environment or a Redis connection pool must never cross a
fork), and closed when the worker stops. Run it with
``uvicorn --factory gmmlsh.service.app:create_app`` or ``gmmlsh serve``
(:func:`gmmlsh.service.server.serve`); both read ``GMMLSH_*`` environment variables.

Multi-worker LMDB: every worker opens the same environment directory; LMDB's
lock file coordinates them (one writer at a time across processes, readers never
blocked), and a write committed by one worker is visible to the next read
transaction of every other. Reader slots are sized for workers × threads
(``Settings.max_readers``) and the store clears slots left by killed workers
when it opens.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
import numpy as np
from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

import gmmlsh
from gmmlsh.core import parallel
from gmmlsh.index.index import Index
from gmmlsh.service.collections import CollectionManager
from gmmlsh.service.deps import require_api_key
from gmmlsh.service.errors import ORJSONResponse, install_handlers
from gmmlsh.service.hot import HotPath
from gmmlsh.service.lane import QueryLane
from gmmlsh.service.limits import BodyLimitMiddleware
from gmmlsh.service.metrics import Metrics, MetricsMiddleware
from gmmlsh.service.node import Heartbeat, Publisher, internal_search
from gmmlsh.service.opening import IndexOpenError, open_index
from gmmlsh.service.routes import api, docs, public
from gmmlsh.service.schemas import request_schemas
from gmmlsh.service.settings import Settings

log = logging.getLogger("gmmlsh.service")

DESCRIPTION = """\
Near-neighbour search for the generalized min-max (GMM) similarity: GCWS sketches,
searched through inverted lists, reranked by the exact GMM; stored in LMDB or Redis.

Every error answers `{"error": {"status", "code", "field", "message"}}`; bad input
is 422 and changes nothing. When the server has an API key, send it as `X-API-Key`.
"""


def _warm(index: Index, state) -> None:
    """Bring this machine's search mirror up to date with the store (a fresh Redis replica, or
    an index written since the mirror was last used, has rows to copy), map it into this worker,
    and run the query paths the routes take once, so that their kernels are compiled (or loaded
    from numba's cache) before ``/health`` says ready — in the background: the server answers
    meanwhile (``/health`` 503 ``starting``; a query arriving first compiles what it needs itself)."""
    t0 = time.perf_counter()
    try:
        view = index.warm(vectors=state.settings.vectors_in_ram)
        log.info("search mirror up to date and mapped: %d vectors in %.2f s", view.live, time.perf_counter() - t0)
        t1 = time.perf_counter()
        if warm_queries(index):
            log.info("query kernels ready in %.1f s", time.perf_counter() - t1)
    except Exception as exc:  # noqa: BLE001 - the first query retries; the server must start
        log.warning("not warmed up at start: %s", exc)
    state.ready = True


def warm_queries(index: Index) -> bool:
    """A query by id, and a stored vector queried as the query lane runs it (serial kernels; a
    dense one as a batch of two), so that numba compiles or loads the kernels a served query runs.
    False on an empty index (nothing to query: the first insert compiles). The vectors join the
    index's sample of served queries (2 of the 256 it keeps for re-tuning)."""
    rows, _ = index.scroll(limit=1)
    if not rows:
        return False
    parallel.set_threads(1)
    index.query(id=rows[0][0], k=1)
    stored = index.get(rows[0][0])
    if stored.indices is not None:
        index.query((stored.indices, stored.values), k=1)
    else:
        index.query_batch(np.stack([stored.values, stored.values]), k=1)
    return True


class App(FastAPI):
    """FastAPI, with the hot routes answered before its stack (:mod:`gmmlsh.service.hot`)."""

    hot: HotPath

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            matched = self.hot.match(scope)
            if matched is not None:
                scope["app"] = self
                await self.hot.serve(*matched, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> App:
    """Build the app. ``settings=None`` reads them from the environment (``GMMLSH_*``)."""
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Index calls run in anyio's worker threads; their number bounds concurrent
        # LMDB read transactions, hence Settings.max_readers.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.threads
        try:
            index = await run_in_threadpool(open_index, settings)
        except Exception as exc:
            text = settings.scrub(str(exc))
            log.error("cannot open the index at %s: %s", settings.safe_location, text)
            if text != str(exc):  # uvicorn prints the failure: never with the Redis password
                raise IndexOpenError(text) from None
            raise
        log.info("index open: %s, %d vectors, dim %d", settings.safe_location,
                 await run_in_threadpool(index.count), index.config.dim)
        problem = await run_in_threadpool(index.write_problem)
        if problem:  # reads are served; writes answer 503/507 until it is fixed (and /health says so)
            log.warning("writes will be refused: %s", settings.scrub(problem))
        app.state.ready = False
        threading.Thread(target=_warm, args=(index, app.state), name="gmmlsh-warm", daemon=True).start()
        app.state.collections = await run_in_threadpool(CollectionManager, settings, index)
        app.state.lane = QueryLane()
        app.state.lane.start()
        app.state.index = index
        heartbeat = (Heartbeat(index, settings.advertised, settings.group_pair, app.state).start()
                     if settings.group_pair is not None else None)
        publisher = (Publisher(index, settings.snapshots, settings.advertised, settings.group_pair,
                               settings.snapshot_every).start()
                     if settings.group_pair is not None and settings.snapshots else None)
        metrics.bind_index(index.count, app.state.collections.recall_reports)
        # Everything made so far lives as long as the worker: out of the garbage collector's
        # sight, a full collection (each query leaves short-lived objects) scans only what
        # requests make, not the whole heap of a process that imported numpy, numba and FastAPI.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if heartbeat is not None:
                await run_in_threadpool(heartbeat.stop)
            if publisher is not None:
                await run_in_threadpool(publisher.stop)
            metrics.bind_index(None)
            app.state.index = None
            await run_in_threadpool(app.state.lane.stop)
            await run_in_threadpool(app.state.collections.close)
            await run_in_threadpool(index.close)

    app = App(
        title="gmmlsh",
        version=gmmlsh.__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        default_response_class=ORJSONResponse,
        debug=False,
        docs_url=None,  # served with local assets below: the default page needs a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.index = None
    install_handlers(app)
    app.include_router(public)
    app.include_router(api)
    if settings.group_pair is not None:  # a search node: the router's binary batch call
        app.add_api_route("/internal/search", internal_search, methods=["POST"], include_in_schema=False,
                          dependencies=[Depends(require_api_key)])
    docs.install(app)

    # Added innermost first: metrics (outermost) also count 413s and CORS preflights.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Content-Type", "X-API-Key", "Authorization"],
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics, collection=settings.collection)

    _add_body_schemas(app)
    app.hot = HotPath(app)
    return app


def _add_body_schemas(app: FastAPI) -> None:
    """Routes parse their bodies themselves (off the event loop), so FastAPI does not
    see the request models; add their schemas to the OpenAPI components. Without an
    API key, drop the key requirement FastAPI derives from the auth dependency."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            if app.state.settings.api_key is None:
                # No key configured: no operation requires one, so the document must not say
                # so (clients and schema-driven tools would otherwise send or expect auth).
                schema["components"].pop("securitySchemes", None)
                for ops in schema.get("paths", {}).values():
                    for op in ops.values():
                        if isinstance(op, dict):
                            op.pop("security", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
