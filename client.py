"""A Python client for the gmmlsh REST API (``gmmlsh serve``).

::

    with gmmlsh.Client("http://127.0.0.1:8000", api_key=None) as c:
        c.upsert("a", np.array([...]), metadata={"label": 3})   # or many: ids + 2-D array / sparse matrix
        res = c.query(id="a", k=5)                              # or c.query(vector), c.query_batch(rows)
        print([(n.id, n.similarity) for n in res.neighbors])

It speaks HTTP only (httpx): it imports neither the server nor numba, so it loads in a
fraction of a second and runs wherever numpy and scipy do. Vectors go out in the API's one
shape — dense ``values``, or sparse ``indices`` + ``values`` (a scipy row is sent as its
nonzeros, never densified); a batch of upserts goes as the API's Arrow body and dense
*queries* as its binary body (raw arrays, no decimal text: the fastest paths) — and answers
come back as small frozen dataclasses whose fields are exactly the server's. Every refusal
of the server is raised as :class:`ApiError` carrying the API's ``status``, ``code``,
``field`` and ``message``; a request that gets no HTTP answer at all (connection refused,
DNS, timeout) raises :class:`NoResponseError`.

The result types :class:`Neighbor`, :class:`QueryResult` and :class:`StoredVector` are the
index's own (:mod:`gmmlsh.results`, which needs numpy alone), so an answer has one shape in
process and over HTTP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import quote

import httpx
import numpy as np
import orjson
import scipy.sparse as sp

from gmmlsh.results import Neighbor, QueryResult, StoredVector

__all__ = [
    "Client", "ApiError", "NoResponseError", "Neighbor", "QueryResult", "StoredVector",
    "UpsertResult", "DeleteResult", "Stats", "Health", "arrow_body", "ARROW",
]

#: An id as the API takes it: a string, or an integer (the server stores its decimal string).
Id: TypeAlias = str | int
#: One vector: a 1-D array or list (dense), a 1×d scipy.sparse row, or ``(indices, values)``.
VectorLike: TypeAlias = Any
#: Many vectors: a 2-D array, a scipy.sparse matrix (one vector a row), or a sequence of VectorLike.
RowsLike: TypeAlias = Any

DEFAULT_TIMEOUT = 60.0
_API_KEY_HEADER = "X-API-Key"
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
#: Dense queries go out in the API's binary body: raw little-endian float32 rows, no JSON numbers
#: to write or parse (bench/RESULTS.md, "HTTP").
_BINARY = "application/octet-stream"
#: The media type of a batch upsert's body: an Arrow IPC stream (:func:`arrow_body`).
ARROW = "application/vnd.apache.arrow.stream"
_BODY_FIELD = re.compile(r"^body(?:\[(\d+)\])?$")
# The server's codes for statuses it answers itself; used when an answer is not in its error shape.
_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
          408: "timeout", 409: "conflict", 413: "too_large", 415: "unsupported_media_type", 422: "invalid_request",
          500: "internal_error", 502: "bad_gateway", 503: "unavailable", 504: "gateway_timeout",
          507: "storage_full"}


# --- errors ---------------------------------------------------------------------------------


class ApiError(Exception):
    """The server (or a proxy in front of it) answered with an error status.

    ``status`` is the HTTP status; ``code``, ``field`` and ``message`` are the API's
    ``{"error": {...}}`` body — e.g. 422 ``invalid_vector`` on ``vectors[3].values``, 404
    ``not_found`` on ``id``, 401 ``unauthorized`` on ``X-API-Key`` — and ``details`` lists
    every problem of a 422. An answer that is not in the API's shape (a proxy's 502 page, say)
    still raises this, with the status's usual code, ``field`` None, and the start of the body
    in ``body`` for diagnosis; so does a success answer that is not the API's JSON
    (``code="invalid_response"``).
    """

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 details: Sequence[Mapping[str, Any]] | None = None, body: str | None = None) -> None:
        super().__init__(status, code, message, field)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.details = tuple(details) if details is not None else None
        self.body = body

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.status} {self.code}{where}: {self.message}"

    def __reduce__(self):  # picklable, e.g. across a process pool
        return (type(self), (self.status, self.code, self.message, self.field, self.details, self.body))

    @classmethod
    def from_response(cls, r: httpx.Response) -> ApiError:
        """The API's error body when there is one; otherwise a best account of the answer."""
        try:
            err = orjson.loads(r.content)["error"]
            return cls(int(err.get("status", r.status_code)), str(err["code"]), str(err["message"]),
                       err.get("field"), err.get("details"))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            pass
        text = r.text[:500]
        kind = r.headers.get("content-type", "no content type").split(";")[0]
        reason = r.reason_phrase or "error"
        return cls(r.status_code, _CODES.get(r.status_code, "http_error"),
                   f"HTTP {r.status_code} {reason}, answered in {kind}, not the API's error shape "
                   "(a proxy or another server may have answered)", body=text)


