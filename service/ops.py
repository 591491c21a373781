"""The blocking half of each endpoint: parse, validate, call the index, shape the answer.

Everything here runs in a worker thread (``run_in_threadpool``), never on the
event loop: JSON parsing of a large batch, numpy conversion, hashing (numba,
GIL released) and store I/O are all CPU- or I/O-heavy. Vectors are checked here,
before the index is called, so errors name the field the client sent
(``vectors[3].indices``, ``queries[1].vector``) and nothing is written when any
vector of a batch is bad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import scipy.sparse as sp
from fastapi.exceptions import RequestValidationError
from gmmlsh.core.validate import (
    DimensionError,
    VectorError,
    ZeroVectorError,
    check_dense,
    check_sparse,
)
from gmmlsh.index.index import Index, QueryResult, UnknownIdError
from gmmlsh.service.errors import ApiError
from gmmlsh.service.schemas import (
    SEARCH_BODY,
    UPSERT_BODY,
    QueryParams,
    SearchBatch,
    SearchQuery,
    VectorBatch,
    VectorIn,
)
from gmmlsh.service.settings import Settings
from pydantic import TypeAdapter, ValidationError


def parse_body(adapter: TypeAdapter, body: bytes) -> Any:
    """Bytes → model in one pass; errors become the usual 422 (input never echoed)."""
    if not body.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "a JSON body is required"}])
    try:
        return adapter.validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=True)
        for e in errors:
            e["loc"] = ("body", *e["loc"])
        raise RequestValidationError(errors) from None


def _reprefix(exc: VectorError, prefix: str) -> VectorError:
    """``core.validate`` names the field bare (``values``); name it in full."""
    if prefix and not exc.field.startswith(prefix):
        return type(exc)(prefix + exc.field, exc.reason)
    return exc


# --- upsert -------------------------------------------------------------------------


def _check_row(v: VectorIn, dim: int, prefix: str):
    try:
        if v.indices is None:
            return None, check_dense(v.values, dim, field="values")
        return check_sparse(v.indices, v.values, dim, field="indices")
    except VectorError as exc:
        raise _reprefix(exc, prefix) from None


def _dense_matrix(vectors: list[VectorIn], dim: int, where) -> np.ndarray:
    """All-dense batch: lengths checked first (a ragged list is no matrix), then one
    vectorised pass; the first bad row is re-checked alone for a precise message."""
    for i, v in enumerate(vectors):
        if len(v.values) != dim:
            raise DimensionError(f"{where(i)}values",
                                 f"expected {dim} values, got {len(v.values)}")
    A = np.array([v.values for v in vectors], dtype=np.float64).reshape(len(vectors), dim)
    bad = ~np.isfinite(A).all(axis=1) | ~A.any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _check_row(vectors[i], dim, where(i))
        raise ZeroVectorError(f"{where(i)}values", "invalid vector")  # pragma: no cover
    return A


def _sparse_matrix(vectors: list[VectorIn], dim: int, where) -> sp.csr_matrix:
    indptr = np.zeros(len(vectors) + 1, dtype=np.int64)
    cols, data = [], []
    for i, v in enumerate(vectors):
        idx, val = _check_row(v, dim, where(i))
        if idx is None:
            idx = np.flatnonzero(val)
            val = val[idx]
        else:
            keep = val != 0
            idx, val = idx[keep], val[keep]
        cols.append(idx)
        data.append(val)
        indptr[i + 1] = indptr[i] + idx.size
    return sp.csr_matrix(
        (np.concatenate(data), np.concatenate(cols), indptr), shape=(len(vectors), dim)
    )


def _check_metadata(meta: dict, limit: int, field: str) -> None:
    """Metadata comes back with every hit, so its size is capped; NaN/Infinity (which
    the lenient body parser lets through) would be stored as null: refused instead."""
    try:
        size = len(orjson.dumps(meta))
    except TypeError as exc:  # e.g. an integer beyond 64 bits
        raise ApiError(422, f"not storable as JSON ({exc})", field=field) from None
    if size > limit:
        raise ApiError(422, f"{size} bytes as JSON; the limit is {limit} (max_metadata_bytes)", field=field)
    stack: list = [meta]
    while stack:
        x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            raise ApiError(422, f"{x} is not a JSON number", field=field)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def upsert(index: Index, settings: Settings, body: bytes) -> dict:
    parsed = parse_body(UPSERT_BODY, body)
    if isinstance(parsed, VectorBatch):
        vectors = parsed.vectors

        def where(i: int) -> str:
            return f"vectors[{i}]."
    else:
        vectors = [parsed]

        def where(i: int) -> str:
            return ""
    if len(vectors) > settings.max_batch:
        raise ApiError(413, f"{len(vectors)} vectors in one request; the limit is "
                       f"{settings.max_batch} (max_batch)", field="vectors")
    dim = index.config.dim
    if all(v.indices is None for v in vectors):
        X: Any = _dense_matrix(vectors, dim, where)
    else:
        X = _sparse_matrix(vectors, dim, where)
    ids = [v.id for v in vectors]
    meta = [v.metadata for v in vectors]
    for i, m in enumerate(meta):
        if m is not None:
            _check_metadata(m, settings.max_metadata_bytes, f"{where(i)}metadata")
    n = index.upsert(ids, X, meta if any(m is not None for m in meta) else None)
    return {"upserted": int(n), "count": int(index.count())}


# --- get / delete -------------------------------------------------------------------


def get_vector(index: Index, ext_id: str) -> dict:
    sv = index.get(ext_id)
    return {
        "id": sv.id,
        "values": np.ascontiguousarray(sv.values),
        "indices": None if sv.indices is None else np.ascontiguousarray(sv.indices),
        "metadata": sv.metadata,
    }


def delete_vector(index: Index, ext_id: str) -> dict:
    if index.delete([ext_id]) == 0:
        raise UnknownIdError(ext_id)
    return {"deleted": 1, "count": int(index.count())}


# --- queries ------------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    k: int
    mode: str
    min_similarity: float
    candidates: int | None
    bands: int | None


def resolve_knobs(index: Index, settings: Settings, q: QueryParams,
                  base: QueryParams | None = None, prefix: str = "") -> Knobs:
    """Per-query value, else the batch's, else the server default; limits checked here."""

    def pick(name: str) -> Any:
        v = getattr(q, name)
        return getattr(base, name) if v is None and base is not None else v

    k = pick("k") or settings.default_k
    if k > settings.max_k:
        raise ApiError(422, f"k={k} is over the limit of {settings.max_k} (max_k)",
                       field=prefix + "k")
    mode = pick("mode") or "lsh"
    if mode == "nrff" and not index.config.nrff_k:
        raise ApiError(422, "this index stores no NRFF features (created with nrff_k=0)",
                       field=prefix + "mode")
    candidates = pick("candidates")
    if candidates is not None and candidates > settings.max_candidates:
        raise ApiError(422, f"candidates={candidates} is over the limit of "
                       f"{settings.max_candidates} (max_candidates)", field=prefix + "candidates")
    bands = pick("bands")
    if bands is not None and bands > index.config.bands:
        raise ApiError(422, f"bands={bands} but the index has {index.config.bands} bands",
                       field=prefix + "bands")
    ms = pick("min_similarity")
    return Knobs(int(k), mode, float(ms) if ms is not None else 0.0, candidates, bands)


