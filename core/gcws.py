"""GCWS: generalized consistent weighted sampling (Li, Algorithm 1), in numba.

A vector ``u`` is sign-split into ``ũ`` (``ũ[2i] = max(u_i, 0)``,
``ũ[2i+1] = max(-u_i, 0)``); for every nonzero ``ũ[i]`` and sample ``j`` the
constants ``r, c ~ Gamma(2, 1)`` and ``β ~ U(0, 1)`` come from the counter-based
generator in :mod:`core.rng`, and

    t = ⌊ln ũ[i] / r + β⌋,   ln a = ln c − r(t − β) − r,   i* = argmin_i ln a.

Two vectors share ``(i*, t*)`` with probability GMM(u, v) (Theorem 1) and share
``i*`` with probability ≈ GMM (the 0-bit scheme).

Speed comes from four things: the constants of a coordinate are computed once
per call (or once per process, in a table) instead of once per vector; the table
is coordinate-major and float32, so one nonzero reads its constants for all k
samples as one contiguous run (16 bytes a sample: 12 MB for 784 dimensions and
k = 480, which stays in cache between queries); one step updates 32 samples'
minima with explicit vector code (:mod:`core.lane_step`: numba's own loop
re-checked array overlaps on every step); and rows are spread over threads
with :func:`core.parallel.spread`. The constants are computed in float64 and rounded to
float32 once, when they are made; the sampling arithmetic is float64 on every
path (DESIGN §1), so the table and the table-free path are bit-identical. Dense rows
with many nonzeros, when only i* is wanted, take the sorted walk of
:mod:`core.gcws_walk` instead: it visits each sample's coordinates in order of a lower
bound on ``ln a`` and stops once none can win, with the same result.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import scipy.sparse as sp
from numba import njit

from gmmlsh.core.bundles import frozen
from gmmlsh.core.codes import _codes, _planes, bbit_codes, bit_planes, plane_words
from gmmlsh.core.gcws_walk import BYTES_PER_ENTRY, build_walk_table, sign_bounds, walk_vector
from gmmlsh.core.lane_step import broadcast_step
from gmmlsh.core.parallel import spread
from gmmlsh.core.rng import coord_key, uniform
from gmmlsh.core.validate import NonFiniteError, ZeroVectorError, check_batch, check_sparse, dense_batch, first_bad_row

#: Samples handled together by the innermost loop (4 AVX-512 registers of float64).
_JB = 32
#: Most blocks of samples one pass over a vector's nonzeros updates (512 samples:
#: 16 KB of running minima, in L1); larger k takes several passes.
_GROUP = 16
#: Bytes of table per (coordinate, sample): four float32 constants.
_BYTES_PER_CONSTANT = 16
#: Largest constant table kept per process (bytes); beyond it the table-free path runs.
TABLE_BUDGET_BYTES = 64 << 20
#: A dense row takes the sorted walk when nonzeros² ≥ this · (coordinates in the
#: lists it walks: D per sign present): the walk's length grows as the row gets
#: sparser (its lists hold the zeros too), the reference kernel's with the
#: nonzeros; the value is where the two cost the same on images (docs/tuning.md).
_WALK_MIN = 48


@njit(nogil=True, cache=True)
def _fill_constants(coords, k, seed, out):
    """Per-(coordinate, sample) constants into ``out``, coordinate-major: (len(coords), ceil(k/_JB), 4, _JB) float32.

    Slot 0 = 1/r, 1 = β, 2 = ln c − r(1 − β), 3 = r, so that
    ``t = ⌊ln ũ · (1/r) + β⌋`` and ``ln a = slot2 − r·t``. Each is computed in
    float64 and rounded to float32 (a relative change of 6e-8: the constants are
    still draws of the same distributions, and the kernels read half the bytes).
    Samples past ``k`` in the last block are real samples too (they are simply not
    reported).
    """
    nblk = (k + _JB - 1) // _JB
    s = np.uint64(seed)
    for a in range(coords.shape[0]):
        ck = coord_key(s, np.uint64(coords[a]))
        for j in range(nblk * _JB):
            uj = np.uint64(j)
            r = -math.log(uniform(ck, uj, np.uint64(0))) - math.log(uniform(ck, uj, np.uint64(1)))
            c = -math.log(uniform(ck, uj, np.uint64(2))) - math.log(uniform(ck, uj, np.uint64(3)))
            b = uniform(ck, uj, np.uint64(4))
            blk = j // _JB
            jj = j - blk * _JB
            out[a, blk, 0, jj] = 1.0 / r
            out[a, blk, 1, jj] = b
            out[a, blk, 2, jj] = math.log(c) - r * (1.0 - b)
            out[a, blk, 3, jj] = r


@njit(nogil=True, cache=True, inline="always")
def _sample_vector(v, p0, p1, rows, coords, logs, table, k, state, out_i, out_t, want_t):
    """Samples of one vector, whose nonzeros are ``p0 ≤ p < p1``, into row ``v`` of the outputs.

    ``rows[p]`` is the table row of nonzero ``p``; ``coords[p]`` its 2D coordinate
    (reported as i*). Ties keep the first (smallest) coordinate. Coordinate-major:
    each nonzero updates up to ``state.shape[0]`` blocks of samples from one
    contiguous run of the table, which the hardware prefetches well, while the
    running minima stay in L1 (``state[g]``: see :mod:`core.lane_step`). (One block for
    a chunk of vectors at a time was slower: docs/tuning.md.)
    """
    nblk = table.shape[1]
    group = state.shape[0]
    for g0 in range(0, nblk, group):
        g1 = min(nblk, g0 + group)
        state[:, 0, :] = np.inf
        state[:, 1, :] = 0.0
        for q in range(p1 - p0):  # q: the nonzero's position within the vector
            p = p0 + q
            c = table[rows[p]]
            lx = logs[p]
            for blk in range(g0, g1):
                broadcast_step(lx, c[blk], state[blk - g0], np.float64(q))
        for blk in range(g0, g1):
            for jj in range(min(_JB, k - blk * _JB)):
                p = p0 + np.int64(state[blk - g0, 1, jj])
                out_i[v, blk * _JB + jj] = coords[p]
                if want_t:
                    cb = table[rows[p], blk]
                    t = np.floor(logs[p] * np.float64(cb[0, jj]) + np.float64(cb[1, jj]))
                    out_t[v, blk * _JB + jj] = np.int64(t)


def _minima(nblk):
    """Running minima and their positions for up to :data:`_GROUP` blocks."""
    return np.empty((min(nblk, _GROUP), 2, _JB))


@njit(nogil=True, cache=True)
def _sample_split(indptr, rows, coords, logs, table, k, out_i, out_t, want_t):
    """GCWS of already sign-split rows (CSR over the 2D space; ``indptr`` may be a slice of a
    bigger one: its offsets are into ``rows``/``coords``/``logs`` as they are)."""
    n = indptr.shape[0] - 1
    state = _minima(table.shape[1])
    for v in range(n):
        _sample_vector(v, indptr[v], indptr[v + 1], rows, coords, logs, table, k, state, out_i, out_t, want_t)


@njit(nogil=True, cache=True)
def _sample_dense(X, rowmap, table, walk_e, walk_c, k, out_i, out_t, want_t):
    """GCWS of dense rows: each row is sign-split into small reused buffers, then sampled.

    Splitting a whole batch first would write 16 bytes per nonzero to fresh memory
    (376 MB for Fashion-MNIST's 60,000 rows) and spend its time in page faults.
    ``rowmap[c]`` is the table row of 2D coordinate ``c``. With a walk table
    (``walk_e`` not empty: the full table, i* only) rows dense enough for it to pay
    go through :func:`core.gcws_walk.walk_vector`; a tie sends a row back here.
    """
    n, d = X.shape
    walk = walk_e.shape[0] > 0 and not want_t
    state = _minima(table.shape[1])
    coords = np.empty(d, dtype=np.int64)
    rows = np.empty(d, dtype=np.int64)
    logs = np.empty(d, dtype=np.float64)
    lx2 = np.full(2 * d if walk else 0, np.nan)
    wstate = np.empty((3, _JB))
    U = np.empty(2)
    for v in range(n):
        p = np.int64(0)  # not a literal 0: sign_bounds would be compiled for it too
        for i in range(d):
            # Widen first: numba's log of a float32 is a float32, and sketches must not
            # depend on the input's dtype.
            x = np.float64(X[v, i])
            if x != 0.0:
                c = 2 * i if x > 0.0 else 2 * i + 1
                coords[p] = c
                rows[p] = rowmap[c]
                logs[p] = math.log(abs(x))
                p += 1
        walk_row = False
        if walk and p > 0:  # the walk's length grows with the lists it walks, the reference's with p
            sign_bounds(coords, logs, p, U)
            walk_row = p * p >= _WALK_MIN * d * ((not np.isnan(U[0])) + (not np.isnan(U[1])))
        if walk_row:
            for q in range(p):
                lx2[coords[q]] = logs[q]
            done = walk_vector(lx2, U, walk_e, walk_c, k, out_i[v], wstate)
            for q in range(p):
                lx2[coords[q]] = np.nan
            if done:
                continue
        _sample_vector(v, 0, p, rows, coords, logs, table, k, state, out_i, out_t, want_t)


@njit(nogil=True, cache=True)
def _dense_planes(X, rowmap, table, walk_e, walk_c, k, bits, seed, out):
    """:func:`_sample_dense` (i* only), the b-bit codes and their bit planes (the kernels of
    :func:`~gmmlsh.core.codes.bbit_codes` and :func:`~gmmlsh.core.codes.bit_planes`) of dense
    rows in one call, into ``out``."""
    istar = np.empty((X.shape[0], k), dtype=np.int32)
    no_t = k < 0  # False, worked out: a literal False would compile the kernels once more for it
    no_tstar = np.empty((1, 1), dtype=np.int64)
    _sample_dense(X, rowmap, table, walk_e, walk_c, k, istar, no_tstar, no_t)
    planes = _planes(_codes(istar, no_tstar, no_t, np.int64(0), bits, seed), bits, out.shape[1] // bits)
    for v in range(out.shape[0]):  # loops, not a slice assignment: that compiles numba's shape errors
        for w in range(out.shape[1]):
            out[v, w] = planes[v, w]


@njit(nogil=True, cache=True)
def _dense_coords(X):
    """The 2D coordinates that are nonzero in some row (the sign split of every column)."""
    n, d = X.shape
    used = np.zeros(2 * d, dtype=np.bool_)
    for v in range(n):
        for i in range(d):
            x = X[v, i]
            if x > 0:
                used[2 * i] = True
            elif x < 0:
                used[2 * i + 1] = True
    return np.flatnonzero(used)


_minima = njit(nogil=True, cache=True, inline="always")(_minima)


@njit(nogil=True, cache=True)
def _split_csr(indptr_in, indices, data):
    """Sign-split CSR rows (sorted indices) into CSR over the 2D space, dropping zeros."""
    n = indptr_in.shape[0] - 1
    indptr = np.zeros(n + 1, dtype=np.int64)
    for v in range(n):
        cnt = 0
        for p in range(indptr_in[v], indptr_in[v + 1]):
            if data[p] != 0.0:
                cnt += 1
        indptr[v + 1] = indptr[v] + cnt
    coords = np.empty(indptr[n], dtype=np.int64)
    logs = np.empty(indptr[n], dtype=np.float64)
    for v in range(n):
        q = indptr[v]
        for p in range(indptr_in[v], indptr_in[v + 1]):
            x = np.float64(data[p])  # widen first (see _sample_dense_impl)
            if x > 0.0:
                coords[q] = 2 * np.int64(indices[p])
                logs[q] = math.log(x)
                q += 1
            elif x < 0.0:
                coords[q] = 2 * np.int64(indices[p]) + 1
                logs[q] = math.log(-x)
                q += 1
    return indptr, coords, logs


@functools.lru_cache(maxsize=4)
def constant_table(dim2: int, k: int, seed: int) -> np.ndarray:
    """All constants for a 2D-space of ``dim2`` coordinates: built once per process."""
    table = _compute_constants(np.arange(dim2, dtype=np.int64), k, seed)
    table.setflags(write=False)
    return table


def _padded(k: int) -> int:
    """Samples a table holds for ``k``: whole blocks of ``_JB``."""
    return -(-k // _JB) * _JB


#: Stand-in walk table: the sorted walk is off (direct path, or t* wanted).
NO_WALK = tuple(frozen(a) for a in (np.empty((0, 0, 5, _JB), dtype=np.float32), np.empty((0, 0, _JB), dtype=np.uint32)))


@functools.lru_cache(maxsize=4)
def walk_table(dim2: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted walk's lists (:mod:`core.gcws_walk`) of the full constant table, or
    :data:`NO_WALK` when they would not fit :data:`TABLE_BUDGET_BYTES`. Once per process."""
    if dim2 * _padded(k) * BYTES_PER_ENTRY > TABLE_BUDGET_BYTES:
        return NO_WALK
    E, C = build_walk_table(constant_table(dim2, k, seed))
    E.setflags(write=False)
    C.setflags(write=False)
    return E, C


#: Held while a batch fetches the per-process tables: the first batches of a bulk load arrive on
#: several threads at once, and each would otherwise build its own copy.
_TABLES_LOCK = threading.Lock()


def _full_tables(dim2: int, k: int, seed: int, walk: bool) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """(:func:`constant_table`, :func:`walk_table` or :data:`NO_WALK`), each built once per process."""
    with _TABLES_LOCK:
        return constant_table(dim2, k, seed), walk_table(dim2, k, seed) if walk else NO_WALK


def table_fits(dim: int, k: int, budget: int = TABLE_BUDGET_BYTES) -> bool:
    """Whether a full constant table for ``dim`` input dimensions and ``k`` samples fits."""
    return 2 * dim * _padded(k) * _BYTES_PER_CONSTANT <= budget


def _prepare(X, center, check: bool = True):
    """Input → ("dense", A) or ("split", (n, dim, indptr, coords, logs)), validated unless ``check=False``.

    Dense rows are split inside the sampling kernel; CSR rows are split here (it
    costs one pass over their nonzeros only).
    """
    if sp.issparse(X) and center is None:
        if check:
            X = check_batch(X)
        elif not (sp.isspmatrix_csr(X) and X.has_sorted_indices):
            X = sp.csr_matrix(X)
        return "split", (X.shape[0], X.shape[1],
                         *_split_csr(X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data))
    if center is None:
        return "dense", dense_batch(X, check)
    if sp.issparse(X):
        X = X.toarray()  # centring makes a sparse vector dense
    # not check_batch: a zero row is fine once centred, but NaN/inf must still be refused
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    c = np.ascontiguousarray(center, dtype=np.float64)
    if c.shape != (X.shape[1],):
        raise ValueError(f"center: expected {X.shape[1]} values, got shape {c.shape}")
    if not np.isfinite(c).all():
        raise NonFiniteError("center", "values must be finite")
    Xc = np.ascontiguousarray(X - c)
    row, problem = first_bad_row(Xc)
    if problem == 1:
        raise NonFiniteError("vectors", "values must be finite", row=row, part="values")
    if problem == 2:
        raise ZeroVectorError("vectors", "equals the center: nothing to sample", row=row, part="values")
    return "dense", Xc


#: Bytes of constants the direct path keeps per process for the coordinates it met first
#: (where the full table does not fit: text). Zipfian data meet their common coordinates in every
#: batch; computing their constants again per batch capped one thread at ~400 text rows a second.
#: Memory is taken only as coordinates are met (8 KB each at 512 samples): the Brown passages'
#: whole vocabulary (~47,000 words, ~385 MB) fits, where 128 MB left a third of a text build's
#: time to recomputing the rarer words' constants (docs/tuning.md, "GCWS hashing").
COORD_CACHE_BYTES = 512 << 20


class _CoordCache:
    """Constants of the first coordinates a process hashes, for the direct path: a table with a
    slot per coordinate met, filled until :data:`COORD_CACHE_BYTES`, never evicted (the common
    coordinates come first and stay common); the rest computed per batch. Bit-identical to
    computing them all: constants are pure functions of (seed, coordinate, sample)."""

    def __init__(self, dim2: int, k: int, seed: int):
        self.k, self.seed = k, seed
        self.slot = np.full(dim2, -1, dtype=np.int64)
        per = _padded(k) * _BYTES_PER_CONSTANT
        self.rows = np.empty((max(1, COORD_CACHE_BYTES // per), _padded(k) // _JB, 4, _JB), dtype=np.float32)
        self.used = 0
        self.lock = threading.Lock()

    def table(self, coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(table, where)``: the constants of these (sorted, unique) coordinates are rows
        ``where`` of ``table``. The cache itself is the table (no copy) once every coordinate has
        its slot; past :data:`COORD_CACHE_BYTES`, a table of this batch's coordinates."""
        slots = self.slot[coords]
        if (slots >= 0).all():
            return frozen(self.rows), slots  # read-only, as the full table: one compiled sampler for both
        miss = coords[slots < 0]
        fresh = _compute_constants(miss, self.k, self.seed)
        with self.lock:
            keep = np.flatnonzero(self.slot[miss] < 0)[:self.rows.shape[0] - self.used]
            at = self.used + np.arange(keep.shape[0])
            self.rows[at] = fresh[keep]  # the rows first, then the slots that name them
            self.slot[miss[keep]] = at
            self.used += keep.shape[0]
        slots = self.slot[coords]
        hit = slots >= 0
        if hit.all():
            return frozen(self.rows), slots
        out = np.empty((coords.shape[0], *self.rows.shape[1:]), dtype=np.float32)
        out[hit] = self.rows[slots[hit]]
        out[~hit] = fresh[np.searchsorted(miss, coords[~hit])]
        return frozen(out), np.arange(coords.shape[0], dtype=np.int64)


@functools.lru_cache(maxsize=4)
def _coord_cache(dim2: int, k: int, seed: int) -> _CoordCache:
    return _CoordCache(dim2, k, seed)


def _compute_constants(coords: np.ndarray, k: int, seed: int) -> np.ndarray:
    out = np.empty((coords.shape[0], _padded(k) // _JB, 4, _JB), dtype=np.float32)
    spread(lambda lo, hi: _fill_constants(coords[lo:hi], k, np.uint64(seed), out[lo:hi]), coords.shape[0],
           coords.shape[0] * k * 16)
    return out


def _direct_table(coords: np.ndarray, dim2: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Constants for just these (sorted, unique) coordinates of a ``dim2``-coordinate space:
    ``(table, where)``, coordinate ``coords[i]``'s constants in row ``where[i]``."""
    with _TABLES_LOCK:
        cache = _coord_cache(dim2, k, int(seed))
    return cache.table(coords)


def sketch(
    X,
    k: int,
    seed: int = 0,
    *,
    center=None,
    return_t: bool = False,
    path: str = "auto",
    check: bool = True,
):
    """GCWS samples of each row of ``X``: ``i*`` (n, k) int32 over the 2D space.

    ``X`` is a dense 1-D/2-D array or a scipy sparse matrix (rows are vectors).
    ``path``: ``"table"`` (a per-process table of all 2·dim·k constants),
    ``"direct"`` (constants only for the coordinates this batch touches) or
    ``"auto"`` (the table when it fits :data:`TABLE_BUDGET_BYTES`). Both paths
    give bit-identical results. With ``return_t`` also returns ``t*`` (int64).
    ``check=False`` skips validation for callers that already validated (finite,
    no all-zero rows, sorted sparse indices); float32 input is then hashed as is.
    """
    if k <= 0:
        raise ValueError(f"k: must be positive, got {k}")
    if path not in ("auto", "table", "direct"):
        raise ValueError(f"path: expected 'auto', 'table' or 'direct', got {path!r}")
    one = not sp.issparse(X) and np.ndim(X) == 1
    form, data = _prepare(X, center, check)
    n, dim = data.shape if form == "dense" else data[:2]
    if path == "auto":
        path = "table" if table_fits(dim, k) else "direct"
    out_i = np.empty((n, k), dtype=np.int32)
    out_t = np.empty((n, k) if return_t else (1, 1), dtype=np.int64)
    if form == "dense":
        if path == "table":
            table, walk = _full_tables(2 * dim, k, int(seed), not return_t)
            rowmap = _identity(2 * dim)
        else:
            walk = NO_WALK
            used = _dense_coords(data)
            table, where = _direct_table(used, 2 * dim, k, seed)
            rowmap = np.zeros(2 * dim, dtype=np.int64)
            rowmap[used] = where
        spread(lambda lo, hi: _sample_dense(data[lo:hi], rowmap, table, *walk, k, out_i[lo:hi],
                                            out_t[lo:hi] if return_t else out_t, return_t), n, data.size * k // 2)
    else:
        n, dim, indptr, coords, logs = data
        if path == "table":
            table, rows = _full_tables(2 * dim, k, int(seed), False)[0], coords
        else:
            uniq, inverse = np.unique(coords, return_inverse=True)
            table, where = _direct_table(uniq, 2 * dim, k, seed)
            rows = where[inverse.reshape(-1)]
        spread(lambda lo, hi: _sample_split(indptr[lo:hi + 1], rows, coords, logs, table, k, out_i[lo:hi],
                                            out_t[lo:hi] if return_t else out_t, return_t), n, coords.shape[0] * k)
    if one:
        out_i, out_t = out_i[0], out_t[0]
    return (out_i, out_t) if return_t else out_i


def sketch_planes(X, k: int, seed: int, bits: int) -> np.ndarray:
    """Bit planes ``(n, bits · words)`` of the ``bits``-bit codes of the rows' i* — what
    ``bit_planes(bbit_codes(sketch(X, k, seed), bits, seed), bits)`` gives — of validated rows
    (see ``check=False`` in :func:`sketch`). Dense float32 rows whose full table fits take one
    compiled call (a query's hashing: the calls between the kernels were a fifth of its preparing)."""
    A = None if sp.issparse(X) or not table_fits(np.shape(X)[-1], k) else dense_batch(X, False)
    if A is None or A.dtype != np.float32:  # float32: stored precision, what queries are (one compiled kernel)
        return bit_planes(bbit_codes(sketch(X, k, seed, check=False), bits, seed), bits)
    n, dim = A.shape
    out = np.empty((n, bits * plane_words(k)), dtype=np.uint64)
    table, walk = _full_tables(2 * dim, k, int(seed), True)
    rowmap = _identity(2 * dim)
    spread(lambda lo, hi: _dense_planes(A[lo:hi], rowmap, table, *walk, k, bits, np.uint64(seed), out[lo:hi]), n,
           A.size * k // 2)
    return out


@functools.lru_cache(maxsize=4)
def _identity(dim2: int) -> np.ndarray:
    """The full table's row map: coordinate ``c`` is row ``c`` (writable, as the direct path's:
    one compiled sampler for both; nobody writes it)."""
    return np.arange(dim2, dtype=np.int64)


def sketch_sparse_vector(indices, values, dim: int, k: int, seed: int = 0, **kw):
    """Sketch one sparse vector given as sorted indices and values."""
    idx, val = check_sparse(indices, values, dim)
    X = sp.csr_matrix((val, idx, np.array([0, idx.size])), shape=(1, dim))
    out = sketch(X, k, seed, **kw)
    return tuple(o[0] for o in out) if isinstance(out, tuple) else out[0]