class NoResponseError(ConnectionError):
    """The request got no HTTP answer: connection refused or reset, unknown host, TLS failure,
    or no answer within the client's ``timeout``. The underlying httpx exception is the
    ``__cause__``. A write that timed out may or may not have been applied (upserts are
    idempotent: sending it again is safe)."""


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpsertResult:
    """``upserted``: ids written (an id given twice in a batch counts once: its last vector is
    stored); ``count``: vectors in the index after the write; ``replaced``: how many of the ids
    written held a vector before."""

    upserted: int
    count: int
    replaced: int = 0


@dataclass(frozen=True)
class DeleteResult:
    """``deleted``: 1 (deleting an unknown id raises a 404 instead); ``count``: vectors left."""

    deleted: int
    count: int


@dataclass(frozen=True)
class Stats:
    """``GET /stats``: the number of vectors, the backend, the index's creation parameters
    (``config``, e.g. ``config["dim"]``), the search in use, this machine's search mirror, the
    store, the server's request limits (``service``: ``max_k``, ``max_batch``, ...), and which
    worker process answered (``pid``). ``raw`` is the whole answer, fields added later included."""

    count: int
    backend: str
    pid: int
    config: dict
    search: dict
    mirror: dict
    store: dict
    service: dict
    raw: dict


@dataclass(frozen=True)
class Health:
    """``GET /health``: the server is up and its store answers; ``writable`` says whether writes
    are taken now, ``problem`` why not (a full disk or Redis, an evicting Redis);
    ``search_current`` whether answers cover every acknowledged write, ``search_problem`` why not
    (the server's search mirror has no space left for the latest)."""

    status: str
    backend: str
    writable: bool
    problem: str | None = None
    search_current: bool = True
    search_problem: str | None = None


# --- the client -----------------------------------------------------------------------------