def query_vector(index: Index, q: SearchQuery, prefix: str = "") -> tuple[str, Any]:
    """``("id", id)`` or ``("vector", dense | (indices, values))``, validated."""
    given = [name for name in ("id", "vector", "indices") if getattr(q, name) is not None]
    if q.values is not None and q.indices is None:
        raise ApiError(422, "values without indices: send a dense query as vector, a sparse "
                       "one as indices + values", field=prefix + "values")
    if len(given) != 1:
        raise ApiError(422, "give exactly one of id, vector, or indices + values"
                       + (f" (got {', '.join(given)})" if given else ""),
                       field=prefix + (given[-1] if given else "vector"))
    dim = index.config.dim
    try:
        if q.id is not None:
            return "id", q.id
        if q.vector is not None:
            return "vector", check_dense(q.vector, dim, field="vector")
        if q.values is None:
            raise ApiError(422, "indices without values", field=prefix + "values")
        return "vector", check_sparse(q.indices, q.values, dim, field="indices")
    except VectorError as exc:
        raise _reprefix(exc, prefix) from None


def result_dict(r: QueryResult) -> dict:
    return {
        "mode": r.mode,
        "k": r.k,
        "candidates": int(r.candidates),
        "neighbors": [
            {"id": n.id, "similarity": float(n.similarity), "metadata": n.metadata}
            for n in r.neighbors
        ],
    }


