"""The search kernels against plain numpy references: bit-plane agreement, first-stage rows,
selection, list assignment, k-modes, and the whole search against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gmmlsh.core.codes import agreement, bbit_codes, bit_planes, plane_words
from gmmlsh.core.gcws import sketch
from gmmlsh.core.gmm import gmm, gmm_matrix
from gmmlsh.core.ivf import FIRST_WORDS, assign, first_agreement, first_rows, kmodes
from gmmlsh.core.search import exact_serial, row_gmm, search, select

Z = 4.0  # standard errors


def _codes(rng, n, k, bits):
    return rng.integers(0, 1 << bits, size=(n, k)).astype(np.uint16)


@pytest.mark.parametrize("bits", [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize("k", [1, 63, 64, 200, 512])
def test_bit_planes_hold_bit_p_of_every_code(k, bits):
    """Plane p, word w, bit j is bit p of code 64·w + j, zero past k: for codes of up to 8 bits
    (gathered 8 at a time) as for wider ones (bit by bit), one row as many."""
    rng = np.random.default_rng(17 * k + bits)
    C = _codes(rng, 9, k, bits)
    words = plane_words(k)
    padded = np.zeros((9, words * 64), dtype=np.uint64)
    padded[:, :k] = C
    j = np.arange(64, dtype=np.uint64)
    want = np.stack([(((padded[:, w * 64:(w + 1) * 64] >> np.uint64(p)) & np.uint64(1)) << j).sum(axis=1)
                     for p in range(bits) for w in range(words)], axis=1).astype(np.uint64)
    np.testing.assert_array_equal(bit_planes(C, bits), want)
    np.testing.assert_array_equal(bit_planes(C[0], bits), want[0])


@pytest.mark.parametrize(("k", "bits"), [(512, 8), (200, 4), (64, 1), (300, 16)])
def test_plane_agreement_counts_equal_low_bits(k, bits):
    rng = np.random.default_rng(k + bits)
    A, B = _codes(rng, 20, k, bits), _codes(rng, 20, k, bits)
    B[:, ::3] = A[:, ::3]  # plenty of agreement
    PA, PB = bit_planes(A, bits), bit_planes(B, bits)
    words = plane_words(k)
    pad = words * 64 - k  # samples past k agree on every row alike
    for m in range(1, bits + 1):
        mask = (1 << m) - 1
        want = ((A & mask) == (B & mask)).sum(axis=1) + pad
        got = [agreement(PA[i], PB[i], words, m, words) for i in range(20)]
        np.testing.assert_array_equal(got, want)


def test_first_rows_hold_two_bit_codes_of_the_first_256_samples():
    rng = np.random.default_rng(1)
    A, B = _codes(rng, 30, 512, 8), _codes(rng, 30, 512, 8)
    B[:, :128] = A[:, :128]
    FA = first_rows(bit_planes(A, 8), plane_words(512), 8)
    FB = first_rows(bit_planes(B, 8), plane_words(512), 8)
    assert FA.shape == (30, FIRST_WORDS)
    want = ((A[:, :256] & 3) == (B[:, :256] & 3)).sum(axis=1)
    np.testing.assert_array_equal([first_agreement(FA[i], FB[i]) for i in range(30)], want)
    # one bit per code: plane 1 is zero on both sides, so 1-bit agreement is counted
    F1a = first_rows(bit_planes(A & 1, 1), plane_words(512), 1)
    F1b = first_rows(bit_planes(B & 1, 1), plane_words(512), 1)
    np.testing.assert_array_equal([first_agreement(F1a[i], F1b[i]) for i in range(30)],
                                  ((A[:, :256] & 1) == (B[:, :256] & 1)).sum(axis=1))


def test_agreement_rate_follows_the_bbit_collision_probability(fmnist):
    """Mean agreement on m of 8 bits over pairs binned by GMM is k·(GMM + (1 − GMM)·2⁻ᵐ),
    within Z binomial standard errors of the bin's pooled samples."""
    X = fmnist[0][:400].astype(np.float64)
    k = 512
    P = bit_planes(bbit_codes(sketch(X, k, seed=3), 8, seed=3), 8)
    G = gmm_matrix(X[:40], X[40:])
    words = plane_words(k)
    for m in (2, 4, 8):
        agree = np.array([[agreement(P[i], P[40 + j], words, m, words) for j in range(360)] for i in range(40)])
        for lo in (0.2, 0.4, 0.6):
            sel = (G >= lo) & (G < lo + 0.2)
            if sel.sum() < 100:
                continue
            p = G[sel] + (1 - G[sel]) * 2.0**-m
            mean_pred = p.mean()
            # pairs share hash functions, so bound the pooled rate loosely by pair count, not k·pairs
            se = np.sqrt(mean_pred * (1 - mean_pred) / k / min(sel.sum(), 50))
            assert abs(agree[sel].mean() / k - mean_pred) <= Z * se + 0.02, (m, lo)


