"""NRFF (core.nrff): Theorem 3 of "Linearized GMM Kernels and Normalized RFF", statistically,
and the reproducibility of the features.

For unit-normalised u, v the projections x = ⟨û, w⟩, y = ⟨v̂, w⟩ are exactly
N(0, 1) with correlation ρ = cos(u, v), whatever the dimension, so any pair with
a known cosine realises the theorem's setting exactly.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import gmmlsh.core.nrff as nrff
from gmmlsh.core.nrff import features, nrff_variance, rbf_from_correlation, rff_variance

Z = 4.0  # standard errors; two-sided normal tail 6.3e-5 per comparison


def pair_with_correlation(rho: float, d: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two vectors with cosine exactly ρ (up to rounding), different norms, signed entries."""
    q, _ = np.linalg.qr(rng.standard_normal((d, 2)))
    u = 3.0 * q[:, 0]
    v = 0.7 * (rho * q[:, 0] + math.sqrt(1 - rho**2) * q[:, 1])
    return u, v


def nrff_bias(e: float, k: int) -> float:
    """Second-order (delta-method) bias of the normalised estimator: −E(1 − E⁴)/(8k).

    With a = mean XY, b = mean X², c = mean Y² the estimator is a/sqrt(bc); expanding
    to second order around (E, 1, 1) with the single-sample covariances
    Cov(XY, X²) = Cov(XY, Y²) = E/2, Var X² = Var Y² = 1/2, Cov(X², Y²) = E⁴/2 gives
    k·bias = −E/2 + 3E/8 + E⁵/8. Its size is at most 0.067/k (at E ≈ 0.67).
    """
    return -e * (1 - e**4) / (8 * k)


# ρ per γ so that E = e^{−γ(1−ρ)} spans ≈ 0.37-0.78 at every γ, V_n is not tiny and
# the O(1/k²) term of Theorem 3 is negligible at k = 256.
CASES = {0.5: (-0.5, 0.0, 0.5), 1.0: (0.25, 0.5, 0.75), 5.0: (0.8, 0.9, 0.95)}
N_SEEDS = 1500
K = 256


@pytest.mark.slow
@pytest.mark.parametrize("gamma", sorted(CASES))
def test_theorem3_mean_and_variance(gamma: float) -> None:
    """Over 1,500 seeds at k = 256, for three correlations:

    - the mean of ⟨f(u), f(v)⟩ is within 4·sqrt(V_n/(k·n)) of e^{−γ(1−ρ)} + bias, bias
      the O(1/k) normalisation bias of :func:`nrff_bias`. The bias is at most 0.35 SE
      here (2.4e-4 against an SE of 6.8e-4 at E = 0.78), so it barely matters, but the
      expectation is the honest centre (asserted: |bias| < 0.5 SE).
    - k·Var is within 20 % of V_n. The relative SE of a sample variance is
      sqrt((2 + κ)/(n − 1)), κ the excess kurtosis (≈ 0: Theorem 3's limit is
      normal); the test asserts that 20 % ≥ 4 such SE with the *observed* κ. The
      O(1/k²) remainder is ≈ 0.2 % of V_n at k = 256 (a simulation at k = 16 shows
      ≈ 3.6 %, scaling as 1/k).
    6 comparisons per γ: family-wise ≤ 0.04 %.
    """
    rng = np.random.default_rng(int(gamma * 10))
    rhos = CASES[gamma]
    X = np.vstack([np.vstack(pair_with_correlation(r, 24, rng)) for r in rhos])
    est = np.empty((N_SEEDS, len(rhos)))
    for s in range(N_SEEDS):
        f = features(X, K, gamma, seed=s)
        est[s] = np.einsum("ij,ij->i", f[0::2], f[1::2])
    fails = []
    for j, rho in enumerate(rhos):
        e = float(rbf_from_correlation(rho, gamma))
        vn = float(nrff_variance(rho, gamma))
        se = math.sqrt(vn / (K * N_SEEDS))
        bias = nrff_bias(e, K)
        assert abs(bias) < 0.5 * se
        mean = est[:, j].mean()
        if abs(mean - (e + bias)) > Z * se:
            fails.append(f"ρ={rho}: mean {mean:.5f} vs {e:.5f}{bias:+.5f} ({(mean - e - bias) / se:+.1f} SE)")
        var = est[:, j].var(ddof=1)
        c = est[:, j] - mean
        kurt = float(np.mean(c**4) / np.mean(c**2) ** 2 - 3)
        assert Z * math.sqrt((2 + kurt) / (N_SEEDS - 1)) <= 0.20, "too few seeds for a 20 % bound at 4 SE"
        if abs(K * var / vn - 1) > 0.20:
            fails.append(f"ρ={rho}: k·Var/V_n = {K * var / vn:.3f}")
    assert not fails, f"γ={gamma}\n" + "\n".join(fails)


