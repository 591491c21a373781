"""GCWS (core.gcws): Theorem 1, the 0-bit and b-bit schemes, estimator MSE, and consistency.

Statistical bounds
------------------
Each sample j is an independent draw (its constants are a pure function of
``(seed, i, j)``), so the full-sample collision count of a pair is exactly
Binomial(k, GMM) (Theorem 1, eq. 6-7 of the GMM paper). Every statistical check
is "within Z = 4 standard errors" of the exact law: a two-sided normal tail of
6.3e-5 per comparison. With fixed seeds the outcome is deterministic; the bound
is still the principled one, and the family-wise false-alarm rate of each test
(union bound over its comparisons) is stated in the test.

The 0-bit scheme (``i*`` only) is an approximation: ``Pr[i* equal] ≥ GMM``
always, with a bias the 0-bit paper (§3.4, Figures 4-5) found ≪ 1e-4 on word
data. The issue allows it 0.01 on top of 4 SE. On data whose coordinates are
shared unchanged or replaced (the "replace" pairs) and on Fashion-MNIST the bias
stays well within that (≤ 0.004, measured at k = 65,536). On pairs where v is a
*rescaled* blend of u (the "blend" pairs) it is genuinely larger — up to ≈ 0.015
on such pairs (0.001-0.01 on this test's): i* coincides while t* differs because
the ratio ũ_i/ṽ_i is far from 1. That is a property of the scheme, not of this
code — :func:`reference_icws`, a literal numpy Algorithm 1 with its own RNG,
shows the same bias — so on those pairs the 0-bit rate is tested against the
reference instead of against GMM + 0.01.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmmlsh.core import gcws, parallel
from gmmlsh.core.codes import (
    bbit_codes,
    bbit_collision_probability,
    bit_planes,
    collision_rate,
    corrected_rate,
    estimate_gmm,
    pack_codes,
    packed_bytes,
    unpack_codes,
)
from gmmlsh.core.gcws import sketch, sketch_planes, sketch_sparse_vector
from gmmlsh.core.gmm import gmm, gmm_many

Z = 4.0  # standard errors; two-sided normal tail 6.3e-5 per comparison
ZERO_BIT_SLACK = 0.01  # the allowance for the 0-bit approximation


# --- data with controlled GMM ----------------------------------------------------------


def signed_vector(rng: np.random.Generator, d: int, zero_frac: float = 0.3) -> np.ndarray:
    """Heavy-tailed signed values with exact zeros (never all zero)."""
    x = rng.standard_normal(d) * rng.exponential(1.0, d)
    x[rng.random(d) < zero_frac] = 0.0
    if not x.any():
        x[0] = 1.0
    return x


def replace_pair(rng: np.random.Generator, d: int, target: float) -> tuple[np.ndarray, np.ndarray, float]:
    """u and v = u with a random set of coordinates replaced by an independent vector's.

    The number replaced is chosen so that GMM(u, v) is as close to ``target`` as the
    discrete steps allow; the test then uses the exact GMM of the pair.
    """
    u = signed_vector(rng, d)
    w = signed_vector(rng, d)
    order = rng.permutation(d)
    cands = []
    for m in range(d + 1):
        v = u.copy()
        v[order[:m]] = w[order[:m]]
        if v.any():
            cands.append(v)
    V = np.array(cands)
    g = gmm_many(u, V)
    best = int(np.argmin(np.abs(g - target)))
    return u, V[best], float(g[best])


def blend_pair(rng: np.random.Generator, d: int, target: float) -> tuple[np.ndarray, np.ndarray, float]:
    """u and v = (1 − α)u + αw, α bisected so that GMM(u, v) ≈ target."""
    u = signed_vector(rng, d)
    w = signed_vector(rng, d)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if gmm(u, (1 - a) * u + a * w) > target:
            lo = a
        else:
            hi = a
    v = (1 - a) * u + a * w
    return u, v, gmm(u, v)


def fmnist_pairs(train: np.ndarray, targets: list[float]) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Real pairs: for each target, the (query, row) among a few queries × 5,000 rows closest to it."""
    X = train[:5000].astype(np.float64)
    G = np.array([gmm_many(X[q], X) for q in range(8)])
    for q in range(8):
        G[q, q] = -1.0  # not a row with itself
    out = []
    for t in targets:
        q, r = np.unravel_index(np.argmin(np.abs(G - t)), G.shape)
        out.append((X[q], X[r], float(G[q, r])))
    return out