def test_select_keeps_the_best_in_order_ties_to_the_earliest():
    rng = np.random.default_rng(2)
    ids = np.arange(1000, 1500)
    scores = rng.integers(0, 40, size=500)
    for count in (0, 1, 7, 100, 499, 500, 900):
        got = select(ids, scores, 500, count, 255)
        order = np.lexsort((np.arange(500), -scores))[:count]
        np.testing.assert_array_equal(got, ids[np.sort(order)])


def test_assign_is_the_first_best_centroid_and_kmodes_finds_planted_clusters():
    rng = np.random.default_rng(3)
    base = _codes(rng, 3, 256, 2)
    A = np.repeat(base, 50, axis=0)
    noisy = rng.random(A.shape) < 0.1
    A[noisy] = rng.integers(0, 4, size=noisy.sum())
    F = first_rows(bit_planes(A, 2), plane_words(256), 2)
    C = first_rows(bit_planes(base, 2), plane_words(256), 2)
    ref = np.array([[first_agreement(f, c) for c in C] for f in F]).argmax(axis=1)
    np.testing.assert_array_equal(assign(F, C), ref)
    labels = assign(F, kmodes(F, 6, seed=0))
    planted = np.repeat(np.arange(3), 50)
    for lst in np.unique(labels):  # every list holds rows of one planted cluster only
        assert np.unique(planted[labels == lst]).shape[0] == 1


def _mirror_rows(X32):
    """(voff, vdata, norms) laid out as a search mirror keeps rows: dense and sparse rows mixed."""
    words, offs, norms = [], [0], []
    for i in range(X32.shape[0]):
        row = X32[i]
        nz = np.flatnonzero(row)
        if i % 2:  # sparse
            w = np.concatenate([[nz.shape[0], 1], nz.astype(np.uint32),
                                row[nz].astype(np.float32).view(np.uint32)]).astype(np.uint32)
        else:
            w = np.concatenate([[row.shape[0], 0], row.astype(np.float32).view(np.uint32)]).astype(np.uint32)
        words.append(w)
        offs.append(offs[-1] + w.shape[0])
        norms.append(np.abs(row.astype(np.float64)).sum())
    data = np.concatenate(words)
    return np.array(offs, np.int64), data.view(np.int32), data.view(np.float32), np.array(norms)


