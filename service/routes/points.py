"""Scroll and batch delete: ``POST /scroll`` and ``POST /delete`` (under
``/collections/{collection}`` too). Not under ``/vectors/…``: those paths are vectors' ids."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.index.filters import compile_filter
from gmmlsh.service.deps import IndexDep, MetricsDep
from gmmlsh.service.errors import ApiError, ORJSONResponse, responses
from gmmlsh.service.parsing import parse_body
from gmmlsh.service.schemas import (
    DELETE_BODY,
    SCROLL_BODY,
    BatchDelete,
    BatchDeleteResponse,
    ScrollRequest,
    ScrollResponse,
    body_schema,
)

router = APIRouter(tags=["vectors"])


@router.post("/scroll", response_model=ScrollResponse, summary="Page through the stored ids and metadata",
             description="Ids in id order, `limit` a page, those whose metadata pass `filter` only. Give the "
             "answer's `next_cursor` as `cursor` for the next page (null: that was the last). Every id stored "
             "throughout a scroll comes exactly once, whatever is written meanwhile.",
             responses=responses(401, 408, 413, 422, 500, 503), openapi_extra=body_schema("ScrollRequest"))
async def scroll(request: Request, index: IndexDep) -> Response:
    raw = await request.body()

    def run() -> dict:
        body: ScrollRequest = parse_body(SCROLL_BODY, raw)
        flt = compile_filter(body.filter) if body.filter is not None else None
        page, cursor = index.scroll(body.cursor, body.limit, flt)
        return {"items": [{"id": i, "metadata": m} for i, m in page], "next_cursor": cursor}

    return ORJSONResponse(await run_in_threadpool(run))


@router.post("/delete", response_model=BatchDeleteResponse, summary="Delete by ids or by filter",
             description="`{\"ids\": [...]}` deletes those ids (unknown ones are skipped) in one atomic batch; "
             "`{\"filter\": {...}}` deletes every vector whose metadata pass the filter (a vector replaced "
             "meanwhile by a version that no longer passes stays).",
             responses=responses(401, 408, 413, 422, 500, 503, 507), openapi_extra=body_schema("DeleteRequest"))
async def delete_many(request: Request, index: IndexDep, metrics: MetricsDep) -> Response:
    raw = await request.body()

    def run() -> dict:
        body: BatchDelete = parse_body(DELETE_BODY, raw)
        if (body.ids is None) == (body.filter is None):
            raise ApiError(422, "give exactly one of ids or filter", field="ids")
        if body.ids is not None:
            n = index.delete(body.ids)
        else:
            n = index.delete_where(compile_filter(body.filter))
        return {"deleted": int(n), "count": int(index.count())}

    out = await run_in_threadpool(run)
    metrics.deleted.inc(out["deleted"])
    return ORJSONResponse(out)
