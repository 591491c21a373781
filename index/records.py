"""From user input to stored records: validation (once, here), hashing, and the vector codec.

A stored vector blob is ``<f8 norm> <i4 count> <i4 kind>`` followed by its values:
kind 0 is dense (``count`` = dim float32 values); kinds 1 and 2 are sparse
(``count`` int32 indices, then ``count`` float32 values), given sparse (1) or
given dense (2), so that it reads back in the shape it came in. The norm is the
L1 norm of the vector GMM sees (centred, if the index has a centre), so a rerank
never recomputes it.

**Storage follows the data**: a vector is stored sparse when that takes at most
half the bytes of dense (fewer than ``dim/4`` nonzeros), whatever shape it was
given in; nothing on any path densifies a sparse row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import orjson
import scipy.sparse as sp

from gmmlsh.core import gcws
from gmmlsh.core.codes import bbit_codes, bit_planes, pack_codes
from gmmlsh.core.gmm import l1_norms
from gmmlsh.core.nrff import features
from gmmlsh.core.validate import (
    DimensionError,
    NonFiniteError,
    VectorError,
    ZeroVectorError,
    check_batch,
    check_dense,
    check_sparse,
    dense_float32_or_none,
    first_bad_row,
    sparse_float32_or_none,
)
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.store.base import MAX_ID_BYTES, RecordBatch
from gmmlsh.results import StoredVector

DENSE, SPARSE_GIVEN_SPARSE, SPARSE_GIVEN_DENSE = 0, 1, 2
_HEAD = np.dtype([("norm", "<f8"), ("count", "<i4"), ("kind", "<i4")])


def check_id(ext_id, field: str = "id", row: int | None = None) -> str:
    """An external id as stored: a string of 1 to :data:`MAX_ID_BYTES` bytes of UTF-8 (the id
    ``field``, or row ``row`` of the ids ``field``)."""
    if not isinstance(ext_id, str):
        raise VectorError(field, f"ids are strings, got {type(ext_id).__name__}", row=row, part="id")
    if not ext_id or len(ext_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise VectorError(field, f"ids must be 1 to {MAX_ID_BYTES} bytes of UTF-8", row=row, part="id")
    try:
        ext_id.encode("utf-8")
    except UnicodeEncodeError:
        raise VectorError(field, "ids must be valid UTF-8 (no lone surrogates)", row=row, part="id") from None
    return ext_id


def as_stored(X, dim: int, field: str = "vectors"):
    """Validate a batch (dense 2-D array or CSR) and round it to float32, the stored precision.

    Refuses what float32 storage would break in valid float64 input: overflow to
    inf, or a row whose every value underflows to 0. A float32 batch (a bulk load's
    chunks) is already at stored precision: one compiled pass checks it, and it is
    returned as it is.
    """
    if isinstance(X, np.ndarray) and X.dtype == np.float32 and X.ndim == 2 and X.shape[1] == dim > 0:
        X32 = np.ascontiguousarray(X)
        if first_bad_row(X32)[1] == 0:  # all finite, no all-zero row; else the checks below name the row
            return X32
    X = check_batch(X, dim, field=field)
    with np.errstate(over="ignore"):
        if sp.issparse(X):
            X32 = sp.csr_matrix(X, dtype=np.float32)
            values = X32.data
            row_of = np.repeat(np.arange(X32.shape[0]), np.diff(X32.indptr))
            rows_nonzero = np.bincount(row_of[values != 0], minlength=X32.shape[0]) > 0
        else:
            X32 = X.astype(np.float32)
            values, rows_nonzero = X32, X32.any(axis=1)
    finite = np.isfinite(values)
    if not finite.all():
        pos = int(np.flatnonzero(~finite.ravel())[0])
        bad = np.searchsorted(X32.indptr, pos, "right") - 1 if sp.issparse(X32) else pos // dim
        raise NonFiniteError(field, "a value overflows float32, the stored precision", row=int(bad), part="values")
    if not rows_nonzero.all():
        raise ZeroVectorError(field, "all values underflow to 0 in float32, the stored precision",
                              row=int(np.flatnonzero(~rows_nonzero)[0]), part="values")
    if sp.issparse(X32):
        X32.eliminate_zeros()
    return X32


class SparseRow(NamedTuple):
    """One validated sparse vector at stored precision (int32 indices, sorted; float32 values,
    nonzero), standing for a 1-row CSR batch where a query needs no more: building the CSR
    matrix cost more than the rest of a text query's preparation."""

    indices: np.ndarray
    values: np.ndarray
    dim: int

    @property
    def shape(self) -> tuple[int, int]:
        return 1, self.dim

    def csr(self) -> sp.csr_matrix:
        return sp.csr_matrix((self.values, self.indices, np.array([0, self.indices.shape[0]], np.int32)),
                             shape=(1, self.dim))

    def dense(self) -> np.ndarray:
        """The row scattered into zeros, ``(1, dim)`` float32."""
        row = np.zeros((1, self.dim), dtype=np.float32)
        row[0, self.indices] = self.values
        return row