def run_query(index: Index, kind: str, target: Any, knobs: Knobs, prefix: str = "") -> QueryResult:
    kw = {"k": knobs.k, "mode": knobs.mode, "min_similarity": knobs.min_similarity,
          "candidates": knobs.candidates, "bands": knobs.bands}
    try:
        if kind == "id":
            return index.query(id=target, **kw)
        return index.query(target, **kw)
    except UnknownIdError:
        raise ApiError(404, f"no vector with id {target!r}", field=prefix + "id") from None
    except VectorError as exc:
        raise _reprefix(exc, prefix) from None


def parse_dense_param(text: str) -> list[float]:
    """``GET /neighbors?vector=0.1,0.2,...`` → floats (NaN/inf pass here, refused later)."""
    parts = [p for p in text.replace(" ", "").split(",")]
    try:
        return [float(p) for p in parts]
    except ValueError:
        bad = next(i for i, p in enumerate(parts) if not _is_float(p))
        raise ApiError(422, f"position {bad} is not a number; vector is a comma-separated list "
                       "of numbers", field="vector") from None


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def neighbors_get(index: Index, settings: Settings, params: QueryParams,
                  ext_id: str | None, vector: str | None) -> tuple[dict, QueryResult]:
    try:
        q = SearchQuery(id=ext_id, vector=parse_dense_param(vector) if vector is not None else None)
    except ValidationError as exc:  # e.g. an id under 512 characters but over 511 bytes
        errors = exc.errors(include_url=False, include_input=False, include_context=True)
        for e in errors:
            e["loc"] = ("query", *e["loc"])
        raise RequestValidationError(errors) from None
    kind, target = query_vector(index, q)
    knobs = resolve_knobs(index, settings, params)
    r = run_query(index, kind, target, knobs)
    return result_dict(r), r


def search(index: Index, settings: Settings, body: bytes) -> tuple[dict, list[QueryResult]]:
    parsed = parse_body(SEARCH_BODY, body)
    if not isinstance(parsed, SearchBatch):
        kind, target = query_vector(index, parsed)
        r = run_query(index, kind, target, resolve_knobs(index, settings, parsed))
        return result_dict(r), [r]
    queries = parsed.queries
    if len(queries) > settings.max_batch:
        raise ApiError(413, f"{len(queries)} queries in one request; the limit is "
                       f"{settings.max_batch} (max_batch)", field="queries")
    resolved = []
    for i, q in enumerate(queries):
        prefix = f"queries[{i}]."
        kind, target = query_vector(index, q, prefix)
        resolved.append((kind, target, resolve_knobs(index, settings, q, parsed, prefix), prefix))
    knobs = {r[2] for r in resolved}
    dense = all(kind == "vector" and isinstance(t, np.ndarray) for kind, t, _, _ in resolved)
    if dense and len(knobs) == 1 and len(resolved) > 1:
        # One call for the whole batch: the index hashes all queries together.
        kn = resolved[0][2]
        results = index.query_batch(
            np.stack([t for _, t, _, _ in resolved]), k=kn.k, mode=kn.mode,
            min_similarity=kn.min_similarity, candidates=kn.candidates, bands=kn.bands,
        )
    else:
        results = [run_query(index, kind, t, kn, p) for kind, t, kn, p in resolved]
    return {"results": [result_dict(r) for r in results]}, results