def split(x: np.ndarray) -> np.ndarray:
    """Sign split ũ[2i] = max(u_i, 0), ũ[2i+1] = max(−u_i, 0) (DESIGN §1, 0-based)."""
    t = np.zeros(2 * x.shape[0])
    t[0::2] = np.maximum(x, 0.0)
    t[1::2] = np.maximum(-x, 0.0)
    return t


def reference_icws(U: np.ndarray, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 of the GMM paper written literally, with a stateful numpy RNG.

    ``U``: non-negative (sign-split) rows sharing one draw of (r, c, β) per sample.
    Independent of core.rng and of the numba kernel: a check on the distribution.
    """
    n, _ = U.shape
    nz = np.flatnonzero(U.any(axis=0))
    Unz = U[:, nz]
    with np.errstate(divide="ignore"):
        L = np.where(Unz > 0, np.log(np.where(Unz > 0, Unz, 1.0)), -np.inf)
    I = np.empty((n, k), np.int64)
    T = np.empty((n, k), np.int64)
    for lo in range(0, k, 1024):
        kb = min(1024, k - lo)
        r = rng.gamma(2.0, 1.0, (kb, nz.size))
        c = rng.gamma(2.0, 1.0, (kb, nz.size))
        beta = rng.uniform(0.0, 1.0, (kb, nz.size))
        for v in range(n):
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                t = np.floor(L[v] / r + beta)
                z = np.exp(r * (t - beta))
                a = c / (z * np.exp(r))
            a = np.where(np.isfinite(L[v]), a, np.inf)  # ũ_i = 0 is never sampled
            arg = np.argmin(a, axis=1)
            I[v, lo : lo + kb] = nz[arg]
            T[v, lo : lo + kb] = t[np.arange(kb), arg]
    return I, T


def binomial_ok(count: float, n: float, p: float, z: float = Z) -> bool:
    """|count − n·p| ≤ z·sqrt(n·p·(1 − p)): within z SE of Binomial(n, p)."""
    return abs(count - n * p) <= z * np.sqrt(n * p * (1 - p))


# --- Theorem 1, 0-bit, b-bit ---------------------------------------------------------------

K_THM = 4096
BITS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def theorem_pairs(fmnist) -> list[tuple[str, np.ndarray, np.ndarray, float]]:
    rng = np.random.default_rng(2024)
    levels = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    pairs = [("replace", *replace_pair(rng, 120, t)) for t in levels]
    pairs += [("blend", *blend_pair(rng, 120, t)) for t in (0.1, 0.3, 0.5, 0.7, 0.9)]
    pairs += [("fmnist", *p) for p in fmnist_pairs(fmnist[0], [0.15, 0.3, 0.5, 0.7, 0.85])]
    return pairs


def _sketch_pairs(pairs, k: int, seed: int):
    """Sketch each pair's two rows (all pairs of one dimension in one call)."""
    out = []
    for d in sorted({p[1].shape[0] for p in pairs}):
        idx = [n for n, p in enumerate(pairs) if p[1].shape[0] == d]
        X = np.vstack([np.vstack([pairs[n][1], pairs[n][2]]) for n in idx])
        I, T = sketch(X, k, seed=seed, return_t=True, path="direct")
        out += [(n, I[2 * m], T[2 * m], I[2 * m + 1], T[2 * m + 1]) for m, n in enumerate(idx)]
    return [o[1:] for o in sorted(out, key=lambda o: o[0])]


def test_pairs_cover_the_gmm_range(theorem_pairs) -> None:
    g = {kind: [p[3] for p in theorem_pairs if p[0] == kind] for kind in ("replace", "blend", "fmnist")}
    assert min(g["replace"]) < 0.12 and max(g["replace"]) > 0.88
    assert min(g["fmnist"]) < 0.2 and max(g["fmnist"]) > 0.8
    for kind, u, v, _ in theorem_pairs:
        if kind != "fmnist":
            assert (u < 0).any() and (u == 0).any() and (v < 0).any()


def test_theorem1_full_zero_bit_and_bbit(theorem_pairs) -> None:
    """k = 4096 samples per pair, 19 pairs with GMM 0.1-0.9.

    - full (i*, t*) rate: within 4·sqrt(G(1−G)/k) of G (Theorem 1, exact binomial);
    - 0-bit rate ≥ full rate on every sample set (a full collision is an i* collision);
      within 4 SE + 0.01 of G on the replace and Fashion-MNIST pairs;
    - b-bit codes (b = 1, 2, 4, 8): equal wherever i* is equal, and, where i* differs,
      equal with probability exactly 2^-b (the per-sample hash): the count is within
      4 SE of Binomial(#differ, 2^-b). Hence the rate is Binomial with
      p = P0 + (1 − P0)·2^-b, P0 = Pr[i* equal]. Unconditionally, on the pairs where
      |P0 − G| ≤ 0.01, the rate is within 4·sqrt(p(1−p)/k) + 0.01·(1 − 2^-b) of
      GMM + (1 − GMM)·2^-b, and the corrected estimator within
      4·sqrt(p(1−p)/k)/(1 − 2^-b) + 0.01 of G.
    About 19 + 14 + 4·19 + 2·4·14 = 221 comparisons at 6.3e-5: family-wise ≤ 1.4 %.
    """
    k = K_THM
    fails = []
    for (kind, _, _, G), (iu, tu, iv, tv) in zip(theorem_pairs, _sketch_pairs(theorem_pairs, k, seed=77), strict=True):
        full = np.mean((iu == iv) & (tu == tv))
        zero = np.mean(iu == iv)
        se = np.sqrt(G * (1 - G) / k)
        if abs(full - G) > Z * se:
            fails.append(f"{kind} G={G:.3f}: full rate {full:.4f} is {(full - G) / se:+.1f} SE off")
        if zero < full:
            fails.append(f"{kind} G={G:.3f}: 0-bit rate {zero} < full rate {full}")
        loose = kind != "blend"
        if loose and abs(zero - G) > Z * se + ZERO_BIT_SLACK:
            fails.append(f"{kind} G={G:.3f}: 0-bit rate {zero:.4f} off by {zero - G:+.4f}")
        differ = iu != iv
        for b in BITS:
            cu, cv = bbit_codes(iu, b, seed=77), bbit_codes(iv, b, seed=77)
            same = cu == cv
            if not same[~differ].all():
                fails.append(f"{kind} G={G:.3f} b={b}: codes differ where i* is equal")
            if not binomial_ok(same[differ].sum(), differ.sum(), 2.0**-b):
                fails.append(f"{kind} G={G:.3f} b={b}: {same[differ].sum()} chance collisions of {differ.sum()}")
            rate = collision_rate(cu, cv)
            p = float(bbit_collision_probability(G, b))
            se_b = np.sqrt(p * (1 - p) / k)
            if loose and abs(rate - p) > Z * se_b + ZERO_BIT_SLACK * (1 - 2.0**-b):
                fails.append(f"{kind} G={G:.3f} b={b}: b-bit rate {rate:.4f}, expected {p:.4f}")
            est = estimate_gmm(cu, cv, bits=b)
            if loose and abs(est - G) > Z * se_b / (1 - 2.0**-b) + ZERO_BIT_SLACK:
                fails.append(f"{kind} G={G:.3f} b={b}: corrected estimate {est:.4f}")
    assert not fails, "\n".join(fails)


def test_zero_bit_matches_reference_algorithm(theorem_pairs) -> None:
    """The 0-bit and full rates of our sketch agree with a literal Algorithm 1 (numpy RNG).

    This pins the 0-bit *bias* (which the paper only characterises empirically) to
    the algorithm rather than to our generator: on the blend pairs both show the
    same ≈ 0.014. Bound: 4 SE of the difference of two independent binomial rates,
    sqrt(p(1−p)(1/k + 1/k_ref)); 2 × 19 comparisons, family-wise ≤ 0.3 %.
    """
    k, k_ref = K_THM, 16384
    rng = np.random.default_rng(5)
    fails = []
    for (kind, u, v, G), (iu, tu, iv, tv) in zip(theorem_pairs, _sketch_pairs(theorem_pairs, k, seed=78), strict=True):
        RI, RT = reference_icws(np.vstack([split(u), split(v)]), k_ref, rng)
        for name, ours, ref in (
            ("0-bit", np.mean(iu == iv), np.mean(RI[0] == RI[1])),
            ("full", np.mean((iu == iv) & (tu == tv)), np.mean((RI[0] == RI[1]) & (RT[0] == RT[1]))),
        ):
            p = (ours * k + ref * k_ref) / (k + k_ref)
            se = np.sqrt(max(p * (1 - p), 1e-12) * (1 / k + 1 / k_ref))
            if abs(ours - ref) > Z * se:
                fails.append(f"{kind} G={G:.3f} {name}: ours {ours:.4f} vs reference {ref:.4f}")
    assert not fails, "\n".join(fails)


def test_bbit_codes_with_t_bits() -> None:
    """Codes with t_bits mix in t*: equal whenever (i*, t* mod 2^t_bits) is equal; t_bits=0 ignores t*."""
    rng = np.random.default_rng(9)
    u, v, _ = replace_pair(rng, 60, 0.5)
    I, T = sketch(np.vstack([u, v]), 2048, seed=4, return_t=True)
    np.testing.assert_array_equal(bbit_codes(I, 8, seed=4), bbit_codes(I, 8, seed=4, tstar=T, t_bits=0))
    for tb in (1, 2, 16):
        c = bbit_codes(I, 16, seed=4, tstar=T, t_bits=tb)
        key_equal = (I[0] == I[1]) & ((T[0] - T[1]) % (1 << tb) == 0)
        assert (c[0] == c[1])[key_equal].all()
        # with 16 bits a chance collision among ≈ 1,000 differing keys is rare (p ≈ 1.5 %)
        assert (c[0] == c[1])[~key_equal].sum() <= 2
    assert (bbit_codes(I, 3, seed=4) < 8).all()
    np.testing.assert_array_equal(bbit_codes(I[0], 5, seed=1), bbit_codes(I, 5, seed=1)[0])


# --- estimator MSE over seeds (0-bit paper, Figures 4-5) ------------------------------------

N_SEEDS = 2000
K_MSE = 64


def binomial_excess_kurtosis(p: float, k: int) -> float:
    return (1 - 6 * p * (1 - p)) / (k * p * (1 - p))


@pytest.mark.slow
def test_estimator_mse_over_seeds(fmnist) -> None:
    """2,000 seeds × k = 64: the empirical MSE of the full estimator is within 15 % of
    G(1−G)/k, at G ≈ 0.1, 0.3, 0.5, 0.7, 0.9 (replace pairs) and on a Fashion-MNIST pair.

    Why 2,000: the relative SE of an MSE over n seeds is sqrt((2 + κ)/n), κ the excess
    kurtosis of the binomial estimate ((1 − 6G(1−G))/(kG(1−G)) ≤ 0.08 here), so
    4 SE ≈ 0.13 ≤ 0.15 — asserted below for every level, not assumed.
    Also: the mean over all 128,000 samples is within 4 SE of G (Theorem 1 again,
    now across seeds). The 0-bit estimator is tested with its bias accounted for:
    MSE₀ within 15 % of P̂₀(1−P̂₀)/k + (P̂₀ − G)², P̂₀ its pooled mean, and
    |P̂₀ − G| ≤ 4 SE + 0.01. 6 pairs × 5 comparisons: family-wise ≤ 0.2 %.
    Cost is the per-seed constants of every coordinate touched, so the pairs are kept
    to ≈ 700 distinct coordinates.
    """
    rng = np.random.default_rng(31)
    d = 784
    pairs = []
    for t in (0.1, 0.3, 0.5, 0.7, 0.9):
        u, v, g = replace_pair(rng, 100, t)
        pad = np.zeros(d - 100)  # zero-padding changes neither GMM nor the sketch law
        pairs.append((np.r_[u, pad], np.r_[v, pad], g))
    pairs += fmnist_pairs(fmnist[0], [0.6])
    X = np.vstack([np.vstack([u, v]) for u, v, _ in pairs])
    G = np.array([g for _, _, g in pairs])
    full = np.empty((N_SEEDS, len(pairs)))
    zero = np.empty((N_SEEDS, len(pairs)))
    for s in range(N_SEEDS):
        I, T = sketch(X, K_MSE, seed=1000 + s, return_t=True, path="direct")
        eq_i = I[0::2] == I[1::2]
        full[s] = np.mean(eq_i & (T[0::2] == T[1::2]), axis=1)
        zero[s] = np.mean(eq_i, axis=1)
    fails = []
    for j, g in enumerate(G):
        var = g * (1 - g) / K_MSE
        kappa = binomial_excess_kurtosis(g, K_MSE)
        assert Z * np.sqrt((2 + kappa) / N_SEEDS) <= 0.15, "too few seeds for a 15 % bound at 4 SE"
        mse = np.mean((full[:, j] - g) ** 2)
        if abs(mse / var - 1) > 0.15:
            fails.append(f"G={g:.3f}: full MSE·k/(G(1−G)) = {mse / var:.3f}")
        if abs(full[:, j].mean() - g) > Z * np.sqrt(var / N_SEEDS):
            fails.append(f"G={g:.3f}: mean estimate {full[:, j].mean():.5f}")
        p0 = zero[:, j].mean()
        mse0 = np.mean((zero[:, j] - g) ** 2)
        want0 = p0 * (1 - p0) / K_MSE + (p0 - g) ** 2
        if abs(mse0 / want0 - 1) > 0.15:
            fails.append(f"G={g:.3f}: 0-bit MSE {mse0:.3e} vs variance + bias² {want0:.3e}")
        if abs(p0 - g) > Z * np.sqrt(var / N_SEEDS) + ZERO_BIT_SLACK:
            fails.append(f"G={g:.3f}: 0-bit bias {p0 - g:+.4f}")
        if (zero[:, j] < full[:, j]).any():
            fails.append(f"G={g:.3f}: 0-bit estimate below the full one")
    assert not fails, "\n".join(fails)


# --- consistency ---------------------------------------------------------------------------


def _csr_with_stored_zeros(X: np.ndarray, rng: np.random.Generator) -> sp.csr_matrix:
    """CSR of X with explicit zeros stored and each row's indices shuffled."""
    indptr, indices, data = [0], [], []
    for row in X:
        zeros = np.flatnonzero(row == 0)
        extra = rng.choice(zeros, size=min(5, zeros.size), replace=False)
        cols = rng.permutation(np.r_[np.flatnonzero(row), extra])
        indices.extend(cols.tolist())
        data.extend(row[cols].tolist())
        indptr.append(len(indices))
    M = sp.csr_matrix((np.array(data), np.array(indices), np.array(indptr)), shape=X.shape)
    M.has_sorted_indices = False
    return M


@pytest.fixture(scope="module")
def mixed_rows(fmnist) -> np.ndarray:
    """Signed sparse-ish rows plus Fashion-MNIST rows, 784 wide, 260 of them (> one parallel chunk)."""
    rng = np.random.default_rng(3)
    signed = np.vstack([signed_vector(rng, 784, zero_frac=0.8) for _ in range(60)])
    return np.vstack([signed, fmnist[0][:200].astype(np.float64)])


@pytest.mark.parametrize("path", ["table", "direct"])
def test_dense_sparse_and_stored_zeros_identical(mixed_rows: np.ndarray, path: str) -> None:
    X = mixed_rows
    rng = np.random.default_rng(4)
    I, T = sketch(X, 96, seed=5, return_t=True, path=path)
    for M in (sp.csr_matrix(X), _csr_with_stored_zeros(X, rng), sp.csc_matrix(X), sp.coo_matrix(X)):
        I2, T2 = sketch(M, 96, seed=5, return_t=True, path=path)
        np.testing.assert_array_equal(I, I2)
        np.testing.assert_array_equal(T, T2)
    for r in (0, 59, 60, 259):
        idx = np.flatnonzero(X[r])
        np.testing.assert_array_equal(sketch_sparse_vector(idx, X[r, idx], 784, 96, seed=5, path=path), I[r])


def test_csr_input_is_not_modified(mixed_rows: np.ndarray) -> None:
    """Validation must not change the caller's matrix (stored zeros, index order)."""
    M = _csr_with_stored_zeros(mixed_rows[:20], np.random.default_rng(6))
    before = (M.data.copy(), M.indices.copy(), M.indptr.copy())
    sketch(M, 16)
    for a, b in zip(before, (M.data, M.indices, M.indptr), strict=True):
        np.testing.assert_array_equal(a, b)


def test_single_vs_batch_and_table_vs_direct(mixed_rows: np.ndarray) -> None:
    X = mixed_rows
    for k in (1, 31, 33, 128):
        for seed in (0, 12345, 2**40 + 7):
            I, T = sketch(X, k, seed=seed, return_t=True, path="table")
            I2, T2 = sketch(X, k, seed=seed, return_t=True, path="direct")
            np.testing.assert_array_equal(I, I2)
            np.testing.assert_array_equal(T, T2)
            for r in (0, 63, 64, 200):
                i1, t1 = sketch(X[r], k, seed=seed, return_t=True, path="direct")
                np.testing.assert_array_equal(i1, I[r])
                np.testing.assert_array_equal(t1, T[r])
    np.testing.assert_array_equal(sketch(X, 64, seed=3, path="auto"), sketch(X, 64, seed=3, path="direct"))


def test_sketch_planes_are_the_planes_of_the_codes(mixed_rows: np.ndarray) -> None:
    """The query path's one-call planes (float32 rows) equal the planes of the codes of the
    sketch, for rows the walk takes (images), signed rows, one row, and widths of 1 to 16 bits;
    float64 and sparse rows, which take the sketch's own path, too."""
    X32 = mixed_rows.astype(np.float32)
    for k, bits in ((512, 8), (96, 1), (33, 3), (64, 16)):
        want = bit_planes(bbit_codes(sketch(X32, k, seed=9), bits, 9), bits)
        np.testing.assert_array_equal(sketch_planes(X32, k, 9, bits), want)
        np.testing.assert_array_equal(sketch_planes(X32[200:201], k, 9, bits), want[200:201])
        np.testing.assert_array_equal(sketch_planes(sp.csr_matrix(X32), k, 9, bits), want)
        np.testing.assert_array_equal(sketch_planes(X32.astype(np.float64), k, 9, bits), want)


def test_direct_path_past_its_coordinate_cache(mixed_rows: np.ndarray, monkeypatch) -> None:
    """The direct path's cache of constants holds 40 coordinates here: batches meeting more
    (some cached, some not, some cached by an earlier batch) hash as the full table does."""
    monkeypatch.setattr(gcws, "COORD_CACHE_BYTES", 40 * gcws._padded(96) * gcws._BYTES_PER_CONSTANT)
    gcws._coord_cache.cache_clear()
    try:
        X = sp.csr_matrix(mixed_rows)
        I, T = sketch(X, 96, seed=77, return_t=True, path="table")
        for lo, hi in ((0, 3), (0, 40), (100, 260), (0, 260)):
            I2, T2 = sketch(X[lo:hi], 96, seed=77, return_t=True, path="direct")
            np.testing.assert_array_equal(I2, I[lo:hi])
            np.testing.assert_array_equal(T2, T[lo:hi])
        np.testing.assert_array_equal(sketch(mixed_rows[5:9], 96, seed=77, path="direct"), I[5:9])
        assert gcws._coord_cache(2 * X.shape[1], 96, 77).used == 40
    finally:
        gcws._coord_cache.cache_clear()


def test_sample_j_depends_only_on_seed_i_j(mixed_rows: np.ndarray) -> None:
    """The first k' samples of a k-sample sketch are the k'-sample sketch; seeds differ."""
    X = mixed_rows[:80]
    big = sketch(X, 100, seed=8)
    np.testing.assert_array_equal(sketch(X, 37, seed=8), big[:, :37])
    other = sketch(X, 100, seed=9)
    assert np.mean(other == big) < 0.5


def test_threads_1_vs_2(mixed_rows: np.ndarray) -> None:
    X = np.vstack([mixed_rows] * 4)  # 1,040 rows × ~300 nonzeros × k: well past the parallel threshold
    before = parallel.threads()
    try:
        parallel.set_threads(1)
        one = sketch(X, 128, seed=21, return_t=True, path="direct")
        parallel.set_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = sketch(X, 128, seed=21, return_t=True, path="direct")
    finally:
        parallel.set_threads(before)
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])