def query_rows(vector, dim: int):
    """One query vector — dense, ``(indices, values)`` or a 1-row CSR — validated and at stored
    precision, as a 1-row batch of its own (new arrays): dense (1, dim), a CSR matrix, or a
    :class:`SparseRow`. A clean 1-D float array, or clean sparse arrays, take one compiled pass."""
    fast = dense_float32_or_none(vector, dim)
    if fast is not None:
        return fast[None, :]
    if isinstance(vector, tuple) and len(vector) == 2:
        pair = sparse_float32_or_none(vector[0], vector[1], dim)
    elif sp.issparse(vector) and vector.format == "csr" and vector.shape == (1, dim):
        pair = sparse_float32_or_none(vector.indices, vector.data, dim)
    else:
        pair = None
    if pair is not None:
        return SparseRow(pair[0], pair[1], dim)
    if isinstance(vector, tuple) and len(vector) == 2:
        idx, val = check_sparse(vector[0], vector[1], dim, field="vector")
        X = sp.csr_matrix((val, idx, [0, idx.size]), shape=(1, dim))
    elif sp.issparse(vector):
        if vector.shape[0] != 1:
            raise VectorError("vector", f"expected one row, got {vector.shape[0]}", part="values")
        X = vector
    else:
        X = check_dense(vector, dim, field="vector")[None, :]
    return as_stored(X, dim, "vector")


def as_hashed(X32, config: IndexConfig):
    """Stored values as sketches and norms see them: the centre subtracted, if any (then dense)."""
    if config.center is None:
        return X32  # the kernels widen float32 to float64 themselves
    dense = X32.toarray() if sp.issparse(X32) else X32
    Xc = dense.astype(np.float64) - np.asarray(config.center, dtype=np.float64)
    empty = np.flatnonzero(~Xc.any(axis=1))
    if empty.size:
        raise ZeroVectorError("vectors", "equals the index centre: nothing to sample", row=int(empty[0]), part="values")
    return Xc


def codes_of(Xh, config: IndexConfig) -> np.ndarray:
    """b-bit codes (n, k) of hashable rows (see :func:`as_hashed`)."""
    if config.t_bits:
        istar, tstar = gcws.sketch(Xh, config.samples, config.seed, return_t=True, check=False)
    else:
        istar, tstar = gcws.sketch(Xh, config.samples, config.seed, check=False), None
    return bbit_codes(istar, config.bits, config.seed, tstar, config.t_bits)


def planes_of(Xh, config: IndexConfig) -> np.ndarray:
    """Bit planes of hashable rows' codes: ``bit_planes(codes_of(Xh, config), config.bits)``,
    in one compiled call where the rows allow it (:func:`~gmmlsh.core.gcws.sketch_planes`)."""
    if config.t_bits:
        return bit_planes(codes_of(Xh, config), config.bits)
    return gcws.sketch_planes(Xh, config.samples, config.seed, config.bits)