class Client:
    """A connection (pool) to one gmmlsh server.

    ``url`` is the server's base URL (``http://127.0.0.1:8000``, or behind a proxy
    ``https://host/prefix``); ``api_key`` is sent as ``X-API-Key`` (needed only when the server
    runs with ``GMMLSH_API_KEY``); ``timeout`` bounds each request, in seconds (a float, an
    ``httpx.Timeout``, or None for no limit); ``collection`` names the collection it reads and
    writes (its routes under ``/collections/{name}``; None: the server's own). Use it as a context
    manager, or call :meth:`close`, to release its connections.

    Inputs: one vector is a 1-D numpy array or list (dense), a 1×d scipy.sparse row (any
    format; sent as its nonzeros), or an ``(indices, values)`` pair; many vectors are a 2-D
    array, a scipy.sparse matrix, or a list of single vectors. The server checks them (dimension,
    NaN/inf, all-zero, index order) and its refusals come back as :class:`ApiError` naming the
    field as sent, e.g. ``values`` for one vector or ``vectors[2].values`` for the third of a batch.
    """

    def __init__(self, url: str, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT, collection: str | None = None) -> None:
        headers = {"Accept": "application/json", "User-Agent": "gmmlsh-client"}
        if api_key is not None:
            headers[_API_KEY_HEADER] = api_key
        self.url = url.rstrip("/")
        #: The collection this client reads and writes (None: the server's own, ``/vectors`` …).
        self.collection = collection
        self._at = f"/collections/{quote(collection, safe='')}" if collection is not None else ""
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections; the client cannot be used afterwards."""
        self._http.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})" if self.collection is None else \
            f"Client({self.url!r}, collection={self.collection!r})"

    # --- vectors ----------------------------------------------------------------------------

    def upsert(self, ids: Id | Sequence[Id], vectors: VectorLike | RowsLike,
               metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None) -> UpsertResult:
        """Insert or replace vectors by id (``POST /vectors``).

        One: ``upsert("a", vector, metadata={...})``. Many: ``upsert(ids, rows, metadata=[...])``
        with one id (and one metadata dict or None) per row. A batch is all or nothing: if any
        vector is refused, nothing is written and the :class:`ApiError` names it
        (``vectors[i]...``). Metadata is any JSON object; it comes back with every hit.
        """
        if not _is_id(ids):  # many: the Arrow body
            out = self._call("POST", self._at + "/vectors", content=arrow_body(ids, vectors, metadata),
                             content_type=ARROW)
            return UpsertResult(int(out["upserted"]), int(out["count"]), int(out["replaced"]))
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError("metadata of one vector is a dict (or None)")
        body: dict[str, Any] = {"id": ids, **_finite(_vector_body(vectors), "values")}
        if metadata is not None:
            _check_metadata(metadata, "metadata")
            body["metadata"] = metadata
        out = self._call("POST", self._at + "/vectors", body=body)
        return UpsertResult(int(out["upserted"]), int(out["count"]), int(out["replaced"]))

    def get(self, id: Id) -> StoredVector:
        """The stored vector and metadata of an id (``GET /vectors/{id}``); 404 ``ApiError`` if unknown."""
        out = self._call("GET", self._at + _vector_path(id))
        indices = out.get("indices")
        return StoredVector(
            id=out["id"], values=np.asarray(out["values"], dtype=np.float32),
            indices=np.asarray(indices, dtype=np.int64) if indices is not None else None,
            metadata=out.get("metadata"),
        )

    def delete(self, id: Id) -> DeleteResult:
        """Delete an id everywhere (``DELETE /vectors/{id}``); 404 ``ApiError`` if unknown."""
        out = self._call("DELETE", self._at + _vector_path(id))
        return DeleteResult(int(out["deleted"]), int(out["count"]))

    # --- queries ----------------------------------------------------------------------------

    def query(self, vector: VectorLike | None = None, *, id: Id | None = None, k: int | None = None,
              mode: str | None = None, min_similarity: float | None = None, candidates: int | None = None,
              probes: int | None = None, filter: Mapping[str, Any] | None = None) -> QueryResult:
        """Nearest neighbours of a vector, or of a stored ``id`` (which is left out of its own answer).

        Give exactly one of ``vector`` (sent to ``POST /neighbors/search``) or ``id`` (``GET
        /neighbors?id=``). ``k`` (default: the server's ``default_k``), ``mode`` (``auto``, the
        default: the search the index tuned; ``sketch``, ``postings``, ``exact``, ``nrff``),
        ``min_similarity``, ``candidates`` (rerank budget) and
        ``probes`` (lists scanned) are the API's query parameters; None leaves the server's default.
        ``filter``: only neighbours whose metadata pass it (the API's filter, Qdrant's shape).
        """
        knobs = _knobs(k, mode, min_similarity, candidates, probes, filter)
        if (vector is None) == (id is None):
            raise TypeError("give exactly one of a vector or an id")
        if id is not None:
            if not _is_id(id):
                raise TypeError("an id is a string or an integer")
            if filter is not None:
                return _result(self._call("POST", self._at + "/neighbors/search", body={"id": id, **knobs}))
            return _result(self._call("GET", self._at + "/neighbors", params={"id": str(id), **knobs}))
        body = _finite(_vector_body(vector), "values")
        raw = _binary(body["values"][None, :]) if "indices" not in body else None
        if raw is not None:
            return self._binary_search(raw, knobs, batch=False)[0]
        return _result(self._call("POST", self._at + "/neighbors/search", body={**body, **knobs}))

    def query_batch(self, vectors: RowsLike | None = None, *, ids: Sequence[Id] | None = None,
                    k: int | None = None, mode: str | None = None, min_similarity: float | None = None,
                    candidates: int | None = None, probes: int | None = None,
                    filter: Mapping[str, Any] | None = None) -> list[QueryResult]:
        """Many queries in one request (``POST /neighbors/search`` with ``{"queries": [...]}``):
        one per row of ``vectors`` (a 2-D array, a scipy.sparse matrix or a list of vectors), or one
        per stored id of ``ids``; answers in the same order. The options apply to every query.
        A batch holds at most the server's ``max_batch`` queries (413 ``ApiError`` beyond)."""
        knobs = _knobs(k, mode, min_similarity, candidates, probes, filter)
        if (vectors is None) == (ids is None):
            raise TypeError("give exactly one of vectors or ids")
        if ids is not None:
            if _is_id(ids) or not all(_is_id(i) for i in ids):
                raise TypeError("ids is a list of strings or integers")
            queries = [{"id": i} for i in ids]
        else:
            raw = _binary(vectors) if isinstance(vectors, np.ndarray) and vectors.ndim == 2 else None
            if raw is not None:
                return self._binary_search(raw, knobs, batch=True)
            queries = [_finite(q, f"queries[{n}].values") for n, q in enumerate(_rows(vectors))]
        out = self._call("POST", self._at + "/neighbors/search", body={"queries": queries, **knobs})
        return [_result(r) for r in out["results"]]

    def _binary_search(self, raw: bytes, knobs: dict[str, Any], batch: bool) -> list[QueryResult]:
        """Dense rows as a binary body (the knobs in the query string); the server's names for
        the rows of its body (``body[i]``) told as the JSON API's (``values``, ``queries[i].values``)."""
        params = {name: orjson.dumps(v).decode() if name == "filter" else v for name, v in knobs.items()}
        try:
            out = self._call("POST", self._at + "/neighbors/search", params=params, content=raw,
                             content_type=_BINARY)
        except ApiError as exc:
            m = _BODY_FIELD.match(exc.field or "")
            if m is not None:
                exc.field = "queries" if exc.status == 413 else \
                    f"queries[{m.group(1) or 0}].values" if batch else "values"
                exc.details = exc.details and tuple({**d, "field": exc.field} for d in exc.details)
            raise
        return [_result(r) for r in out["results"]]

    # --- operations -------------------------------------------------------------------------

    def stats(self) -> Stats:
        """Index size, parameters and search in use, and the server's limits (``GET /stats``, or
        ``GET /collections/{name}`` for a client of a collection)."""
        out = self._call("GET", self._at or "/stats")
        return Stats(count=int(out["count"]), backend=out["backend"], pid=int(out["pid"]), config=out["config"],
                     search=out["search"], mirror=out["mirror"], store=out["store"], service=out["service"],
                     raw=out)

    def health(self) -> Health:
        """Liveness and store reachability (``GET /health``; needs no API key). A server whose
        store is down answers 503, raised as :class:`ApiError`."""
        out = self._call("GET", "/health")
        return Health(status=out["status"], backend=out["backend"], writable=bool(out["writable"]),
                      problem=out.get("problem"), search_current=bool(out.get("search_current", True)),
                      search_problem=out.get("search_problem"))

    # --- transport --------------------------------------------------------------------------

    def _call(self, method: str, path: str, *, body: Any = None, params: Mapping[str, Any] | None = None,
              content: bytes | None = None, content_type: str | None = None) -> Any:
        """One request (a JSON ``body``, or ``content`` of ``content_type``); the answer's JSON, or
        :class:`ApiError` / :class:`NoResponseError`."""
        headers = {"Content-Type": content_type} if content_type else None
        if body is not None:
            content = orjson.dumps(body, option=_JSON_OPTS)
            headers = {"Content-Type": "application/json"}
        try:
            r = self._http.request(method, path, content=content, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise NoResponseError(f"{method} {self.url}{path}: no answer from the server "
                                  f"({type(exc).__name__}: {exc})") from exc
        if r.status_code >= 400:
            raise ApiError.from_response(r)
        try:
            return orjson.loads(r.content)
        except orjson.JSONDecodeError:
            raise ApiError(r.status_code, "invalid_response",
                           f"HTTP {r.status_code} answered with something other than JSON "
                           "(is the URL a gmmlsh server?)", body=r.text[:500]) from None


# --- conversions ------------------------------------------------------------------------------


def _is_id(x: Any) -> bool:
    return isinstance(x, str | int | np.integer) and not isinstance(x, bool | np.bool_)


def _vector_path(ext_id: Id) -> str:
    """``/vectors/{id}`` with the id percent-encoded, dots and slashes included (so that ``..``
    or ``a/b`` stays one path segment and no URL normalisation drops it)."""
    if not _is_id(ext_id):
        raise TypeError("an id is a string or an integer")
    return "/vectors/" + quote(str(ext_id), safe="").replace(".", "%2E")


def _knobs(k: int | None, mode: str | None, min_similarity: float | None, candidates: int | None,
           probes: int | None, filter: Mapping[str, Any] | None = None) -> dict[str, Any]:
    given = {"k": k, "mode": mode, "min_similarity": min_similarity, "candidates": candidates, "probes": probes,
             "filter": filter}
    return {name: v for name, v in given.items() if v is not None}


def _values(x: Any) -> np.ndarray:
    """Numbers as a C-contiguous array orjson writes natively: float32 kept (exact), else float64."""
    a = np.asarray(x)
    if a.dtype != np.float32:
        a = a.astype(np.float64)
    return np.ascontiguousarray(a)


def _finite(vector: dict[str, Any], field: str) -> dict[str, Any]:
    """``vector`` (a body from :func:`_vector_body` / :func:`_rows`) if its values are finite:
    JSON has no NaN or infinity, and orjson would send them as null, which the server could
    only call "not a valid number"; said here as the server says it of finite-less input."""
    values = vector["values"]
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise ValueError(f"{field}: values must be finite (found NaN or infinity)")
    return vector


def _binary(rows: Any) -> bytes | None:
    """Dense rows as the API's binary body (little-endian float32), or None where that would not
    say the same as JSON: a value float32 cannot hold (the server then names it, from the JSON),
    or rows that are not numbers."""
    a = np.asarray(rows)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0 or a.dtype.kind not in "fiu":
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        a32 = a.astype("<f4")
    if not np.isfinite(a32).all():
        return None
    return a32.tobytes()


def arrow_body(ids: Sequence[Id], vectors: RowsLike,
               metadata: Sequence[Mapping[str, Any] | None] | None = None) -> bytes:
    """Many vectors as the API's Arrow upsert body (``POST /vectors`` with ``Content-Type:``
    :data:`ARROW`): their numbers as raw arrays, not decimal text. What :meth:`Client.upsert`
    sends for a batch; for a writer of its own HTTP. Values keep their dtype (float32, else
    float64), so the server reads what JSON would say; the checks are the batch upsert's."""
    import pyarrow as pa  # here: the client loads without it until a batch is written

    ids = list(ids)
    rows = _rows(vectors)
    if len(rows) != len(ids):
        raise ValueError(f"{len(ids)} ids for {len(rows)} vectors")
    if not all(_is_id(i) for i in ids):
        raise TypeError("ids are strings or integers")
    if metadata is not None and (isinstance(metadata, Mapping) or len(metadata) != len(ids)):
        raise ValueError("metadata of many vectors is a list with one dict (or None) per vector")
    for n, row in enumerate(rows):
        _finite(row, f"vectors[{n}].values")
        if metadata is not None and metadata[n] is not None:
            _check_metadata(metadata[n], f"vectors[{n}].metadata")
    sparse = np.array(["indices" in r for r in rows], dtype=bool)
    columns = {"id": pa.array([str(i) for i in ids], pa.string()),
               "values": _list_array(pa, [r["values"] for r in rows])}
    if sparse.any():
        columns["indices"] = _list_array(pa, [r.get("indices", np.zeros(0, np.int64)) for r in rows], ~sparse)
    if metadata is not None:
        texts = [None if m is None else orjson.dumps(m, option=_JSON_OPTS).decode() for m in metadata]
        columns["metadata"] = pa.array(texts, pa.string())
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    return sink.getvalue().to_pybytes()


def _list_array(pa: Any, arrays: list[np.ndarray], null: np.ndarray | None = None) -> Any:
    """1-D arrays as one Arrow list array (64-bit offsets); rows where ``null`` is True are null."""
    offsets = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrays], dtype=np.int64)])
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat),
                                         mask=None if null is None else pa.array(null))


