"""Input validation in one place, with typed errors that name the field and the problem.

Every entry point (the index, the REST API, the file builder) funnels vectors
through these functions, so a bad vector is refused the same way everywhere and
before anything is written.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp
from numba import njit

#: The parts of a vector (and of a row of a batch) an error can be in, as the API names them.
PARTS = ("values", "indices", "id", "metadata")


class VectorError(ValueError):
    """A vector that gmmlsh cannot hash or compare, or another argument it refuses.

    ``field`` names the culprit (``vectors[3]``, ``vectors[3].indices``, ``ids[3]``, ``k``);
    the error also carries it in parts, so that a caller names it as its own input does
    without parsing the text: ``name`` (the argument: ``vectors``, ``ids``, ``metadata``,
    ``vector``, ``k``, ...), ``row`` (the row of a batch, None for a single vector or the whole
    argument) and ``part`` (one of :data:`PARTS`: which part of the vector or row; None when
    the problem is not in one).
    """

    def __init__(self, name: str, reason: str, *, row: int | None = None, part: str | None = None):
        if part is not None and part not in PARTS:
            raise ValueError(f"part: expected one of {PARTS}, got {part!r}")
        self.name, self.reason, self.row, self.part = name, reason, row, part
        self.field = name if row is None else f"{name}[{row}]" + (".indices" if part == "indices" else "")
        super().__init__(f"{self.field}: {reason}")

    def at(self, row: int | None, name: str | None = None) -> VectorError:
        """The same error at another row (and argument name): a part of a batch checked alone,
        named by its place in the whole."""
        return type(self)(name or self.name, self.reason, row=row, part=self.part)

    def __reduce__(self):  # picklable (the keyword arguments are not in ``args``)
        return _rebuild, (type(self), self.name, self.reason, self.row, self.part)


def _rebuild(cls: type[VectorError], name: str, reason: str, row: int | None, part: str | None) -> VectorError:
    return cls(name, reason, row=row, part=part)


class DimensionError(VectorError):
    """Wrong length, or a sparse index outside [0, dim)."""


class NonFiniteError(VectorError):
    """NaN or +/-inf among the values."""


class ZeroVectorError(VectorError):
    """All-zero vector: GMM is 0/0 and GCWS has no sample to draw."""


class SparseIndexError(VectorError):
    """Sparse indices that are unsorted, duplicated, negative or mismatched with values."""


def check_dense(values, dim: int | None = None, field: str = "values") -> np.ndarray:
    """Validate one dense vector; returns it as a contiguous float64 array."""
    try:
        v = np.ascontiguousarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise VectorError(field, f"not a list of numbers ({exc})", part="values") from None
    if v.ndim != 1:
        raise DimensionError(field, f"expected a 1-D vector, got shape {v.shape}", part="values")
    if dim is not None and v.shape[0] != dim:
        raise DimensionError(field, f"expected {dim} values, got {v.shape[0]}", part="values")
    if v.shape[0] == 0:
        raise DimensionError(field, "empty vector", part="values")
    if not np.isfinite(v).all():
        bad = int(np.flatnonzero(~np.isfinite(v))[0])
        raise NonFiniteError(field, f"value at position {bad} is {float(v[bad])}; values must be finite",
                             part="values")
    if not v.any():
        raise ZeroVectorError(field, "all-zero vector: GMM is undefined (0/0) for it", part="values")
    return v


@njit(nogil=True, cache=True)
def _round_to_float32(v, out):
    """``out[:] = float32(v)``; True when every value stays finite and one stays nonzero."""
    nonzero = False
    for i in range(v.shape[0]):
        y = np.float32(v[i])
        if not np.isfinite(y):
            return False
        out[i] = y
        nonzero |= y != 0
    return nonzero


def dense_float32_or_none(values, dim: int) -> np.ndarray | None:
    """A valid dense query as float32 (its stored precision) in one compiled pass, or None.

    The fast path for the common query (a 1-D float32/float64 array of the right
    length): :func:`check_dense` and the batch checks are many small numpy calls, a
    large share of a query's Python time (docs/tuning.md). None means "not clearly
    valid": the caller runs the full checks, which name the problem.
    """
    if not (isinstance(values, np.ndarray) and values.ndim == 1 and values.shape[0] == dim
            and values.dtype in (np.float32, np.float64)):
        return None
    out = np.empty(dim, dtype=np.float32)
    return out if _round_to_float32(values, out) else None


@njit(nogil=True, cache=True)
def _sparse_to_float32(idx, val, dim, out_idx, out_val):
    """Copy a sparse vector as int32 indices and float32 values; True when its indices are in
    range and strictly increasing and every value stays finite and nonzero in float32."""
    last = -1
    for p in range(idx.shape[0]):
        i = np.int64(idx[p])
        y = np.float32(val[p])
        if i <= last or i >= dim or not np.isfinite(y) or y == 0:
            return False
        out_idx[p] = np.int32(i)
        out_val[p] = y
        last = i
    return idx.shape[0] > 0


def sparse_float32_or_none(indices, values, dim: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A valid sparse query as (int32 indices, float32 values) in one compiled pass, or None.

    The fast path of the common sparse query (integer indices, sorted, no stored zeros):
    validating it through scipy is a large share of a text query's Python time
    (docs/tuning.md). None means "not clearly valid": the caller runs the full checks, which
    name the problem."""
    if not (isinstance(indices, np.ndarray) and isinstance(values, np.ndarray) and indices.ndim == values.ndim == 1
            and indices.shape == values.shape and indices.dtype.kind in "iu" and values.dtype.kind == "f"):
        return None
    out_idx, out_val = np.empty(indices.shape[0], np.int32), np.empty(indices.shape[0], np.float32)
    return (out_idx, out_val) if _sparse_to_float32(indices, values, dim, out_idx, out_val) else None


