"""GCWS: generalized consistent weighted sampling (Li, Algorithm 1), in numba.

A vector ``u`` is sign-split into ``ũ`` (``ũ[2i] = max(u_i, 0)``,
``ũ[2i+1] = max(-u_i, 0)``); for every nonzero ``ũ[i]`` and sample ``j`` the
constants ``r, c ~ Gamma(2, 1)`` and ``β ~ U(0, 1)`` come from the counter-based
generator in :mod:`core.rng`, and

    t = ⌊ln ũ[i] / r + β⌋,   ln a = ln c − r(t − β) − r,   i* = argmin_i ln a.

Two vectors share ``(i*, t*)`` with probability GMM(u, v) (Theorem 1) and share
``i*`` with probability ≈ GMM (the 0-bit scheme).

Speed comes from three things: the constants of a coordinate are computed once
per call (or once per process, in a table) instead of once per vector; the
sampling kernel walks the samples in blocks of ``_JB`` so the constants of a
block stay in L2 while a chunk of vectors streams through it; and rows are
spread over threads with ``prange``.  The table and the table-free path run the
same float64 arithmetic on the same constants, so they are bit-identical.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import scipy.sparse as sp
from numba import njit, prange

from core.parallel import PARALLEL_LOCK, PARALLEL_MIN_WORK
from core.rng import coord_key, hash_code, uniform
from core.validate import check_batch, check_sparse

#: Samples handled together by the kernel (4 AVX-512 registers of float64). Measured
#: on Fashion-MNIST, k=256, one Zen 4 core: 16 → 13.5k, 32 → 16.9k, 64 → 17.2k vectors/s.
_JB = 32
#: Vectors per parallel work item.
_CHUNK = 64
#: Largest constant table kept per process (bytes); beyond it the table-free path runs.
TABLE_BUDGET_BYTES = 64 << 20


def _fill_constants_impl(coords, k, seed):
    """Per-(coordinate, sample) constants, block-major: (ceil(k/_JB), len(coords), 4, _JB).

    Slot 0 = 1/r, 1 = β, 2 = ln c − r(1 − β), 3 = r, so that
    ``t = ⌊ln ũ · (1/r) + β⌋`` and ``ln a = slot2 − r·t``. Samples past ``k`` in the
    last block are real samples too (they are simply not reported).
    """
    nblk = (k + _JB - 1) // _JB
    out = np.empty((nblk, coords.shape[0], 4, _JB), dtype=np.float64)
    s = np.uint64(seed)
    for a in prange(coords.shape[0]):
        ck = coord_key(s, np.uint64(coords[a]))
        for j in range(nblk * _JB):
            uj = np.uint64(j)
            r = -math.log(uniform(ck, uj, np.uint64(0))) - math.log(uniform(ck, uj, np.uint64(1)))
            c = -math.log(uniform(ck, uj, np.uint64(2))) - math.log(uniform(ck, uj, np.uint64(3)))
            b = uniform(ck, uj, np.uint64(4))
            blk = j // _JB
            jj = j - blk * _JB
            out[blk, a, 0, jj] = 1.0 / r
            out[blk, a, 1, jj] = b
            out[blk, a, 2, jj] = math.log(c) - r * (1.0 - b)
            out[blk, a, 3, jj] = r
    return out


@njit(nogil=True, cache=True, inline="always")
def _block_step(lx, p, invr, beta, base, rate, best_in, arg_in, best_out, arg_out):
    """One nonzero against one block of samples: contiguous 1-D arrays, so it vectorizes.

    Reads the running minimum from one buffer and writes it to another: an
    in-place update is turned into masked stores by LLVM, which stall the
    store-to-load forwarding the next nonzero depends on.
    """
    for jj in range(_JB):
        la = base[jj] - rate[jj] * np.floor(lx * invr[jj] + beta[jj])
        b = best_in[jj]
        a = arg_in[jj]
        best_out[jj] = min(la, b)
        arg_out[jj] = p if la < b else a


def _sample_impl(indptr, rows, coords, logs, table, k, out_i, out_t):
    """Core GCWS loop: for each vector and sample, the argmin of ln a over its nonzeros.

    ``rows[p]`` is the table row of nonzero ``p``; ``coords[p]`` its 2D coordinate
    (reported as i*). Ties keep the first (smallest) coordinate. A chunk of
    vectors walks one block of samples at a time so that block stays in cache.
    """
    n = indptr.shape[0] - 1
    nchunks = (n + _CHUNK - 1) // _CHUNK
    for ch in prange(nchunks):
        lo = ch * _CHUNK
        hi = min(n, lo + _CHUNK)
        best = np.empty((2, _JB))
        arg = np.empty((2, _JB), dtype=np.int64)
        for blk in range(table.shape[0]):
            tb = table[blk]
            jb = blk * _JB
            jn = min(_JB, k - jb)
            for v in range(lo, hi):
                best[0, :] = np.inf
                arg[0, :] = indptr[v]
                cur = 0
                for p in range(indptr[v], indptr[v + 1]):
                    c = tb[rows[p]]
                    _block_step(logs[p], p, c[0], c[1], c[2], c[3], best[cur], arg[cur], best[1 - cur], arg[1 - cur])
                    cur = 1 - cur
                for jj in range(jn):
                    p = arg[cur, jj]
                    c = tb[rows[p]]
                    out_i[v, jb + jj] = coords[p]
                    out_t[v, jb + jj] = np.int64(np.floor(logs[p] * c[0, jj] + c[1, jj]))


_fill_constants = njit(nogil=True, parallel=True, cache=True)(_fill_constants_impl)
_fill_constants_serial = njit(nogil=True, cache=True)(_fill_constants_impl)
_sample = njit(nogil=True, parallel=True, cache=True)(_sample_impl)
_sample_serial = njit(nogil=True, cache=True)(_sample_impl)


@njit(nogil=True, cache=True)
def _split_dense(X, center, use_center):
    """Sign-split dense rows into CSR over the 2D space with ln ũ as the values."""
    n, d = X.shape
    indptr = np.zeros(n + 1, dtype=np.int64)
    for v in range(n):
        cnt = 0
        for i in range(d):
            x = np.float64(X[v, i]) - center[i] if use_center else np.float64(X[v, i])
            if x != 0.0:
                cnt += 1
        indptr[v + 1] = indptr[v] + cnt
    coords = np.empty(indptr[n], dtype=np.int64)
    logs = np.empty(indptr[n], dtype=np.float64)
    for v in range(n):
        p = indptr[v]
        for i in range(d):
            # Widen first: numba's log of a float32 is a float32, and sketches must not
            # depend on the input's dtype.
            x = np.float64(X[v, i]) - center[i] if use_center else np.float64(X[v, i])
            if x > 0.0:
                coords[p] = 2 * i
                logs[p] = math.log(x)
                p += 1
            elif x < 0.0:
                coords[p] = 2 * i + 1
                logs[p] = math.log(-x)
                p += 1
    return indptr, coords, logs


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
            x = np.float64(data[p])  # widen first (see _split_dense)
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
    with PARALLEL_LOCK:
        table = _fill_constants(np.arange(dim2, dtype=np.int64), k, np.uint64(seed))
    table.setflags(write=False)
    return table


def table_fits(dim: int, k: int, budget: int = TABLE_BUDGET_BYTES) -> bool:
    """Whether a full constant table for ``dim`` input dimensions and ``k`` samples fits."""
    padded = -(-k // _JB) * _JB
    return 2 * dim * padded * 32 <= budget


def _as_split(X, center, check: bool = True):
    """Input → (n, dim, indptr, coords, logs) over the 2D space (validated unless ``check=False``)."""
    if not check and center is None:
        if sp.issparse(X):
            X = X if sp.isspmatrix_csr(X) and X.has_sorted_indices else sp.csr_matrix(X)
            return X.shape[0], X.shape[1], *_split_csr(X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data)
        X = np.ascontiguousarray(np.atleast_2d(X))
        return X.shape[0], X.shape[1], *_split_dense(X, np.zeros(1), False)
    if sp.issparse(X) and center is None:
        X = check_batch(X)
        return X.shape[0], X.shape[1], *_split_csr(X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data)
    if sp.issparse(X):
        X = X.toarray()  # centring makes a sparse vector dense
    X = check_batch(X) if center is None else np.atleast_2d(np.asarray(X, dtype=np.float64))
    c = np.zeros(X.shape[1]) if center is None else np.ascontiguousarray(center, dtype=np.float64)
    if c.shape != (X.shape[1],):
        raise ValueError(f"center: expected {X.shape[1]} values, got shape {c.shape}")
    if center is not None:
        # check_batch was skipped (a zero row is fine once centred): NaN/inf must still be refused
        from core.validate import NonFiniteError

        if not np.isfinite(c).all():
            raise NonFiniteError("center", "values must be finite")
        bad = np.flatnonzero(~np.isfinite(X - c).all(axis=1))
        if bad.size:
            raise NonFiniteError(f"vectors[{int(bad[0])}]", "values must be finite")
    indptr, coords, logs = _split_dense(np.ascontiguousarray(X), c, center is not None)
    empty = np.flatnonzero(np.diff(indptr) == 0)
    if empty.size:
        from core.validate import ZeroVectorError

        raise ZeroVectorError(f"vectors[{int(empty[0])}]", "equals the center: nothing to sample")
    return X.shape[0], X.shape[1], indptr, coords, logs


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
    one = not sp.issparse(X) and np.ndim(X) == 1
    n, dim, indptr, coords, logs = _as_split(X, center, check)
    if path == "auto":
        path = "table" if table_fits(dim, k) else "direct"
    if path == "table":
        table = constant_table(2 * dim, k, int(seed))
        rows = coords
    elif path == "direct":
        uniq, rows = np.unique(coords, return_inverse=True)
        if uniq.shape[0] * k >= PARALLEL_MIN_WORK // 16:
            with PARALLEL_LOCK:
                table = _fill_constants(uniq, k, np.uint64(seed))
        else:
            table = _fill_constants_serial(uniq, k, np.uint64(seed))
        rows = rows.astype(np.int64).reshape(-1)
    else:
        raise ValueError(f"path: expected 'auto', 'table' or 'direct', got {path!r}")
    out_i = np.empty((n, k), dtype=np.int32)
    out_t = np.empty((n, k), dtype=np.int64)
    if n > 1 and coords.shape[0] * k >= PARALLEL_MIN_WORK:
        with PARALLEL_LOCK:
            _sample(indptr, rows, coords, logs, table, k, out_i, out_t)
    else:
        _sample_serial(indptr, rows, coords, logs, table, k, out_i, out_t)
    if one:
        out_i, out_t = out_i[0], out_t[0]
    return (out_i, out_t) if return_t else out_i


def sketch_sparse_vector(indices, values, dim: int, k: int, seed: int = 0, **kw):
    """Sketch one sparse vector given as sorted indices and values."""
    idx, val = check_sparse(indices, values, dim)
    X = sp.csr_matrix((val, idx, np.array([0, idx.size])), shape=(1, dim))
    out = sketch(X, k, seed, **kw)
    return tuple(o[0] for o in out) if isinstance(out, tuple) else out[0]


# --- b-bit codes -----------------------------------------------------------------


@njit(nogil=True, cache=True)
def _codes(istar, tstar, use_t, t_bits, b, seed):
    n, k = istar.shape
    out = np.empty((n, k), dtype=np.uint16)
    mask = np.uint64((1 << b) - 1)
    tmask = np.int64((1 << t_bits) - 1)
    s = np.uint64(seed)
    for v in range(n):
        for j in range(k):
            val = np.uint64(istar[v, j])
            if use_t:
                val = val | (np.uint64(tstar[v, j] & tmask) << np.uint64(32))
            out[v, j] = np.uint16(hash_code(s, np.uint64(j), val) & mask)
    return out


def bbit_codes(istar, b: int = 8, seed: int = 0, tstar=None, t_bits: int = 0) -> np.ndarray:
    """Keep ``b`` bits per sample (uint16, b ≤ 16), optionally mixing in ``t_bits`` of t*.

    The bits are the low bits of a per-sample hash of ``i*`` rather than of
    ``i*`` itself: after the sign split the lowest bit of ``i*`` is the sign,
    which is constant on non-negative data, and the raw low bits of structured
    data (pixels, words) are far from uniform. Hashing makes two different
    ``i*`` collide with probability exactly ``2^-b``, so
    ``Pr[equal] = GMM + (1 − GMM)·2^-b`` holds on any data.
    """
    if not 1 <= b <= 16:
        raise ValueError(f"b: must be between 1 and 16, got {b}")
    if not 0 <= t_bits <= 16:
        raise ValueError(f"t_bits: must be between 0 and 16, got {t_bits}")
    ist = np.atleast_2d(np.asarray(istar, dtype=np.int32))
    use_t = tstar is not None and t_bits > 0
    tst = np.atleast_2d(np.asarray(tstar, dtype=np.int64)) if use_t else np.zeros((1, 1), np.int64)
    out = _codes(ist, tst, use_t, t_bits, b, np.uint64(seed))
    return out[0] if np.ndim(istar) == 1 else out


@njit(nogil=True, cache=True)
def _pack(codes, b, nbytes):
    n, k = codes.shape
    out = np.zeros((n, nbytes), dtype=np.uint8)
    for v in range(n):
        bit = 0
        for j in range(k):
            c = np.int64(codes[v, j])
            for q in range(b):
                if (c >> q) & 1:
                    out[v, (bit + q) >> 3] |= np.uint8(1 << ((bit + q) & 7))
            bit += b
    return out


@njit(nogil=True, cache=True)
def _unpack(packed, k, b):
    n = packed.shape[0]
    out = np.zeros((n, k), dtype=np.uint16)
    for v in range(n):
        bit = 0
        for j in range(k):
            c = 0
            for q in range(b):
                pos = bit + q
                if (packed[v, pos >> 3] >> (pos & 7)) & 1:
                    c |= 1 << q
            out[v, j] = c
            bit += b
    return out


def packed_bytes(k: int, b: int) -> int:
    """Bytes taken by ``k`` codes of ``b`` bits."""
    return (k * b + 7) // 8


def pack_codes(codes, b: int) -> np.ndarray:
    """Pack b-bit codes (n, k) into bytes (n, ceil(k·b/8)), least significant bit first."""
    c = np.atleast_2d(np.asarray(codes))
    if b == 8:
        out = c.astype(np.uint8)
    elif b == 16:
        out = c.astype("<u2").view(np.uint8)
    else:
        out = _pack(c.astype(np.uint16), b, packed_bytes(c.shape[1], b))
    return out[0] if np.ndim(codes) == 1 else out


def unpack_codes(packed, k: int, b: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`."""
    p = np.atleast_2d(np.asarray(packed, dtype=np.uint8))
    if b == 8:
        out = p[:, :k].astype(np.uint16)
    elif b == 16:
        out = np.ascontiguousarray(p).view("<u2")[:, :k].astype(np.uint16)
    else:
        out = _unpack(p, k, b)
    return out[0] if np.ndim(packed) == 1 else out


# --- estimators --------------------------------------------------------------------


def collision_rate(a, b) -> np.ndarray | float:
    """Share of samples on which two sketches agree (last axis)."""
    return np.mean(np.asarray(a) == np.asarray(b), axis=-1)


def estimate_gmm(a, b, bits: int | None = None):
    """GMM estimate from two sketches; with ``bits`` corrects the b-bit chance collisions.

    ``Pr = GMM + (1 − GMM)·2^-b`` inverts to ``GMM = (Pr − 2^-b) / (1 − 2^-b)``.
    """
    rate = collision_rate(a, b)
    if bits is None:
        return rate
    return corrected_rate(rate, bits)


def corrected_rate(rate, bits: int):
    """Undo the ``2^-b`` chance collisions of b-bit codes (may go slightly below 0)."""
    chance = 2.0**-bits
    return (np.asarray(rate) - chance) / (1.0 - chance)


def bbit_collision_probability(gmm, bits: int):
    """Expected collision probability of b-bit codes for a pair with this GMM."""
    return np.asarray(gmm) + (1.0 - np.asarray(gmm)) * 2.0**-bits