def test_row_gmm_and_exact_equal_the_reference_on_dense_and_sparse_rows():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(40, 30))
    X[rng.random(X.shape) < 0.7] = 0
    X[:, 0] += 0.5
    X32 = X.astype(np.float32)
    voff, vi, vf, norms = _mirror_rows(X32)
    q = rng.normal(size=30)
    q[rng.random(30) < 0.5] = 0
    q[1] = 1.0
    qn = float(np.abs(q).sum())
    want = np.array([gmm(q, X32[i].astype(np.float64)) for i in range(40)])
    got = np.array([row_gmm(q, qn, voff, vi, vf, norms, r) for r in range(40)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    alive = np.ones(40, np.uint8)
    alive[5] = 0
    out = np.empty(40)
    exact_serial(q, qn, 7, alive, voff, vi, vf, norms, 40, out)
    assert out[5] == -1 and out[7] == -1
    np.testing.assert_allclose(np.delete(out, [5, 7]), np.delete(want, [5, 7]), rtol=1e-12)


def test_search_with_everything_scanned_returns_every_live_row_exactly():
    rng = np.random.default_rng(5)
    n, dim, k = 300, 24, 128
    X = rng.random((n, dim))
    X[rng.random(X.shape) < 0.5] = 0
    X[:, 0] += 0.1
    X32 = X.astype(np.float32)
    voff, vi, vf, norms = _mirror_rows(X32)
    planes = bit_planes(bbit_codes(sketch(X32, k), 8), 8)
    first = first_rows(planes, plane_words(k), 8)
    cents = kmodes(first[:200], 4, seed=0)
    labels = assign(first[:200], cents)
    order = np.argsort(labels, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=4))]).astype(np.int64)
    lrows = order.astype(np.uint32)
    alive = np.ones(n, np.uint8)
    alive[[3, 250]] = 0
    q = X[17] * 1.5
    qp = bit_planes(bbit_codes(sketch(q.astype(np.float32)[None, :], k), 8), 8)[0]
    qf = first_rows(qp[None, :], plane_words(k), 8)[0]
    out_rows, out_sims = np.empty(n, np.int64), np.empty(n)
    m, scanned = search(qp, qf, plane_words(k), q, float(np.abs(q).sum()), 17, cents, starts, lrows, first[order],
                        first, planes, 200, n, alive, voff, vi, vf, norms, 1 << 30, n, 8, n, out_rows, out_sims)
    assert scanned == n
    assert sorted(out_rows[:m].tolist()) == sorted(set(range(n)) - {3, 250, 17})
    want = np.array([gmm(q, X32[r].astype(np.float64)) for r in out_rows[:m]])
    np.testing.assert_allclose(out_sims[:m], want, rtol=1e-12)


def test_search_finds_a_near_copy_through_a_single_probe():
    rng = np.random.default_rng(6)
    n, dim, k = 2000, 64, 256
    X = rng.gamma(0.5, size=(n, dim))
    X32 = X.astype(np.float32)
    voff, vi, vf, norms = _mirror_rows(X32)
    planes = bit_planes(bbit_codes(sketch(X32, k), 8), 8)
    first = first_rows(planes, plane_words(k), 8)
    cents = kmodes(first, 8, seed=0)
    labels = assign(first, cents)
    order = np.argsort(labels, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=8))]).astype(np.int64)
    hits = 0
    for target in range(0, n, 97):
        q = X[target] * 1.01
        qp = bit_planes(bbit_codes(sketch(q[None, :], k), 8), 8)[0]
        qf = first_rows(qp[None, :], plane_words(k), 8)[0]
        out_rows, out_sims = np.empty(20, np.int64), np.empty(20)
        m, scanned = search(qp, qf, plane_words(k), q, float(np.abs(q).sum()), -1, cents, starts,
                            order.astype(np.uint32), first[order], first, planes, n, n, np.ones(n, np.uint8), voff,
                            vi, vf, norms, 1, 50, 8, 20, out_rows, out_sims)
        assert scanned < n / 2
        hits += out_rows[:m][np.argmax(out_sims[:m])] == target
    assert hits >= 19  # of 21: its own list is the best-agreeing centroid's almost always


def test_sparse_query_buffer_equals_merge_join():
    dim = 5000
    rng = np.random.default_rng(7)
    X = sp.random(30, dim, density=0.01, random_state=8, format="csr", dtype=np.float64)
    X.data[::2] *= -1
    X = X + sp.csr_matrix(([1.0] * 30, (range(30), [0] * 30)), shape=(30, dim))
    X32 = X.astype(np.float32).toarray()
    voff, vi, vf, norms = _mirror_rows(X32)
    q = np.zeros(dim)
    idx = rng.choice(dim, 60, replace=False)
    q[idx] = rng.normal(size=60)
    q[0] = 0.7
    qn = float(np.abs(q).sum())
    for r in range(30):
        assert row_gmm(q, qn, voff, vi, vf, norms, r) == pytest.approx(gmm(q, X32[r].astype(np.float64)), rel=1e-12)