def check_sparse(indices, values, dim: int | None, field: str = "vector", row: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Validate one sparse vector (row ``row`` of a batch ``field``, or the vector ``field``);
    returns (int64 indices, float64 values). An error's ``part`` says which list is at fault."""

    def bad(kind: type[VectorError], reason: str, part: str = "indices") -> VectorError:
        return kind(field, reason, row=row, part=part)

    try:
        idx = np.asarray(indices)
        val = np.ascontiguousarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise bad(VectorError, f"not a list of numbers ({exc})") from None
    if idx.ndim != 1 or val.ndim != 1:
        raise bad(SparseIndexError, "indices and values must be flat lists")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        try:
            as_float = idx.astype(np.float64)
        except (TypeError, ValueError):  # text, objects
            raise bad(SparseIndexError, "indices must be integers") from None
        if not np.all(np.isfinite(as_float)) or np.any(as_float != np.round(as_float)):
            raise bad(SparseIndexError, "indices must be integers")
        if np.any(np.abs(as_float) >= 2.0**63):
            raise bad(SparseIndexError, f"index {float(as_float[np.argmax(np.abs(as_float))])} is out of range")
    idx = idx.astype(np.int64, copy=False)
    if idx.shape[0] != val.shape[0]:
        raise bad(SparseIndexError, f"{idx.shape[0]} indices but {val.shape[0]} values; they must pair up")
    if idx.size and idx.min() < 0:
        raise bad(SparseIndexError, f"negative index {int(idx.min())}")
    if dim is not None and idx.size and idx.max() >= dim:
        raise bad(DimensionError, f"index {int(idx.max())} out of range for dimension {dim}")
    if idx.size > 1:
        step = np.diff(idx)
        if (step == 0).any():
            raise bad(SparseIndexError, f"duplicate index {int(idx[1:][step == 0][0])}")
        if (step < 0).any():
            raise bad(SparseIndexError, "indices must be sorted in increasing order")
    if not np.isfinite(val).all():
        p = int(np.flatnonzero(~np.isfinite(val))[0])
        raise bad(NonFiniteError, f"value at position {p} is {float(val[p])}; values must be finite", "values")
    if not val.any():
        raise bad(ZeroVectorError, "all-zero vector: GMM is undefined (0/0) for it", "values")
    return idx, val


def check_batch(X, dim: int | None = None, field: str = "vectors"):
    """Validate a batch: a 2-D dense array or a CSR matrix. Returns float64 dense or CSR.

    The first bad row is named in the error (``vectors[17]: ...``).
    """
    if sp.issparse(X):
        # a copy: sorting and dropping stored zeros below must not touch the caller's arrays
        X = sp.csr_matrix(X, dtype=np.float64, copy=True)
        if dim is not None and X.shape[1] != dim:
            raise DimensionError(field, f"expected {dim} columns, got {X.shape[1]}", part="values")
        if not X.has_sorted_indices:
            X.sort_indices()
        if not np.isfinite(X.data).all():
            row = int(np.searchsorted(X.indptr, np.flatnonzero(~np.isfinite(X.data))[0], "right") - 1)
            raise NonFiniteError(field, "values must be finite", row=row, part="values")
        X.eliminate_zeros()
        empty = np.flatnonzero(np.diff(X.indptr) == 0)
        if empty.size:
            raise ZeroVectorError(field, "all-zero vector: GMM is undefined (0/0) for it", row=int(empty[0]),
                                  part="values")
        return X
    try:
        A = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise VectorError(field, f"not an array of numbers ({exc})", part="values") from None
    if A.ndim == 1:
        A = A[None, :]
    if A.ndim != 2:
        raise DimensionError(field, f"expected a 2-D batch, got shape {A.shape}", part="values")
    if dim is not None and A.shape[1] != dim:
        raise DimensionError(field, f"expected {dim} values per vector, got {A.shape[1]}", part="values")
    finite = np.isfinite(A)
    if not finite.all():
        row = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise NonFiniteError(field, "values must be finite", row=row, part="values")
    zero = ~A.any(axis=1)
    if zero.any():
        raise ZeroVectorError(field, "all-zero vector: GMM is undefined (0/0) for it",
                              row=int(np.flatnonzero(zero)[0]), part="values")
    return np.ascontiguousarray(A)


@njit(nogil=True, cache=True)
def first_bad_row(X):
    """(row, problem) of the first row with a non-finite value (1) or no nonzero (2); (−1, 0) if none."""
    n, d = X.shape
    for v in range(n):
        nonzero = False
        for i in range(d):
            x = np.float64(X[v, i])
            if not math.isfinite(x):
                return v, 1
            if x != 0.0:
                nonzero = True
        if not nonzero:
            return v, 2
    return -1, 0


def dense_batch(X, check: bool) -> np.ndarray:
    """A dense batch as a contiguous 2-D array of its own numeric dtype, validated unless ``check=False``.

    Integer and float32/64 input is checked in one pass without a float64 copy (the
    kernels widen values themselves); anything else goes through ``check_batch``.
    """
    A = np.asarray(X)
    if A.dtype.kind not in "iuf" or A.dtype.itemsize < 4 and A.dtype.kind == "f" or A.ndim not in (1, 2):
        return check_batch(X) if check else np.ascontiguousarray(np.atleast_2d(A), dtype=np.float64)
    A = np.ascontiguousarray(np.atleast_2d(A))
    if check:
        if A.shape[1] == 0:
            return check_batch(A)  # names the problem
        row, problem = first_bad_row(A)
        if problem == 1:
            raise NonFiniteError("vectors", "values must be finite", row=row, part="values")
        if problem == 2:
            raise ZeroVectorError("vectors", "all-zero vector: GMM is undefined (0/0) for it", row=row, part="values")
    return A