def test_variance_formulas() -> None:
    """V (eq. 21) from the single-sample moments, V_n (eq. 20) from the delta method.

    E[X²Y²] = 1 + E⁴/2, so V = 1 − E² + E⁴/2; linearising a/sqrt(bc) gives
    V_n = Var(XY − (E/2)(X² + Y²)) = V − E²/4·(3 − E⁴). V_n = 0 at ρ = 1, V_n < V below.
    """
    for gamma in (0.5, 1.0, 5.0):
        rho = np.linspace(-1, 1, 41)
        e = np.exp(-gamma * (1 - rho))
        v = 1 - e**2 + e**4 / 2
        np.testing.assert_allclose(rff_variance(rho, gamma), v, rtol=1e-12)
        np.testing.assert_allclose(nrff_variance(rho, gamma), v - e**2 / 4 * (3 - e**4), rtol=1e-12, atol=1e-15)
        assert nrff_variance(1.0, gamma) == pytest.approx(0.0, abs=1e-15)
        assert (nrff_variance(rho[:-1], gamma) < rff_variance(rho[:-1], gamma)).all()


# --- reproducibility --------------------------------------------------------------------


def sparse_rows(rng: np.random.Generator, n: int, d: int, nnz: int) -> np.ndarray:
    X = np.zeros((n, d))
    for r in range(n):
        cols = rng.choice(d, nnz, replace=False)
        X[r, cols] = rng.standard_normal(nnz) * rng.exponential(1.0, nnz)
    return X


def test_unit_rows_shapes_and_scale_invariance() -> None:
    rng = np.random.default_rng(1)
    X = rng.standard_normal((10, 50))
    f = features(X, 128, 1.0, seed=3)
    assert f.shape == (10, 128) and f.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-12)
    one = features(X[4], 128, 1.0, seed=3)
    assert one.shape == (128,)
    np.testing.assert_allclose(one, f[4], rtol=0, atol=1e-12)
    np.testing.assert_allclose(features(X * 17.5, 128, 1.0, seed=3), f, rtol=0, atol=1e-12)
    assert np.abs(features(X, 128, 1.0, seed=4) - f).max() > 0.1
    np.testing.assert_allclose(features(X, 64, 1.0, seed=3), features(X, 64, 1.0, seed=3), rtol=0, atol=0)


@pytest.mark.parametrize("d", [300, 55_197])
def test_dense_and_sparse_agree(d: int) -> None:
    """Dense rows, CSR rows and CSR with stored zeros give the same features to 1e-12."""
    rng = np.random.default_rng(2)
    X = sparse_rows(rng, 12, d, 40)
    f = features(sp.csr_matrix(X), 96, 2.0, seed=7)
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-12)
    M = sp.csr_matrix(X)
    M = sp.csr_matrix((np.r_[M.data, 0.0, 0.0], np.r_[M.indices, 0, 1], np.r_[M.indptr[:-1], M.nnz + 2]), shape=M.shape)
    np.testing.assert_allclose(features(M, 96, 2.0, seed=7), f, rtol=0, atol=1e-12)
    if d <= 1000:
        np.testing.assert_allclose(features(X, 96, 2.0, seed=7), f, rtol=0, atol=1e-12)


def test_slab_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generating W in small slabs (the large-dimension path) changes nothing beyond rounding."""
    rng = np.random.default_rng(3)
    X = sparse_rows(rng, 9, 500, 60)
    dense_f = features(X, 64, 1.0, seed=5)
    sparse_f = features(sp.csr_matrix(X), 64, 1.0, seed=5)
    monkeypatch.setattr(nrff, "SLAB_BYTES", 8 * 64 * 7)  # 7 rows of W at a time
    np.testing.assert_allclose(features(X, 64, 1.0, seed=5), dense_f, rtol=0, atol=1e-12)
    np.testing.assert_allclose(features(sp.csr_matrix(X), 64, 1.0, seed=5), sparse_f, rtol=0, atol=1e-12)


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import scipy.sparse as sp
    from gmmlsh.core.nrff import features
    rng = np.random.default_rng(11)
    X = rng.standard_normal((40, 200)) * (rng.random((40, 200)) < 0.2)
    X[:, 0] += 1.0
    np.savez(sys.argv[1], dense=features(X, 128, 0.5, seed=9), sparse=features(sp.csr_matrix(X), 128, 0.5, seed=9))
    """
)


def test_deterministic_across_processes(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    X = rng.standard_normal((40, 200)) * (rng.random((40, 200)) < 0.2)
    X[:, 0] += 1.0
    out = tmp_path / "child.npz"
    subprocess.run([sys.executable, "-c", _CHILD, str(out)], check=True, env=dict(os.environ), timeout=300)
    got = np.load(out)
    np.testing.assert_allclose(got["dense"], features(X, 128, 0.5, seed=9), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["sparse"], features(sp.csr_matrix(X), 128, 0.5, seed=9), rtol=0, atol=1e-12)
