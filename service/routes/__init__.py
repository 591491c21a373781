"""The endpoints, one module per resource (DESIGN §3): vectors, neighbours, operations,
collections. A collection's vector and neighbour routes are the same routes under
``/collections/{collection}``; without the prefix they serve the server's collection."""

from fastapi import APIRouter, Depends

from gmmlsh.service.deps import collection_path, require_api_key
from gmmlsh.service.errors import responses
from gmmlsh.service.routes import collections, neighbors, ops, points, vectors

#: Routes open to everyone (liveness).
public = APIRouter()
public.include_router(ops.public)
#: Routes behind the API key, when one is set.
api = APIRouter(dependencies=[Depends(require_api_key)])
api.include_router(vectors.router)
api.include_router(neighbors.router)
api.include_router(ops.router)
api.include_router(points.router)
api.include_router(collections.router)
for _router in (vectors.router, neighbors.router, points.router):
    api.include_router(_router, prefix="/collections/{collection}", dependencies=[Depends(collection_path)],
                       responses=responses(404))