def encode_meta(metadata: Sequence[dict | None] | None, n: int) -> list[bytes | None] | None:
    """Metadata as JSON bytes, or None when no row has any."""
    if metadata is None:
        return None
    if len(metadata) != n:
        raise VectorError("metadata", f"{len(metadata)} entries for {n} vectors")
    out = []
    for j, m in enumerate(metadata):
        if m is not None and not isinstance(m, dict):
            raise VectorError("metadata", "must be a JSON object or null", row=j, part="metadata")
        try:
            out.append(orjson.dumps(m) if m is not None else None)
        except TypeError as exc:
            raise VectorError("metadata", f"not JSON-serialisable ({exc})", row=j, part="metadata") from None
    return out if any(m is not None for m in out) else None


def prepare(config: IndexConfig, ids: Sequence[str], X, metadata: Sequence[dict | None] | None = None
            ) -> RecordBatch:
    """Validate and hash rows into records; touches no store. Raises :class:`VectorError`
    naming the first bad field (``ids[i]``, ``metadata[i]``, ``vectors[i]``)."""
    ids = [check_id(i, "ids", n) for n, i in enumerate(ids)]
    n = X.shape[0] if hasattr(X, "shape") and np.ndim(X) == 2 else len(X)
    if len(ids) != n:
        raise VectorError("ids", f"{len(ids)} ids for {n} vectors")
    meta = encode_meta(metadata, n)
    if n == 0:
        return RecordBatch(ids=[], vectors=[], sketches=np.zeros((0, config.sketch_bytes), np.uint8))
    X32 = as_stored(X, config.dim)
    Xh = as_hashed(X32, config)
    codes = codes_of(Xh, config)
    feats = None
    if config.nrff_k:
        feats = features(Xh, config.nrff_k, config.gamma, config.seed).astype(np.float32)
    return RecordBatch(ids=ids, vectors=encode_vectors(X32, l1_norms(Xh)), sketches=pack_codes(codes, config.bits),
                       nrff=feats, meta=meta)


def prepare_rows(config: IndexConfig, ids: Sequence[str], rows: Sequence, metadata: Sequence[dict | None] | None = None
                 ) -> RecordBatch:
    """:func:`prepare` for rows given one by one, each dense (a sequence of ``dim`` numbers) or
    sparse (an ``(indices, values)`` pair), as a request mixes them: each row is stored, and
    read back, in the shape it came in. Dense and sparse rows are prepared apart and merged in
    the given order; an error names the row by its place among ``rows``."""
    n = len(rows)
    if len(ids) != n:
        raise VectorError("ids", f"{len(ids)} ids for {n} vectors")
    if metadata is not None and len(metadata) != n:
        raise VectorError("metadata", f"{len(metadata)} entries for {n} vectors")
    sparse = [isinstance(r, tuple) for r in rows]
    parts = []
    for shape, rows_of in ((False, _dense_rows), (True, _sparse_rows)):
        at = [i for i in range(n) if sparse[i] == shape]
        if not at:
            continue
        meta = [metadata[i] for i in at] if metadata is not None else None
        try:
            parts.append((at, prepare(config, [ids[i] for i in at], rows_of([rows[i] for i in at], config.dim),
                                      meta if meta is not None and any(m is not None for m in meta) else None)))
        except VectorError as exc:
            raise exc.at(at[exc.row] if exc.row is not None else None) from None
    return _merged(parts, n) if parts else prepare(config, [], np.zeros((0, config.dim)))


def _dense_rows(rows: list, dim: int) -> np.ndarray:
    """Dense rows as one matrix; a row of another length is named before numpy sees the ragged list."""
    for i, r in enumerate(rows):
        if len(r) != dim:
            raise DimensionError("vectors", f"expected {dim} values, got {len(r)}", row=i, part="values")
    return np.array(rows, dtype=np.float64).reshape(len(rows), dim)


