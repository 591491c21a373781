"""Exact GMM (core.gmm) against a literal computation of the paper's eq. (2)-(3).

The kernels never build the 2D sign-split vectors; these tests do, exactly as
eq. (2) of Li's GMM paper writes them (1-based: ``ũ_{2i-1} = u_i, ũ_{2i} = 0`` if
``u_i > 0``, else ``ũ_{2i-1} = 0, ũ_{2i} = -u_i``), then take eq. (3)
``Σ min / Σ max``. Agreement is asked to 1e-9 (relative), far above float64
rounding of a few thousand terms and far below any error a wrong sign rule,
a missed coordinate or a wrong norm would cause.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmmlsh.core.gmm import gmm, gmm_many, gmm_matrix, l1_norms, rbf, score_rows

RTOL = 1e-9
ATOL = 1e-12


# --- the literal reference ------------------------------------------------------------


def paper_transform(u) -> list[float]:
    """Eq. (2), written out with the paper's 1-based indices (``u_i <= 0`` goes to slot 2i)."""
    D = len(u)
    t = [0.0] * (2 * D)
    for i in range(1, D + 1):
        x = float(u[i - 1])
        if x > 0:
            t[2 * i - 1 - 1], t[2 * i - 1] = x, 0.0
        else:
            t[2 * i - 1 - 1], t[2 * i - 1] = 0.0, -x
    return t


def literal_gmm(u, v) -> float:
    """Eq. (3) on the eq. (2) vectors, summed exactly (math.fsum) so the reference has no rounding."""
    a, b = paper_transform(u), paper_transform(v)
    return math.fsum(min(x, y) for x, y in zip(a, b, strict=True)) / math.fsum(
        max(x, y) for x, y in zip(a, b, strict=True)
    )


def literal_gmm_rows(q, X) -> np.ndarray:
    """Eq. (2)-(3) of ``q`` against every row of ``X``, vectorised (the same 2D arrays, built whole)."""
    Xd = X.toarray() if sp.issparse(X) else np.asarray(X)
    Xd = np.atleast_2d(Xd).astype(np.float64)
    q = np.asarray(q, dtype=np.float64)

    def tilde(A):
        T = np.zeros(A.shape[:-1] + (2 * A.shape[-1],))
        T[..., 0::2] = np.where(A > 0, A, 0.0)
        T[..., 1::2] = np.where(A > 0, 0.0, -A)
        return T

    tq, tx = tilde(q), tilde(Xd)
    return np.minimum(tq, tx).sum(axis=1) / np.maximum(tq, tx).sum(axis=1)


def signed_rows(rng: np.random.Generator, n: int, d: int, zero_frac: float = 0.4) -> np.ndarray:
    """Heavy-tailed signed rows with exact zeros; no row is all zero."""
    X = rng.standard_normal((n, d)) * rng.exponential(1.0, (n, d))
    X[rng.random((n, d)) < zero_frac] = 0.0
    X[~X.any(axis=1), 0] = 1.0
    return X


def related(rng: np.random.Generator, u: np.ndarray) -> np.ndarray:
    """A vector sharing coordinates with ``u``: equal, rescaled, sign-flipped, zeroed or fresh."""
    v = u.copy()
    pick = rng.integers(0, 5, u.shape[0])
    v[pick == 1] *= rng.uniform(0.2, 3.0, (pick == 1).sum())
    v[pick == 2] *= -1.0
    v[pick == 3] = 0.0
    v[pick == 4] = rng.standard_normal((pick == 4).sum())
    if not v.any():
        v[0] = 1.0
    return v


def as_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.flatnonzero(x)
    return idx, x[idx]


def csr_with_stored_zeros(rng: np.random.Generator, Xd: np.ndarray) -> sp.csr_matrix:
    """CSR of ``Xd`` with a few explicit zeros stored and each row's indices shuffled."""
    indptr, indices, data = [0], [], []
    for row in Xd:
        nz = np.flatnonzero(row)
        zeros = rng.choice(np.flatnonzero(row == 0), size=min(3, int((row == 0).sum())), replace=False)
        cols = rng.permutation(np.r_[nz, zeros])
        indices.extend(cols)
        data.extend(row[cols])
        indptr.append(len(indices))
    X = sp.csr_matrix((np.array(data), np.array(indices), np.array(indptr)), shape=Xd.shape)
    X.has_sorted_indices = False
    return X


# --- known values ---------------------------------------------------------------------


