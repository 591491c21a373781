"""FastAPI dependencies: the per-process index and settings, and the API-key check."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Path, Request, Security
from fastapi.security import APIKeyHeader
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from gmmlsh.index.index import Index
from gmmlsh.index.store.registry import DEFAULT_COLLECTION, NAME_RE
from gmmlsh.service.errors import ApiError
from gmmlsh.service.metrics import Metrics
from gmmlsh.service.settings import Settings

API_KEY_HEADER = "X-API-Key"
_api_key_scheme = APIKeyHeader(
    name=API_KEY_HEADER, auto_error=False,
    description="Required only when the server runs with GMMLSH_API_KEY set. "
    "`Authorization: Bearer <key>` is accepted too (for Prometheus scrapers).",
)


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


class held_index:  # noqa: N801 - used as a function: ``async with held_index(request) as index``
    """The index of collection ``collection`` (default: the request's path parameter, else the
    server's ``GMMLSH_COLLECTION``, by default the index itself), held while the block runs.
    (A class, not a generator: entered on every query, it costs a fifth as much.)"""

    __slots__ = ("request", "collection", "held")

    def __init__(self, request: Request, collection: str | None = None) -> None:
        self.request = request
        self.collection = collection
        self.held: Index | None = None

    async def __aenter__(self) -> Index:
        state = self.request.app.state
        index = getattr(state, "index", None)
        if index is None:  # only if a request slips in before the lifespan ran
            raise ApiError(503, "the index is not open yet")
        name = self.collection or self.request.path_params.get("collection") or state.settings.collection
        if name == DEFAULT_COLLECTION:
            return index
        if not NAME_RE.match(name):  # also checked as a path parameter, which FastAPI reports after this ran
            raise ApiError(422, "a collection name is 1-48 letters, digits, '_' or '-', starting with a letter "
                           "or digit", field="collection")
        self.held = await run_in_threadpool(state.collections.acquire, name)
        return self.held

    async def __aexit__(self, *exc: object) -> None:
        if self.held is not None:
            self.request.app.state.collections.release(self.held)


async def get_index(request: Request) -> AsyncIterator[Index]:
    """:func:`held_index` as a dependency: held for the request."""
    async with held_index(request) as index:
        yield index


async def collection_path(collection: Annotated[str, Path(
        pattern=NAME_RE.pattern, description="collection name (`default`: the index itself)")]) -> str:
    """The ``{collection}`` of a route under ``/collections/{collection}`` (checked here, so that
    a malformed name is a 422 naming it)."""
    return collection


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


#: The dependencies a route takes, as annotations (``index: IndexDep``).
IndexDep = Annotated[Index, Depends(get_index)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


async def require_api_key(request: Request, key: str | None = Security(_api_key_scheme)) -> None:
    """:func:`check_api_key` as a dependency (it declares the key for the OpenAPI document)."""
    check_api_key(request.app.state.settings, request.headers, key)


def check_api_key(settings: Settings, headers: Headers, key: str | None = None) -> None:
    """401 unless the configured key is presented (``X-API-Key``, or ``Authorization: Bearer``);
    a no-op when no key is configured.

    ``hmac.compare_digest`` keeps the comparison time independent of where the
    strings differ, so the key cannot be guessed byte by byte from timings; both
    sides are SHA-256 digests first, so not even the key's length shows.
    """
    expected = settings.api_key
    if expected is None:
        return
    if key is None:
        key = headers.get(API_KEY_HEADER)
    if key is None:
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            key = auth[7:].strip()
    ok = key is not None and hmac.compare_digest(
        hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest(),
        hashlib.sha256(expected.get_secret_value().encode("utf-8")).digest(),
    )
    if not ok:
        raise ApiError(401, f"missing or wrong API key (send it in the {API_KEY_HEADER} header)",
                       field=API_KEY_HEADER, headers={"WWW-Authenticate": "ApiKey"})