def test_float32_vs_float64(mixed_rows: np.ndarray) -> None:
    X32 = (mixed_rows * np.float32(0.37)).astype(np.float32)
    X64 = X32.astype(np.float64)
    for path in ("table", "direct"):
        np.testing.assert_array_equal(sketch(X32, 64, seed=2, path=path), sketch(X64, 64, seed=2, path=path))
    np.testing.assert_array_equal(sketch(sp.csr_matrix(X32), 64, seed=2), sketch(X64, 64, seed=2))


def test_center_is_subtracted_first(mixed_rows: np.ndarray) -> None:
    X = mixed_rows[:50]
    mu = np.random.default_rng(1).standard_normal(784) * 0.1
    np.testing.assert_array_equal(sketch(X, 48, seed=3, center=mu), sketch(X - mu, 48, seed=3))


def test_golden_values() -> None:
    """Pins the generator: a stored index depends on these exact samples.

    If this fails after an intended change to core.rng or the sampling arithmetic,
    bump GENERATOR_VERSION (a format change) and update the values.
    """
    x = np.array([0.5, -1.25, 0.0, 3.0, -0.0625, 2.0])
    i, t = sketch(x, 12, seed=3, return_t=True)
    assert i.tolist() == [6, 10, 6, 3, 6, 6, 10, 6, 10, 6, 10, 0]
    assert t.tolist() == [2, 4, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0]


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from gmmlsh.core.gcws import sketch
    rng = np.random.default_rng(99)
    X = rng.standard_normal((150, 300)) * (rng.random((150, 300)) < 0.3)
    X[:, 0] += 1.0
    I, T = sketch(X, 200, seed=42, return_t=True, path=sys.argv[2])
    np.savez(sys.argv[1], I=I, T=T)
    """
)


def test_identical_across_processes(tmp_path: Path) -> None:
    """Two fresh interpreters (table and direct path) and this one produce the same bits."""
    rng = np.random.default_rng(99)
    X = rng.standard_normal((150, 300)) * (rng.random((150, 300)) < 0.3)
    X[:, 0] += 1.0
    I, T = sketch(X, 200, seed=42, return_t=True)
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    for n, path in enumerate(("table", "direct")):
        out = tmp_path / f"child{n}.npz"
        subprocess.run([sys.executable, "-c", _CHILD, str(out), path], check=True, env=env, timeout=300)
        got = np.load(out)
        np.testing.assert_array_equal(got["I"], I)
        np.testing.assert_array_equal(got["T"], T)


def test_istar_is_a_nonzero_coordinate_with_its_sign(mixed_rows: np.ndarray) -> None:
    """i* indexes ũ: even = positive part of u[i*/2], odd = negative part; never a zero."""
    X = mixed_rows[:60]
    I = sketch(X, 64, seed=1)
    assert I.dtype == np.int32 and I.shape == (60, 64)
    vals = np.take_along_axis(X, I // 2, axis=1)
    assert (np.where(I % 2 == 0, vals > 0, vals < 0)).all()


# --- packing --------------------------------------------------------------------------------


def _reference_pack(codes: np.ndarray, b: int) -> np.ndarray:
    """Bit j·b + q of the row is bit q of code j, least significant first."""
    bits = ((codes[..., None].astype(np.int64) >> np.arange(b)) & 1).reshape(codes.shape[0], -1)
    return np.packbits(bits.astype(np.uint8), axis=1, bitorder="little")


@pytest.mark.parametrize("b", range(1, 17))
def test_pack_unpack_round_trip(b: int) -> None:
    rng = np.random.default_rng(b)
    I = sketch(signed_vector(rng, 50)[None, :].repeat(3, axis=0) * [[1], [2], [-1]], 100, seed=b)
    for k in (1, 7, 8, 100):
        codes = bbit_codes(I[:, :k], b, seed=3)
        assert codes.dtype == np.uint16 and codes.max() < 2**b
        rand = rng.integers(0, 2**b, (4, k)).astype(np.uint16)
        for c in (codes, rand):
            packed = pack_codes(c, b)
            assert packed.dtype == np.uint8 and packed.shape == (c.shape[0], packed_bytes(k, b))
            np.testing.assert_array_equal(packed, _reference_pack(c, b))
            np.testing.assert_array_equal(unpack_codes(packed, k, b), c)
            np.testing.assert_array_equal(unpack_codes(pack_codes(c[1], b), k, b), c[1])


# --- estimators -----------------------------------------------------------------------------


def test_estimator_helpers_invert_each_other() -> None:
    g = np.linspace(0, 1, 11)
    for b in range(1, 17):
        p = bbit_collision_probability(g, b)
        np.testing.assert_allclose(p, g + (1 - g) * 2.0**-b)
        np.testing.assert_allclose(corrected_rate(p, b), g, atol=1e-12)
    a = np.array([[1, 2, 3, 4], [1, 1, 1, 1]])
    c = np.array([[1, 0, 3, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(collision_rate(a, c), [0.5, 1.0])
    np.testing.assert_allclose(estimate_gmm(a[0], c[0]), 0.5)
    np.testing.assert_allclose(estimate_gmm(a[0], c[0], bits=1), 0.0)


# --- properties ------------------------------------------------------------------------------

_nonzero = st.one_of(
    st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False),
    st.floats(-1e6, -1e-6, allow_nan=False, allow_infinity=False),
    st.sampled_from([1.0, -1.0, 0.5, 2.0]),
)


@st.composite
def sparse_vectors(draw) -> tuple[int, np.ndarray, np.ndarray]:
    dim = draw(st.integers(1, 40))
    idx = sorted(draw(st.sets(st.integers(0, dim - 1), min_size=1, max_size=min(dim, 12))))
    vals = draw(st.lists(_nonzero, min_size=len(idx), max_size=len(idx)))
    return dim, np.array(idx, dtype=np.int64), np.array(vals)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_vectors(), st.integers(0, 2**32), st.sampled_from(["table", "direct"]))
def test_dense_and_sparse_sketches_identical(vec, seed: int, path: str) -> None:
    dim, idx, vals = vec
    dense = np.zeros(dim)
    dense[idx] = vals
    want_i, want_t = sketch(dense, 24, seed=seed, return_t=True, path=path)
    got_i, got_t = sketch_sparse_vector(idx, vals, dim, 24, seed=seed, return_t=True, path=path)
    np.testing.assert_array_equal(want_i, got_i)
    np.testing.assert_array_equal(want_t, got_t)
    np.testing.assert_array_equal(sketch(sp.csr_matrix(dense), 24, seed=seed, path=path)[0], want_i)
    # the 0-bit sample always lands on a nonzero coordinate, with that coordinate's sign
    assert set((want_i // 2).tolist()) <= set(idx.tolist())


def test_unchecked_float32_input_hashes_like_checked_float64(fmnist):
    """The index hashes its float32 rows with check=False; that must equal the validated float64 path."""
    X = fmnist[0][:300].astype(np.float32)
    X[:, ::7] *= -1.0  # signed values too
    ref = sketch(X.astype(np.float64), 96, seed=3, return_t=True)
    for data in (X, sp.csr_matrix(X)):
        got = sketch(data, 96, seed=3, return_t=True, check=False)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])