def test_paper_example_and_hand_values() -> None:
    """The paper's own example u = [-5, 3] → ũ = [0, 5, 3, 0], and hand-computed GMMs."""
    assert paper_transform([-5, 3]) == [0.0, 5.0, 3.0, 0.0]
    # ũ = [0,5,3,0], ṽ = [0,2,4,0]: Σmin = 2 + 3, Σmax = 5 + 4
    assert gmm(np.array([-5.0, 3.0]), np.array([-2.0, 4.0])) == pytest.approx(5 / 9, rel=RTOL)
    # opposite signs share nothing
    assert gmm(np.array([1.0, 0.0]), np.array([-1.0, 0.0])) == 0.0
    # zeros on one side only: Σmin = 1, Σmax = 1 + 2 + 3
    assert gmm(np.array([1.0, 2.0, 0.0]), np.array([1.0, 0.0, -3.0])) == pytest.approx(1 / 6, rel=RTOL)
    u = np.array([0.5, -2.0, 0.0, 7.0])
    assert gmm(u, u) == pytest.approx(1.0, rel=RTOL)
    assert gmm(u, 3.0 * u) == pytest.approx(1 / 3, rel=RTOL)


# --- gmm on pairs ---------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 17, 300])
def test_gmm_dense_pairs_match_literal(d: int) -> None:
    rng = np.random.default_rng(100 + d)
    X = signed_rows(rng, 60, d)
    for u in X:
        for v in (related(rng, u), signed_rows(rng, 1, d)[0]):
            assert gmm(u, v) == pytest.approx(literal_gmm(u, v), rel=RTOL, abs=ATOL)


def test_gmm_sparse_forms_match_literal() -> None:
    """Every input form — dense, (indices, values), 1-row CSR — in every combination."""
    rng = np.random.default_rng(7)
    d = 200
    X = signed_rows(rng, 40, d, zero_frac=0.9)
    for u in X:
        v = related(rng, u)
        want = literal_gmm(u, v)
        forms_u = [u, as_pair(u), sp.csr_matrix(u)]
        forms_v = [v, as_pair(v), sp.csr_matrix(v)]
        for fu in forms_u:
            for fv in forms_v:
                assert gmm(fu, fv) == pytest.approx(want, rel=RTOL, abs=ATOL)


def test_gmm_float32_and_integer_inputs() -> None:
    rng = np.random.default_rng(8)
    X = signed_rows(rng, 20, 50).astype(np.float32)
    for u, v in zip(X[:10], X[10:], strict=True):
        assert gmm(u, v) == pytest.approx(literal_gmm(u, v), rel=RTOL, abs=ATOL)
    a = rng.integers(-5, 6, 40)
    b = rng.integers(-5, 6, 40)
    a[0] = b[0] = 1
    assert gmm(a, b) == pytest.approx(literal_gmm(a, b), rel=RTOL, abs=ATOL)


