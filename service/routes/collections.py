"""``/collections``: create, list, describe and delete named collections.

The vector and neighbour routes of a collection are today's routes under
``/collections/{collection}`` (mounted in :mod:`gmmlsh.service.routes`); ``default`` is
the server's own index, which the routes without a prefix also serve.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.core.validate import VectorError
from gmmlsh.index.collections import DEFAULT_COLLECTION, check_indexed, described
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.records import as_stored
from gmmlsh.service.deps import IndexDep, SettingsDep, collection_path
from gmmlsh.service.errors import ApiError, ORJSONResponse, responses
from gmmlsh.service.parsing import parse_body
from gmmlsh.service.routes.ops import stats_body
from gmmlsh.service.schemas import (
    COLLECTION_BODY,
    CollectionCreate,
    CollectionList,
    CollectionOut,
    StatsResponse,
    body_schema,
)

router = APIRouter(tags=["collections"])


@router.post("/collections", status_code=201, response_model=CollectionOut, summary="Create a collection",
             description="A named index with its own dimension and parameters (IndexConfig's defaults for those "
             "left out). Give `dim`, or a `sample` of rows to read it from. `indexed_fields`: metadata fields "
             "kept indexed for filters. 409 if the name is taken.",
             responses=responses(401, 408, 409, 413, 422, 500, 503),
             openapi_extra=body_schema("CollectionRequest"))
async def create_collection(request: Request) -> Response:
    manager = request.app.state.collections
    entry = await run_in_threadpool(_create, manager, await request.body())
    return ORJSONResponse(entry, status_code=201)


def _create(manager, raw: bytes) -> dict:
    body: CollectionCreate = parse_body(COLLECTION_BODY, raw)
    given = {k: v for k, v in body.model_dump(exclude={"name", "indexed_fields", "sample"}).items() if v is not None}
    if body.sample is not None:
        widths = {len(r) for r in body.sample}
        if len(widths) != 1:
            raise ApiError(422, "rows of different lengths", field="sample")
        dim = widths.pop()
        if given.setdefault("dim", dim) != dim:
            raise ApiError(422, f"dim is {given['dim']} but the sample rows have {dim} values", field="dim")
        try:
            as_stored(np.array(body.sample, dtype=np.float64), dim, "sample")
        except VectorError as exc:
            raise ApiError(422, exc.reason, field=exc.field) from None
    if "dim" not in given:
        raise ApiError(422, "give the dimension (dim), or a sample of rows to read it from", field="dim")
    try:
        config = IndexConfig(**given)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise ApiError(422, str(exc), field=field if field in given else None) from None
    try:
        indexed = check_indexed(body.indexed_fields)
    except ValueError as exc:  # "indexed_fields[i]: …" or "indexed_fields: …"
        raise ApiError(422, str(exc), field=str(exc).split(":", 1)[0]) from None
    return described(manager.create(body.name, config, indexed))


@router.get("/collections", response_model=CollectionList, summary="List the collections",
            description="`default` (the server's own index) first, then the named collections by name.",
            responses=responses(401, 500, 503))
async def list_collections(request: Request) -> Response:
    listing = await run_in_threadpool(request.app.state.collections.listing)
    return ORJSONResponse({"collections": listing})


@router.get("/collections/{collection}", response_model=StatsResponse, summary="A collection's stats",
            description="As `/stats`, for this collection (with `filters.indexed_fields`).",
            responses=responses(401, 404, 422, 500, 503))
async def get_collection(collection: Annotated[str, Depends(collection_path)],
                         index: IndexDep, settings: SettingsDep) -> Response:
    return ORJSONResponse(await run_in_threadpool(stats_body, index, settings))


@router.delete("/collections/{collection}", summary="Delete a collection and everything in it",
               responses=responses(401, 404, 422, 500, 503))
async def delete_collection(collection: Annotated[str, Depends(collection_path)], request: Request) -> Response:
    if collection == DEFAULT_COLLECTION:
        raise ApiError(422, "the default collection is the server's own index; it cannot be deleted",
                       field="collection")
    await run_in_threadpool(request.app.state.collections.delete, collection)
    return ORJSONResponse({"deleted": collection})