def _sparse_row(m: Any) -> dict[str, np.ndarray]:
    """A 1×d (or 1-D) scipy.sparse vector → its nonzeros, indices sorted and distinct."""
    if m.ndim == 1:
        m = m.reshape((1, -1))
    if m.shape[0] != 1:
        raise ValueError(f"one vector is one sparse row, got shape {m.shape}")
    return _sparse_rows(m)[0]


def _sparse_rows(m: Any) -> list[dict[str, np.ndarray]]:
    m = sp.csr_matrix(m)  # a copy only when not CSR already
    if not m.has_canonical_format:
        m = m.copy()
        m.sum_duplicates()  # sorts indices and adds up repeated ones, as scipy itself reads them
    indptr, indices, data = m.indptr, m.indices.astype(np.int64), _values(m.data)
    return [{"indices": indices[indptr[i]:indptr[i + 1]], "values": data[indptr[i]:indptr[i + 1]]}
            for i in range(m.shape[0])]


def _vector_body(x: Any) -> dict[str, Any]:
    """One vector in the API's shape: ``{"values"}`` (dense) or ``{"indices", "values"}``."""
    if sp.issparse(x):
        return _sparse_row(x)
    if isinstance(x, tuple) and len(x) == 2:
        indices, values = x
        return {"indices": np.ascontiguousarray(np.asarray(indices, dtype=np.int64)), "values": _values(values)}
    a = _values(x)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise ValueError(f"one vector is 1-D (or one row), got shape {a.shape}; use the batch call for many")
    return {"values": a}


