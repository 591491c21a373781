"""One error shape for every failure, and the handlers that produce it.

Every 4xx/5xx body is ``{"error": {"status", "code", "field", "message", "details"}}``
(:class:`gmmlsh.service.schemas.ErrorResponse`). Bad input is **422** whether pydantic
caught it (wrong type, malformed JSON, unknown mode) or :mod:`core.validate`
did (wrong dimension, NaN/inf, all-zero vector, bad sparse indices), so a client
has one code to handle. Submitted input is never echoed (a 422 for one bad
number in a 10 000-vector batch must not send 50 MB back), and no response
carries a traceback: unexpected errors are logged server-side and answered 500.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from gmmlsh.core.validate import VectorError
from gmmlsh.index.filters import FilterError
from gmmlsh.index.index import MirrorFull, UnknownIdError
from gmmlsh.index.store.base import ConfigConflict, DiskFull, StoreError, StoreUnavailable
from gmmlsh.index.store.registry import CollectionExists, UnknownCollection
from gmmlsh.service.schemas import UNION_TAGS, ErrorResponse

log = logging.getLogger("gmmlsh.service")

#: At most this many problems are listed in ``details`` (the first one is ``field``).
MAX_DETAILS = 20

CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    409: "conflict",
    413: "too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    422: "invalid_request",
    431: "headers_too_large",
    500: "internal_error",
    503: "unavailable",
    507: "storage_full",
}


class ORJSONResponse(JSONResponse):
    """JSON via orjson; numpy arrays serialise natively (no ``tolist`` round trip).

    Our own class rather than ``fastapi.responses.ORJSONResponse``, which newer
    FastAPI deprecates (it only speeds up responses built from plain data, which is
    exactly what these handlers return).
    """

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class ApiError(Exception):
    """A refusal decided by the service itself (limits, missing parameters, auth)."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.code = code or CODES.get(status, "error")
        self.headers = headers


