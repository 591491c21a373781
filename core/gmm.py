"""Exact GMM similarity, without ever building the 2D sign-split vectors.

``GMM(u, v) = Σ min(ũ, ṽ) / Σ max(ũ, ṽ)``. With
``S = Σ_{sign(u_i) = sign(v_i)} min(|u_i|, |v_i|)`` and ``Σ max = ‖u‖₁ + ‖v‖₁ − S``,
so one pass over the coordinates and the stored L1 norms suffice. Per
coordinate, ``max(min(a, b), 0) − min(max(a, b), 0)`` equals ``min(|a|, |b|)``
when ``a`` and ``b`` share a sign and 0 otherwise — branch-free, so it vectorises.

Kernels are plain functions over arrays (dense rows, or CSR rows) and a list of
row numbers, so the index can score just its candidates. Accumulation is in
float64 even for float32 rows.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from numba import njit

from gmmlsh.core.intrinsics import CACHE_LINE, prefetch
from gmmlsh.core.parallel import spread
from gmmlsh.core.validate import DimensionError, check_batch, check_dense, check_sparse

#: Sums may be reassociated (that is what lets LLVM vectorise them); inputs are
#: validated finite, so the no-NaN/no-inf assumptions hold.
_FAST = {"reassoc", "contract", "nsz", "arcp", "nnan", "ninf"}


@njit(nogil=True, cache=True, inline="always", fastmath=_FAST)
def _same_sign_min(a, b):
    return max(min(a, b), 0.0) - min(max(a, b), 0.0)


@njit(nogil=True, cache=True, inline="always")
def _ratio(s, na, nb):
    """S / (‖u‖₁ + ‖v‖₁ − S), capped at 1.

    ``S`` (a reassociated kernel sum) and the norms (summed elsewhere) round
    differently, so identical vectors could otherwise score 1.0000000000000004.
    """
    return min(s / (na + nb - s), 1.0)


@njit(nogil=True, cache=True, fastmath=_FAST)
def _dense_row(q, X, r):
    s = 0.0
    for i in range(q.shape[0]):
        s += _same_sign_min(q[i], np.float64(X[r, i]))
    return s


@njit(nogil=True, cache=True, fastmath=_FAST)
def _sparse_dense_row(qi, qv, X, r):
    s = 0.0
    for p in range(qi.shape[0]):
        s += _same_sign_min(qv[p], np.float64(X[r, qi[p]]))
    return s


@njit(nogil=True, cache=True, fastmath=_FAST)
def _dense_csr_row(q, indptr, indices, data, r):
    s = 0.0
    for p in range(indptr[r], indptr[r + 1]):
        s += _same_sign_min(q[indices[p]], np.float64(data[p]))
    return s


@njit(nogil=True, cache=True)
def _sparse_csr_row(qi, qv, indptr, indices, data, r):
    """Merge-join of two sorted index lists."""
    s = 0.0
    a = 0
    b = indptr[r]
    end = indptr[r + 1]
    while a < qi.shape[0] and b < end:
        ia = qi[a]
        ib = indices[b]
        if ia == ib:
            s += _same_sign_min(qv[a], np.float64(data[b]))
            a += 1
            b += 1
        elif ia < ib:
            a += 1
        else:
            b += 1
    return s


# One-vs-rows scorers: serial kernels; a batch of rows is spread over the cores in chunks (core.parallel).

#: Rows fetched ahead by the dense scorers. Candidate rows are random, so without
#: this every row start costs a full memory latency.
_AHEAD = 4


@njit(nogil=True, cache=True, inline="always")
def _prefetch_ahead(X, rows, t):
    """Prefetch the row ``_AHEAD`` places on — unless the rows run consecutively there
    (a full scan), where the hardware prefetcher already streams and this would only
    cost instructions (docs/tuning.md)."""
    if t + _AHEAD < rows.shape[0]:
        r = rows[t + _AHEAD]
        if r != rows[t] + _AHEAD:
            for i in range(0, X.shape[1], CACHE_LINE // X.itemsize):
                prefetch(X, r, i)


@njit(nogil=True, cache=True, fastmath=_FAST)
def _dense(q, qn, X, xn, rows, out):
    for t in range(rows.shape[0]):
        _prefetch_ahead(X, rows, t)
        r = rows[t]
        out[t] = _ratio(_dense_row(q, X, r), qn, xn[r])


@njit(nogil=True, cache=True, fastmath=_FAST)
def _sparse_dense(qi, qv, qn, X, xn, rows, out):
    for t in range(rows.shape[0]):
        _prefetch_ahead(X, rows, t)
        r = rows[t]
        out[t] = _ratio(_sparse_dense_row(qi, qv, X, r), qn, xn[r])


@njit(nogil=True, cache=True)
def _dense_csr(q, qn, indptr, indices, data, xn, rows, out):
    for t in range(rows.shape[0]):
        r = rows[t]
        out[t] = _ratio(_dense_csr_row(q, indptr, indices, data, r), qn, xn[r])


@njit(nogil=True, cache=True)
def _sparse_csr(qi, qv, qn, indptr, indices, data, xn, rows, out):
    for t in range(rows.shape[0]):
        r = rows[t]
        out[t] = _ratio(_sparse_csr_row(qi, qv, indptr, indices, data, r), qn, xn[r])


@njit(nogil=True, cache=True, fastmath=_FAST)
def _dense_block(Q, qn, X, xn, out):
    """All queries × the rows of ``X`` (``out[a, r]``), tiled so a block of rows is reused from
    cache by every query, and four queries scored at once against a row (each of its values is
    read once for four sums)."""
    n, m, d = X.shape[0], Q.shape[0], Q.shape[1]
    bs = 64
    for lo in range(0, n, bs):
        hi = min(n, lo + bs)
        for a in range(0, m - m % 4, 4):
            q0, q1, q2, q3 = Q[a], Q[a + 1], Q[a + 2], Q[a + 3]
            for r in range(lo, hi):
                x = X[r]
                s0 = s1 = s2 = s3 = 0.0
                for i in range(d):
                    v = np.float64(x[i])
                    s0 += _same_sign_min(q0[i], v)
                    s1 += _same_sign_min(q1[i], v)
                    s2 += _same_sign_min(q2[i], v)
                    s3 += _same_sign_min(q3[i], v)
                out[a, r] = _ratio(s0, qn[a], xn[r])
                out[a + 1, r] = _ratio(s1, qn[a + 1], xn[r])
                out[a + 2, r] = _ratio(s2, qn[a + 2], xn[r])
                out[a + 3, r] = _ratio(s3, qn[a + 3], xn[r])
        for a in range(m - m % 4, m):
            for r in range(lo, hi):
                s = 0.0
                for i in range(d):
                    s += _same_sign_min(Q[a, i], np.float64(X[r, i]))
                out[a, r] = _ratio(s, qn[a], xn[r])


@njit(nogil=True, cache=True)
def l1_norm(values) -> float:
    """``Σ |v|`` of one vector's values, in index order, one after the other (no fastmath: no
    reassociation). A dense row's values (its zeros add exactly nothing) and its nonzeros alone
    give the same bits: a vector's norm, stored or a query's, must not depend on the shape it
    came in (the similarity of a vector to itself is then exactly 1 either way)."""
    s = 0.0
    for i in range(values.shape[0]):
        s += abs(np.float64(values[i]))
    return s


@njit(nogil=True, cache=True)
def _l1_dense(X, out):
    for r in range(X.shape[0]):
        out[r] = l1_norm(X[r])


@njit(nogil=True, cache=True)
def _l1_csr(indptr, data):
    out = np.empty(indptr.shape[0] - 1)
    for r in range(out.shape[0]):
        out[r] = l1_norm(data[indptr[r]:indptr[r + 1]])
    return out


def l1_norms(X) -> np.ndarray:
    """L1 norm of every row (float64), dense or sparse: the same bits for the same vector either
    way (:func:`l1_norm`)."""
    if sp.issparse(X):
        X = sp.csr_matrix(X)
        if not X.has_sorted_indices:
            X = X.sorted_indices()
        return _l1_csr(X.indptr.astype(np.int64), X.data)
    X = np.atleast_2d(np.asarray(X))
    out = np.empty(X.shape[0])
    spread(lambda lo, hi: _l1_dense(X[lo:hi], out[lo:hi]), X.shape[0], X.size)
    return out


def _as_query(q, dim: int | None = None):
    """A query as ('dense', values) or ('sparse', indices, values), validated."""
    if sp.issparse(q):
        q = sp.csr_matrix(q)
        if q.shape[0] != 1:
            raise ValueError(f"query: expected one row, got {q.shape[0]}")
        q.sort_indices()
        idx, val = check_sparse(q.indices, q.data, q.shape[1] if dim is None else dim, field="query")
        return ("sparse", idx, val)
    if isinstance(q, tuple) and len(q) == 2:
        idx, val = check_sparse(q[0], q[1], dim, field="query")
        return ("sparse", idx, val)
    return ("dense", check_dense(q, dim, field="query"))


def score_rows(q, X, rows: np.ndarray | None = None, x_norms: np.ndarray | None = None) -> np.ndarray:
    """Exact GMM of query ``q`` against rows ``rows`` of ``X`` (all rows if None).

    ``q``: dense 1-D, ``(indices, values)`` or a 1-row CSR matrix. ``X``: dense
    2-D (float32 or float64) or CSR. ``x_norms``: precomputed L1 norms of ``X``.
    """
    n = X.shape[0]
    rows = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    xn = l1_norms(X) if x_norms is None else np.asarray(x_norms, dtype=np.float64)
    kind, *qa = _as_query(q, X.shape[1])
    qn = float(np.abs(qa[-1]).sum())
    out = np.empty(rows.shape[0])
    if rows.shape[0] == 0:
        return out
    nnz_q = qa[-1].shape[0]
    dense_x = not sp.issparse(X)
    work = rows.shape[0] * (X.shape[1] if dense_x and kind == "dense" else max(nnz_q, 16))
    if dense_x:
        X = np.ascontiguousarray(X)
    else:
        X = sp.csr_matrix(X)
        if not X.has_sorted_indices:
            X.sort_indices()
    spread(lambda lo, hi: _score(kind, qa, qn, X, xn, rows[lo:hi], out[lo:hi]), rows.shape[0], work)
    return out


def _score(kind, qa, qn, X, xn, rows, out) -> None:
    if not sp.issparse(X):
        if kind == "dense":
            _dense(qa[0], qn, X, xn, rows, out)
        else:
            _sparse_dense(qa[0], qa[1], qn, X, xn, rows, out)
    elif kind == "dense":
        _dense_csr(qa[0], qn, X.indptr, X.indices, X.data, xn, rows, out)
    else:
        _sparse_csr(qa[0], qa[1], qn, X.indptr, X.indices, X.data, xn, rows, out)


def gmm(u, v) -> float:
    """Exact GMM of two vectors (dense 1-D arrays, ``(indices, values)`` pairs or CSR rows)."""
    kind, *va = _as_query(v)
    if kind == "dense":
        X = va[0][None, :]
    else:
        dim = None
        if sp.issparse(u):
            dim = u.shape[1]
        elif not isinstance(u, tuple):
            dim = np.shape(u)[0]
        else:
            dim = int(max(np.max(u[0]), va[0].max())) + 1
        X = sp.csr_matrix((va[1], va[0], [0, va[0].shape[0]]), shape=(1, dim))
    return float(score_rows(u, X)[0])


def gmm_many(q, X, x_norms: np.ndarray | None = None) -> np.ndarray:
    """Exact GMM of one query against every row of ``X`` (dense 2-D or CSR)."""
    return score_rows(q, X, None, x_norms)


def gmm_matrix(Q, X, q_norms=None, x_norms=None) -> np.ndarray:
    """Exact GMM of every dense query row against every dense row: (len(Q), len(X))."""
    X = np.ascontiguousarray(X)
    if X.ndim != 2:
        raise DimensionError("vectors", f"expected a 2-D array of rows, got shape {X.shape}")
    # validated: the kernel reads Q[a, i] for every column of X, unchecked
    Q = check_batch(np.atleast_2d(Q), X.shape[1], field="queries")
    qn = l1_norms(Q) if q_norms is None else np.asarray(q_norms, dtype=np.float64)
    xn = l1_norms(X) if x_norms is None else np.asarray(x_norms, dtype=np.float64)
    out = np.empty((Q.shape[0], X.shape[0]))
    spread(lambda lo, hi: _dense_block(Q, qn, X[lo:hi], xn[lo:hi], out[:, lo:hi]), X.shape[0], X.size * Q.shape[0])
    return out


def rbf(u, v, gamma: float) -> float:
    """RBF kernel on the correlation, ``exp(−γ(1 − ρ))``: what NRFF estimates."""
    u = np.asarray(u, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    rho = float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))
    return float(np.exp(-gamma * (1.0 - rho)))
