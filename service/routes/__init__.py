"""The endpoints, one module per resource (DESIGN §3): vectors, neighbours, operations."""

from fastapi import APIRouter, Depends

from gmmlsh.service.deps import require_api_key
from gmmlsh.service.routes import neighbors, ops, vectors

#: Routes open to everyone (liveness).
public = APIRouter()
public.include_router(ops.public)
#: Routes behind the API key, when one is set.
api = APIRouter(dependencies=[Depends(require_api_key)])
api.include_router(vectors.router)
api.include_router(neighbors.router)
api.include_router(ops.router)