def _rows(x: Any) -> list[dict[str, Any]]:
    """Many vectors (2-D array, sparse matrix, or a list of single vectors) in the API's shape."""
    if sp.issparse(x):
        if x.ndim != 2:
            raise ValueError(f"many vectors are a 2-D sparse matrix, got shape {x.shape}")
        return _sparse_rows(x)
    if isinstance(x, np.ndarray):
        if x.ndim != 2:
            raise ValueError(f"many vectors are a 2-D array (one vector a row), got shape {x.shape}")
        a = _values(x)
        return [{"values": a[i]} for i in range(a.shape[0])]
    if isinstance(x, str | bytes | Mapping) or not isinstance(x, Sequence | np.ndarray):
        raise TypeError(f"many vectors are a 2-D array, a scipy.sparse matrix or a list of vectors, "
                        f"not {type(x).__name__}")
    return [_vector_body(v) for v in x]


def _check_metadata(meta: Any, field: str) -> None:
    """JSON has no NaN/Infinity: orjson would write them as null and the stored metadata would
    silently differ from what was given, so they are refused here (the API refuses them too)."""
    if not isinstance(meta, Mapping):
        raise TypeError(f"{field} is a dict (a JSON object), not {type(meta).__name__}")
    stack: list[Any] = [meta]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{field} holds {v}, which JSON cannot represent")
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)


def _result(r: Mapping[str, Any]) -> QueryResult:
    return QueryResult(mode=r["mode"], k=int(r["k"]), candidates=int(r["candidates"]),
                       neighbors=tuple(Neighbor(n["id"], float(n["similarity"]), n.get("metadata"))
                                       for n in r["neighbors"]))