# --- one against many -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gmm_many_dense_rows(dtype) -> None:
    rng = np.random.default_rng(11)
    X = signed_rows(rng, 300, 64).astype(dtype)
    for q in (X[0].astype(np.float64), related(rng, X[5].astype(np.float64)), signed_rows(rng, 1, 64)[0]):
        want = literal_gmm_rows(q, X)
        np.testing.assert_allclose(gmm_many(q, X), want, rtol=RTOL, atol=ATOL)
        # sparse query against dense rows: (indices, values) and a CSR row
        np.testing.assert_allclose(gmm_many(as_pair(q), X), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(gmm_many(sp.csr_matrix(q), X), want, rtol=RTOL, atol=ATOL)
        # precomputed norms give the same
        np.testing.assert_allclose(gmm_many(q, X, l1_norms(X)), want, rtol=RTOL, atol=ATOL)


def test_gmm_many_csr_rows() -> None:
    """CSR rows, including stored zeros and unsorted indices, against dense and sparse queries."""
    rng = np.random.default_rng(12)
    Xd = signed_rows(rng, 250, 500, zero_frac=0.95)
    X = sp.csr_matrix(Xd)
    Xz = csr_with_stored_zeros(rng, Xd)
    assert Xz.nnz > X.nnz
    for q in (Xd[3], related(rng, Xd[9]), signed_rows(rng, 1, 500, zero_frac=0.5)[0]):
        want = literal_gmm_rows(q, Xd)
        for XX in (X, Xz):
            np.testing.assert_allclose(gmm_many(q, XX), want, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(gmm_many(as_pair(q), XX), want, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(gmm_many(sp.csr_matrix(q), XX), want, rtol=RTOL, atol=ATOL)


def test_score_rows_subset() -> None:
    """A subset of rows (unordered, repeated) scores exactly those rows; an empty subset is empty."""
    rng = np.random.default_rng(13)
    Xd = signed_rows(rng, 400, 80, zero_frac=0.6)
    q = related(rng, Xd[17])
    sub = np.array([17, 3, 399, 3, 0, 250])
    for X in (Xd, Xd.astype(np.float32), sp.csr_matrix(Xd)):
        want = literal_gmm_rows(q, X[sub])
        norms = l1_norms(X)
        np.testing.assert_allclose(score_rows(q, X, sub), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(score_rows(q, X, sub, norms), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(score_rows(as_pair(q), X, sub, norms), want, rtol=RTOL, atol=ATOL)
        assert score_rows(q, X, np.array([], dtype=np.int64)).shape == (0,)


def test_gmm_matrix_matches_literal_and_gmm_many() -> None:
    rng = np.random.default_rng(14)
    X = signed_rows(rng, 333, 40)
    Q = np.vstack([related(rng, X[i]) for i in range(7)] + [signed_rows(rng, 3, 40)])
    M = gmm_matrix(Q, X)
    assert M.shape == (10, 333)
    for a, q in enumerate(Q):
        np.testing.assert_allclose(M[a], literal_gmm_rows(q, X), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        gmm_matrix(Q, X.astype(np.float32)), gmm_matrix(Q, X.astype(np.float32).astype(np.float64)), rtol=RTOL
    )
    np.testing.assert_allclose(gmm_matrix(Q[0], X)[0], gmm_many(Q[0], X), rtol=RTOL, atol=ATOL)


def test_l1_norms_dense_and_sparse() -> None:
    rng = np.random.default_rng(15)
    X = signed_rows(rng, 50, 30)
    want = np.abs(X).sum(axis=1)
    np.testing.assert_allclose(l1_norms(X), want, rtol=1e-12)
    np.testing.assert_allclose(
        l1_norms(X.astype(np.float32)), np.abs(X.astype(np.float32)).astype(np.float64).sum(axis=1), rtol=1e-12
    )
    np.testing.assert_allclose(l1_norms(sp.csr_matrix(X)), want, rtol=1e-12)


# --- Fashion-MNIST ----------------------------------------------------------------------


def test_fmnist_pairs_and_many(fmnist) -> None:
    """Real data: random pairs, one query against many (uint8 and float32 rows, serial and
    parallel kernels), and a gmm_matrix block."""
    train, _, test, _ = fmnist
    rng = np.random.default_rng(16)
    a = rng.integers(0, train.shape[0], 100)
    b = rng.integers(0, train.shape[0], 100)
    for i, j in zip(a, b, strict=True):
        assert gmm(train[i], train[j]) == pytest.approx(literal_gmm(train[i], train[j]), rel=RTOL, abs=ATOL)
    # 2,000 rows × 784 crosses the parallel-kernel threshold (≥ 2^20 multiply-adds)
    X = train[:2000]
    X32 = X.astype(np.float32)
    for q in test[:5]:
        want = literal_gmm_rows(q, X)
        np.testing.assert_allclose(gmm_many(q, X), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(gmm_many(q.astype(np.float32), X32), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(score_rows(q, X32, np.arange(0, 2000, 7)), want[::7], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            gmm_many(as_pair(q.astype(np.float64)), sp.csr_matrix(X32)), want, rtol=RTOL, atol=ATOL
        )
    M = gmm_matrix(test[:12], X32)
    for r in range(12):
        np.testing.assert_allclose(M[r], literal_gmm_rows(test[r], X), rtol=RTOL, atol=ATOL)


# --- rbf ------------------------------------------------------------------------------


def test_rbf_is_exp_of_correlation() -> None:
    rng = np.random.default_rng(17)
    u, v = rng.standard_normal((2, 30))
    rho = float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))
    for gamma in (0.5, 1.0, 5.0):
        assert rbf(u, v, gamma) == pytest.approx(math.exp(-gamma * (1 - rho)), rel=1e-12)
    assert rbf(u, 2.5 * u, 3.0) == pytest.approx(1.0, rel=1e-12)


# --- properties -----------------------------------------------------------------------

_values = st.one_of(
    st.just(0.0),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, allow_subnormal=False),
    st.integers(-3, 3).map(float),
)


@st.composite
def vector_pairs(draw) -> tuple[np.ndarray, np.ndarray]:
    d = draw(st.integers(1, 24))
    u = np.array(draw(st.lists(_values, min_size=d, max_size=d)))
    v = np.array(draw(st.lists(_values, min_size=d, max_size=d)))
    if not u.any():
        u[draw(st.integers(0, d - 1))] = draw(st.sampled_from([1.0, -2.5]))
    if not v.any():
        v[draw(st.integers(0, d - 1))] = draw(st.sampled_from([1.0, -0.5]))
    return u, v


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vector_pairs())
def test_gmm_properties(pair: tuple[np.ndarray, np.ndarray]) -> None:
    """Symmetric, in [0, 1] (exactly: a service must never report 1.0000000000000002),
    1 on identical vectors, equal to the literal formula, the same in every input form."""
    u, v = pair
    g = gmm(u, v)
    assert 0.0 <= g <= 1.0
    assert g == pytest.approx(gmm(v, u), rel=1e-12, abs=1e-15)
    assert g == pytest.approx(literal_gmm(u, v), rel=RTOL, abs=ATOL)
    assert gmm(as_pair(u), as_pair(v)) == pytest.approx(g, rel=1e-12, abs=1e-15)
    for w in (u, v):
        same = gmm(w, w.copy())
        assert 0.0 <= same <= 1.0
        assert same == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_allclose(gmm_many(u, np.vstack([v, u])), [literal_gmm(u, v), 1.0], rtol=RTOL, atol=ATOL)