def _sparse_rows(rows: list[tuple], dim: int) -> sp.csr_matrix:
    """Sparse rows as CSR. Their structure (sorted, distinct, in range, paired with values) is
    checked here, row by row: a CSR matrix cannot say how the rows were given."""
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    cols, data = [], []
    for i, (indices, values) in enumerate(rows):
        idx, val = check_sparse(indices, values, dim, field="vectors", row=i)
        cols.append(idx)
        data.append(val)
        indptr[i + 1] = indptr[i] + idx.size
    return sp.csr_matrix((np.concatenate(data), np.concatenate(cols), indptr), shape=(len(rows), dim))


def _merged(parts: list[tuple[list[int], RecordBatch]], n: int) -> RecordBatch:
    """Prepared batches of some rows each, as one batch of ``n`` rows in the given order."""
    if len(parts) == 1:
        return parts[0][1]
    first = parts[0][1]
    ids: list[str] = [""] * n
    blobs: list[bytes] = [b""] * n
    sketches = np.empty((n, *first.sketches.shape[1:]), first.sketches.dtype)
    nrff = np.empty((n, *first.nrff.shape[1:]), first.nrff.dtype) if first.nrff is not None else None
    meta: list[bytes | None] | None = [None] * n if any(b.meta is not None for _, b in parts) else None
    for at, b in parts:
        for j, i in enumerate(at):
            ids[i], blobs[i] = b.ids[j], b.vectors[j]
            if meta is not None and b.meta is not None:
                meta[i] = b.meta[j]
        sketches[at] = b.sketches
        if nrff is not None:
            nrff[at] = b.nrff
    return RecordBatch(ids=ids, vectors=blobs, sketches=sketches, nrff=nrff, meta=meta)


# --- the vector codec ----------------------------------------------------------------------


def encode_vectors(X32, norms: np.ndarray) -> list[bytes]:
    """One blob per row of a float32 dense array or CSR matrix (see the module docstring)."""
    n, dim = X32.shape
    if sp.issparse(X32):
        indptr, indices, data = X32.indptr, X32.indices, X32.data
        nnz = np.diff(indptr)
        given = SPARSE_GIVEN_SPARSE
    else:
        nnz = np.count_nonzero(X32, axis=1)
        indptr = indices = data = None
        given = SPARSE_GIVEN_DENSE
    sparse_rows = 4 * nnz < dim
    out: list[bytes] = [b""] * n
    dense = np.flatnonzero(~sparse_rows)
    if dense.shape[0]:  # one structured array for all dense rows: no Python work per value
        rec = np.empty(dense.shape[0], dtype=[*(_HEAD.descr), ("values", "<f4", (dim,))])  # every byte set below
        rec["norm"], rec["count"], rec["kind"] = norms[dense], dim, DENSE
        rec["values"] = X32[dense].toarray() if indptr is not None else X32[dense]
        for v, blob in zip(dense.tolist(), rec.view(np.dtype((np.void, rec.dtype.itemsize))).tolist(), strict=True):
            out[v] = blob  # (each record as bytes, copied once)
    head = np.zeros(1, dtype=_HEAD)
    for v in np.flatnonzero(sparse_rows).tolist():
        if indptr is not None:
            idx, val = indices[indptr[v]:indptr[v + 1]], data[indptr[v]:indptr[v + 1]]
        else:
            idx = np.flatnonzero(X32[v])
            val = X32[v, idx]
        head["norm"], head["count"], head["kind"] = norms[v], idx.shape[0], given
        out[v] = head.tobytes() + idx.astype("<i4").tobytes() + val.astype("<f4").tobytes()
    return out


