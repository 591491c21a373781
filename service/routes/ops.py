"""Operations: ``/ping`` and ``/health`` (open to all), ``/stats`` and ``/metrics``."""

from __future__ import annotations

import os

import anyio
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.index.index import Index
from gmmlsh.service.deps import IndexDep, MetricsDep, SettingsDep
from gmmlsh.service.errors import ApiError, ORJSONResponse, responses
from gmmlsh.service.schemas import HealthResponse, StatsResponse
from gmmlsh.service.settings import Settings

#: Seconds /health waits for the store before answering 503.
HEALTH_TIMEOUT = 5.0
#: What /health answers (503, code ``starting``) until this worker has mapped the index and
#: compiled its query kernels (service.app._warm).
STARTING = ("starting: mapping the index and compiling the query kernels (the first start on a machine "
            "compiles, later ones load numba's cache); queries are answered meanwhile, the first ones slowly")

public = APIRouter(tags=["ops"])
router = APIRouter(tags=["ops"])


_PONG = b'{"status":"ok"}'


@public.get("/ping", summary="The server answers (nothing else is checked; no API key needed)",
            response_model=dict[str, str], responses=responses(500))
async def ping(request: Request) -> Response:
    """A constant answer: a liveness probe that touches nothing, and the floor of a request's cost
    (bench/bench_http.py). ``/health`` also asks the store."""
    return Response(_PONG, media_type="application/json")


@public.get("/health", response_model=HealthResponse, summary="Liveness and store reachability (no API key needed)",
            responses=responses(500, 503))
async def health(request: Request, index: IndexDep, settings: SettingsDep) -> Response:
    if not request.app.state.ready:
        raise ApiError(503, STARTING, code="starting", headers={"Retry-After": "2"})
    try:
        with anyio.fail_after(HEALTH_TIMEOUT):
            # abandon_on_cancel: a hung store must not hang the probe too.
            await anyio.to_thread.run_sync(index.ping, abandon_on_cancel=True)
            problem = await anyio.to_thread.run_sync(index.write_problem, abandon_on_cancel=True)
            behind = await anyio.to_thread.run_sync(index.read_problem, abandon_on_cancel=True)
    except TimeoutError:
        raise ApiError(503, f"the store did not answer within {HEALTH_TIMEOUT:g} s") from None
    body = {"status": "ok", "backend": settings.backend, "writable": problem is None, "search_current": behind is None}
    if problem is not None:
        body["problem"] = settings.scrub(problem)
    if behind is not None:
        body["search_problem"] = behind
    return ORJSONResponse(body)


@router.get("/stats", response_model=StatsResponse, summary="Index size, parameters, search and store facts",
            responses=responses(401, 500, 503))
async def stats(index: IndexDep, settings: SettingsDep) -> Response:
    return ORJSONResponse(await run_in_threadpool(stats_body, index, settings))


def stats_body(index: Index, settings: Settings) -> dict:
    """What ``/stats`` (and ``GET /collections/{name}``) answer about an index."""
    # pid: which worker process answered (each keeps its own connection and counters).
    out = {"backend": settings.backend, "pid": os.getpid(), **_index_stats(index)}
    out["store"] = {k: v for k, v in out["store"].items() if k != "path"}  # no server paths in answers
    out["mirror"] = {k: v for k, v in out["mirror"].items() if k != "path"}
    out["service"] = {"max_k": settings.max_k, "default_k": settings.default_k, "max_batch": settings.max_batch,
                      "max_body_bytes": settings.max_body_bytes, "auth": settings.api_key is not None}
    return out


def _index_stats(index: Index, attempts: int = 3) -> dict:
    """``index.stats()``; it sums the mirror's file sizes, and a file that upkeep (another
    thread or process) replaces between listing and measuring is gone: measure again."""
    for attempt in range(attempts):
        try:
            return index.stats()
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@router.get("/metrics", response_class=Response, summary="Prometheus metrics (text exposition format)",
            responses={200: {"content": {"text/plain": {}}}, **responses(401, 500)})
async def metrics_endpoint(metrics: MetricsDep) -> Response:
    data, content_type = await run_in_threadpool(metrics.render)
    return Response(data, media_type=content_type)