def error_response(status: int, message: str, *, field: str | None = None,
                   code: str | None = None, details: list[dict] | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body: dict[str, Any] = {
        "status": status,
        "code": code or CODES.get(status, "error"),
        "field": field,
        "message": message,
    }
    if details is not None:
        body["details"] = details
    return ORJSONResponse({"error": body}, status_code=status, headers=headers)


def field_path(loc: Iterable[str | int]) -> str:
    """``("body", "batch", "vectors", 3, "values", 7)`` → ``vectors[3].values[7]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _clean(errors: Sequence[dict]) -> list[dict]:
    """Pydantic errors → ``{"field", "message", "type"}``; inputs and URLs dropped."""
    out = []
    for e in errors[:MAX_DETAILS]:
        loc = list(e.get("loc", ()))
        if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
            where = loc[0]
            loc = loc[1:]
        else:
            where = "body"
        field = field_path(loc) or where
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error")
            msg = f"malformed JSON: {detail}" if detail else "malformed JSON"
        elif e.get("type") == "missing" and field == where:
            msg = "a JSON body is required"
        out.append({"field": field, "message": msg, "type": e.get("type")})
    return out


async def _validation_handler(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    details = _clean(errors)
    first = details[0] if details else {"field": None, "message": "invalid request"}
    message = first["message"]
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return error_response(422, message, field=first["field"], details=details)


async def _api_error_handler(request: Request, exc: ApiError) -> Response:
    details = None
    if exc.status == 422:
        details = [{"field": exc.field, "message": exc.message, "type": exc.code}]
    return error_response(exc.status, exc.message, field=exc.field, code=exc.code,
                          details=details, headers=exc.headers)


async def _vector_error_handler(request: Request, exc: VectorError) -> Response:
    return error_response(422, exc.reason, field=exc.field, code="invalid_vector",
                          details=[{"field": exc.field, "message": exc.reason,
                                    "type": type(exc).__name__}])


async def _unknown_id_handler(request: Request, exc: UnknownIdError) -> Response:
    return error_response(404, f"no vector with id {exc.ext_id!r}", field="id")


async def _filter_error_handler(request: Request, exc: FilterError) -> Response:
    return error_response(422, exc.reason, field=exc.field, code="invalid_filter",
                          details=[{"field": exc.field, "message": exc.reason, "type": "FilterError"}])


async def _unknown_collection_handler(request: Request, exc: UnknownCollection) -> Response:
    return error_response(404, f"no collection named {exc.name!r}", field="collection")


async def _collection_exists_handler(request: Request, exc: CollectionExists) -> Response:
    return error_response(409, f"a collection named {exc.name!r} exists already", field="name")


async def _unavailable_handler(request: Request, exc: Exception) -> Response:
    # The reason (a file path, a host, a driver message) goes to the log, not to the client.
    log.warning("store unavailable on %s %s: %s", request.method, request.url.path, exc)
    return error_response(503, "the index store is unavailable; retry shortly (details are in the server log)",
                          headers={"Retry-After": "1"})


async def _full_handler(request: Request, exc: DiskFull) -> Response:
    log.warning("index full on %s %s: %s", request.method, request.url.path, exc)
    if isinstance(exc, MirrorFull):  # a read that needs a vector the full search mirror cannot take
        field, _, reason = str(exc).partition(": ")
        return error_response(507, reason, field=field)
    if exc.stored:  # a batch Redis took in several scripts: say truthfully what it kept
        return error_response(507, f"the index filled up while writing the batch: {len(exc.stored)} of its vectors "
                              "were stored (their ids are in details), the others were not; reads go on, send the "
                              "batch again once space is freed (an upsert by id is idempotent)",
                              details=[{"field": "id", "message": i, "type": "stored"} for i in exc.stored])
    return error_response(507, "the index cannot take writes: its disk (LMDB) or memory (Redis) is full; "
                          "nothing was written, reads go on, writes resume once space is freed")


async def _conflict_handler(request: Request, exc: ConfigConflict) -> Response:
    return error_response(409, str(exc), field="config", code="config_conflict")


async def _store_error_handler(request: Request, exc: StoreError) -> Response:
    log.error("store error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "storage error (details are in the server log)", code="store_error")


def _allowed_methods(request: Request) -> str | None:
    """Every method some route serves at this path. Starlette's 405 names only the first
    route that matched the path (``GET /vectors/{id}`` hid ``DELETE``), not all of them."""
    from starlette.routing import Match

    methods = {m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
               for route in getattr(request.app, "routes", ())
               if route.matches({**request.scope, "method": m})[0] == Match.FULL}
    return ", ".join(sorted(methods)) if methods else None


async def _http_handler(request: Request, exc: StarletteHTTPException) -> Response:
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        allow = _allowed_methods(request)
        if allow:
            headers = {**(headers or {}), "Allow": allow}
    return error_response(exc.status_code, str(exc.detail), headers=headers,
                          field=getattr(exc, "field", None))


async def _internal_handler(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error (details are in the server log)")


def install_handlers(app: FastAPI) -> None:
    """Register every handler; the most specific exception class wins in Starlette."""
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(VectorError, _vector_error_handler)
    app.add_exception_handler(UnknownIdError, _unknown_id_handler)
    app.add_exception_handler(FilterError, _filter_error_handler)
    app.add_exception_handler(UnknownCollection, _unknown_collection_handler)
    app.add_exception_handler(CollectionExists, _collection_exists_handler)
    app.add_exception_handler(DiskFull, _full_handler)
    app.add_exception_handler(StoreUnavailable, _unavailable_handler)
    app.add_exception_handler(ConfigConflict, _conflict_handler)
    app.add_exception_handler(StoreError, _store_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _internal_handler)
    try:  # a store that lets a raw connection error through is still "down", not a bug
        import redis.exceptions as rx

        app.add_exception_handler(rx.ConnectionError, _unavailable_handler)
        app.add_exception_handler(rx.TimeoutError, _unavailable_handler)
    except ImportError:  # pragma: no cover - redis is a hard dependency
        pass


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route: each error code with the shared error model."""
    text = {
        401: "Missing or wrong API key (only when GMMLSH_API_KEY is set)",
        404: "Unknown id or collection",
        408: "Request body not received within body_timeout seconds",
        409: "A collection of that name exists",
        413: "Request body over max_body_bytes, or more than max_batch vectors/queries",
        422: "Invalid input: field and reason in error.field / error.message",
        500: "Internal error (no traceback; see the server log)",
        503: "The store (LMDB / Redis) cannot be reached",
        507: "The store is full (disk or Redis memory): nothing was written (or, for a batch Redis wrote in "
             "several scripts, the ids it stored are in details)",
    }
    return {c: {"model": ErrorResponse, "description": text.get(c, "Error")} for c in codes}