def decode_vector(blob: bytes) -> tuple[float, int, np.ndarray | None, np.ndarray]:
    """(norm, kind, indices or None, float32 values) of one blob."""
    head = np.frombuffer(blob, dtype=_HEAD, count=1)[0]
    count, kind = int(head["count"]), int(head["kind"])
    if kind == DENSE:
        return float(head["norm"]), kind, None, np.frombuffer(blob, "<f4", count, _HEAD.itemsize)
    idx = np.frombuffer(blob, "<i4", count, _HEAD.itemsize)
    return float(head["norm"]), kind, idx, np.frombuffer(blob, "<f4", count, _HEAD.itemsize + 4 * count)


def stored_payloads(blobs: list[bytes], config: IndexConfig) -> tuple[np.ndarray, list[np.ndarray]]:
    """(norms, the uint32 words each row keeps in a search mirror: ``count``, ``kind``, values) of
    stored vector blobs, as GMM sees them: the blob after its norm, or, where the index has a
    centre, the centred vector, dense."""
    center = config.center
    if center is None:
        return (np.frombuffer(b"".join([b[:8] for b in blobs]), "<f8"),
                [np.frombuffer(b, np.uint32, offset=8) for b in blobs])
    norms, payloads = np.empty(len(blobs)), []
    for t, blob in enumerate(blobs):
        norms[t], _, idx, val = decode_vector(blob)
        dense = np.zeros(config.dim, np.float64)
        if idx is None:
            dense[:] = val
        else:
            dense[idx] = val
        out = np.empty(config.dim + 2, np.uint32)
        out[0], out[1] = config.dim, DENSE
        out[2:].view(np.float32)[:] = dense - np.asarray(center)
        payloads.append(out)
    return norms, payloads


def mirror_row(voff: np.ndarray, vi: np.ndarray, vf: np.ndarray, row: int, dim: int) -> np.ndarray:
    """Mirror row ``row`` of the vectors column (the words :func:`stored_payloads` wrote) as a
    dense float64 vector of ``dim`` values: the one place Python reads that layout (the
    kernels' is :func:`gmmlsh.core.search.row_gmm`)."""
    off = int(voff[row])
    count, kind = int(vi[off]), int(vi[off + 1])
    dense = np.zeros(dim)
    if kind == DENSE:
        dense[:] = vf[off + 2:off + 2 + count]
    else:
        dense[vi[off + 2:off + 2 + count]] = vf[off + 2 + count:off + 2 + 2 * count]
    return dense


def as_given(ext_id: str, blob: bytes, dim: int, meta: bytes | None) -> StoredVector:
    """A stored vector in the shape it was given in: dense values, or sparse indices + values."""
    _, kind, idx, val = decode_vector(blob)
    metadata = orjson.loads(meta) if meta else None
    if kind == SPARSE_GIVEN_SPARSE:
        return StoredVector(ext_id, val.copy(), idx.astype(np.int64), metadata)
    if kind == SPARSE_GIVEN_DENSE:
        dense = np.zeros(dim, dtype=np.float32)
        dense[idx] = val
        return StoredVector(ext_id, dense, None, metadata)
    return StoredVector(ext_id, val.copy(), None, metadata)


def decode_rows(blobs: list[bytes], dim: int) -> tuple[sp.csr_matrix | np.ndarray, np.ndarray]:
    """Blobs → (rows as stored precision: dense float32 array if all are dense, else CSR; norms)."""
    parts = [decode_vector(b) for b in blobs]
    norms = np.array([p[0] for p in parts], dtype=np.float64)
    if all(p[1] == DENSE for p in parts):
        X = np.vstack([p[3] for p in parts]) if parts else np.zeros((0, dim), np.float32)
        return X, norms
    indptr = np.zeros(len(parts) + 1, dtype=np.int64)
    cols, vals = [], []
    for v, (_, kind, idx, val) in enumerate(parts):
        if kind == DENSE:
            idx = np.flatnonzero(val)
            val = val[idx]
        cols.append(idx)
        vals.append(val)
        indptr[v + 1] = indptr[v] + idx.shape[0]
    X = sp.csr_matrix((np.concatenate(vals), np.concatenate(cols), indptr), shape=(len(parts), dim))
    return X, norms
