"""FastAPI dependencies: the per-process index and settings, and the API-key check."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request, Security
from fastapi.security import APIKeyHeader

from gmmlsh.index.index import Index
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


async def get_index(request: Request) -> Index:
    index = getattr(request.app.state, "index", None)
    if index is None:  # only if a request slips in before the lifespan ran
        raise ApiError(503, "the index is not open yet")
    return index


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def require_api_key(request: Request, key: str | None = Security(_api_key_scheme)) -> None:
    """401 unless the configured key is presented; a no-op when no key is configured.

    ``hmac.compare_digest`` keeps the comparison time independent of where the
    strings differ, so the key cannot be guessed byte by byte from timings; both
    sides are SHA-256 digests first, so not even the key's length shows.
    """
    expected = request.app.state.settings.api_key
    if expected is None:
        return
    if key is None:
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            key = auth[7:].strip()
    ok = key is not None and hmac.compare_digest(
        hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest(),
        hashlib.sha256(expected.get_secret_value().encode("utf-8")).digest(),
    )
    if not ok:
        raise ApiError(401, f"missing or wrong API key (send it in the {API_KEY_HEADER} header)",
                       field=API_KEY_HEADER, headers={"WWW-Authenticate": "ApiKey"})
