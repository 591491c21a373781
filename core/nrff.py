"""Normalized random Fourier features (NRFF): the RBF-kernel sketch used as a dense comparison mode.

``f_j = √2·cos(√γ·⟨u/‖u‖₂, w_j⟩ + φ_j)`` with ``w_j ~ N(0, I)``, ``φ_j ~ U(0, 2π)``,
then ``f`` is scaled to unit length, so ``⟨f(u), f(v)⟩`` estimates
``exp(−γ(1 − ρ))`` with the asymptotic variance ``V_n/k`` of Theorem 3.

``w_ij`` and ``φ_j`` come from the same counter-based generator as GCWS
(Box–Muller on two uniforms), so features are reproducible anywhere. Only the
rows of ``W`` for coordinates a batch actually uses are generated, in slabs of
at most :data:`SLAB_BYTES`, so 55,000-dim sparse input never needs a dense
``D × k`` matrix.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import scipy.sparse as sp
from numba import njit

from gmmlsh.core.parallel import spread
from gmmlsh.core.rng import coord_key, uniform
from gmmlsh.core.validate import check_batch

#: Largest slab of W rows held at once.
SLAB_BYTES = 32 << 20
_W_SALT = np.uint64(0x6E72FF0000000001)
_PHI_SALT = np.uint64(0x6E72FF0000000002)


@njit(nogil=True, cache=True)
def _gaussian_fill(coords, k, seed, out):
    """Rows ``coords`` of W into ``out`` (len(coords), k): standard normals by Box–Muller."""
    s = np.uint64(seed) ^ _W_SALT
    for a in range(coords.shape[0]):
        ck = coord_key(s, np.uint64(coords[a]))
        for j in range(k):
            u1 = uniform(ck, np.uint64(j), np.uint64(0))
            u2 = uniform(ck, np.uint64(j), np.uint64(1))
            out[a, j] = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _gaussian_rows(coords: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Rows ``coords`` of W (len(coords), k), spread over the cores."""
    out = np.empty((coords.shape[0], k))
    spread(lambda lo, hi: _gaussian_fill(coords[lo:hi], k, np.uint64(seed), out[lo:hi]), coords.shape[0],
           coords.shape[0] * k * 16)
    return out


@njit(nogil=True, cache=True)
def _phases(k, seed):
    out = np.empty(k)
    ck = coord_key(np.uint64(seed) ^ _PHI_SALT, np.uint64(0))
    for j in range(k):
        out[j] = 2.0 * math.pi * uniform(ck, np.uint64(j), np.uint64(0))
    return out


@functools.lru_cache(maxsize=4)
def _dense_w(dim: int, k: int, seed: int) -> np.ndarray:
    w = _gaussian_rows(np.arange(dim, dtype=np.int64), k, seed)
    w.setflags(write=False)
    return w


def _slab_rows(k: int) -> int:
    return max(1, SLAB_BYTES // (8 * k))


def projections(X, k: int, seed: int = 0) -> np.ndarray:
    """``X @ W`` for rows of ``X`` scaled to unit L2 norm; (n, k) float64."""
    X = check_batch(X)
    n, dim = X.shape
    out = np.zeros((n, k))
    if sp.issparse(X):
        norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
        X = sp.csr_matrix(sp.diags(1.0 / norms) @ X)
        cols = np.unique(X.indices)
        step = _slab_rows(k)
        for lo in range(0, cols.shape[0], step):
            part = cols[lo : lo + step]
            w = _gaussian_rows(part.astype(np.int64), k, seed)
            out += X[:, part] @ w
        return out
    Xn = X / np.linalg.norm(X, axis=1, keepdims=True)
    if dim * k * 8 <= SLAB_BYTES:
        return Xn @ _dense_w(dim, k, int(seed))
    step = _slab_rows(k)
    for lo in range(0, dim, step):
        w = _gaussian_rows(np.arange(lo, min(dim, lo + step), dtype=np.int64), k, seed)
        out += Xn[:, lo : lo + step] @ w
    return out


def features(X, k: int, gamma: float, seed: int = 0) -> np.ndarray:
    """NRFF features of each row: (n, k) float64 unit rows (1-D input gives one row)."""
    if k <= 0:
        raise ValueError(f"k: must be positive, got {k}")
    if not gamma > 0 or not math.isfinite(gamma):
        raise ValueError(f"gamma: must be a positive number, got {gamma}")
    one = not sp.issparse(X) and np.ndim(X) == 1
    f = np.sqrt(2.0) * np.cos(math.sqrt(gamma) * projections(X, k, seed) + _phases(k, np.uint64(seed)))
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    return f[0] if one else f


def rbf_from_correlation(rho, gamma: float):
    """``exp(−γ(1 − ρ))``."""
    return np.exp(-gamma * (1.0 - np.asarray(rho)))


def nrff_variance(rho, gamma: float):
    """Asymptotic ``V_n`` of Theorem 3: ``k·Var[⟨f(u), f(v)⟩] → V_n``."""
    e = np.exp(-gamma * (1.0 - np.asarray(rho, dtype=np.float64)))
    v = 0.5 + 0.5 * (1.0 - e**2) ** 2
    return v - 0.25 * e**2 * (3.0 - e**4)


def rff_variance(rho, gamma: float):
    """Variance ``V`` of the un-normalised RFF estimator (Theorem 3, eq. 21)."""
    e = np.exp(-gamma * (1.0 - np.asarray(rho, dtype=np.float64)))
    return 0.5 + 0.5 * (1.0 - e**2) ** 2
