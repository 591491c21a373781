"""The search kernels against plain numpy references: bit-plane agreement, first-stage rows,
selection, list assignment, k-modes, the list layout and profiles, the first stage's
selection, coarse GMM, and the whole search against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gmmlsh.core.bundles import SEG_FIELDS, Budget, Lists, Query, Rows, frozen
from gmmlsh.core.coarse import LEVELS, coarse_encode, coarse_gmm, coarse_sizes
from gmmlsh.core.codes import agreement, bbit_codes, bit_planes, plane_words
from gmmlsh.core.gcws import sketch
from gmmlsh.core.gmm import gmm, gmm_matrix
from gmmlsh.core.ivf import (
    FIRST_WORDS,
    assign,
    assign_profiles,
    first_agreement,
    first_rows,
    kmodes,
    list_layout,
    list_scores,
    profile_scores,
    profiles,
)
from gmmlsh.core.search import PRUNED, _block_sums, bound_sums, exact_block, exact_scan, row_gmm, search, shortlist_of
from gmmlsh.core.select import select, top_k

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


def test_first_rows_hold_the_first_512_bits_of_the_planes():
    """Plane 0 of 512 samples or more; with fewer samples, the next planes too (256 samples:
    two bits of each), the rest zero on both sides (agreeing: a constant offset)."""
    rng = np.random.default_rng(1)
    A, B = _codes(rng, 30, 600, 8), _codes(rng, 30, 600, 8)
    B[:, :200] = A[:, :200]
    for k, bits, planes_used in ((600, 8, 1), (256, 8, 2), (64, 8, 8), (64, 2, 2), (100, 1, 1)):
        a, b = A[:, :k] & ((1 << bits) - 1), B[:, :k] & ((1 << bits) - 1)
        FA = first_rows(bit_planes(a, bits), plane_words(k), bits)
        FB = first_rows(bit_planes(b, bits), plane_words(k), bits)
        assert FA.shape == (30, FIRST_WORDS)
        used = min(k, 512 // planes_used)  # samples whose bits are in the row
        want = sum(((a[:, :used] >> p & 1) == (b[:, :used] >> p & 1)).sum(axis=1) for p in range(planes_used))
        want = want + 512 - used * planes_used
        np.testing.assert_array_equal([first_agreement(FA[i], FB[i]) for i in range(30)], want, err_msg=str(k))


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
    """(voff, vdata, norms, coff, cdata) laid out as a search mirror keeps rows: dense and sparse
    rows mixed, with their coarse copies."""
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
    voff, vi, vf, norms = np.array(offs, np.int64), data.view(np.uint32), data.view(np.float32), np.array(norms)
    sizes = coarse_sizes(voff, vi, 0, X32.shape[0])
    cdata = np.empty(int(sizes.sum()), np.uint8)
    coarse_encode(voff, vi, vf, norms, 0, X32.shape[0], cdata)
    coff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return voff, vi, vf, norms, coff, cdata


def _rows(X32, planes=None, first=None, alive=None) -> Rows:
    """A :class:`Rows` bundle of ``X32`` laid out by :func:`_mirror_rows`."""
    voff, vi, vf, norms, coff, cdata = _mirror_rows(X32)
    n = X32.shape[0]
    planes = np.zeros((n, 1), np.uint64) if planes is None else planes
    first = np.zeros((n, FIRST_WORDS), np.uint64) if first is None else first
    alive = np.ones(n, np.uint8) if alive is None else alive
    return Rows(*(frozen(np.ascontiguousarray(a)) for a in (alive, norms, norms.astype(np.float32), planes, first,
                                                              voff, vi, vf, coff, cdata)), X32.shape[1])


def _query(qp, qf, q, exclude=-1) -> Query:
    return Query(qp, qf, np.asarray(q, np.float64), float(np.abs(q).sum()), exclude)


def test_row_gmm_and_exact_equal_the_reference_on_dense_and_sparse_rows():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(40, 30))
    X[rng.random(X.shape) < 0.7] = 0
    X[:, 0] += 0.5
    X32 = X.astype(np.float32)
    voff, vi, vf, norms, _, _ = _mirror_rows(X32)
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
    exact_scan(q, qn, 7, _rows(X32, alive=alive), 0, 40, out)
    assert out[5] == -1 and out[7] == -1
    np.testing.assert_allclose(np.delete(out, [5, 7]), np.delete(want, [5, 7]), rtol=1e-12)


@pytest.mark.parametrize("signed", ["no", "both", "rows"])
def test_exact_block_leaves_out_only_rows_a_floor_rules_out(fmnist, signed):
    """Given a floor per query, exact_block leaves out (PRUNED) the dense rows whose bound from
    block sums is below it, and scores every other row as it does without a floor: no row at or
    over the floor is ever left out. On images the bound is tight: most dense rows under a
    query's 10th best are left out. Signed values on both sides, or on the rows only (the
    queries' negative halves are then zeros, read against the rows')."""
    X, Q = fmnist[0][:2000].astype(np.float64), fmnist[2][:6].astype(np.float64)
    if signed != "no":  # centred: values of both signs, the bound's two halves
        mean = X.mean(axis=0)
        X, Q = X - mean, (Q - mean if signed == "both" else Q)
    rows = _rows(X.astype(np.float32))  # odd rows stored sparse (never left out), even rows dense
    qn, exclude, QT, qsums = np.abs(Q).sum(axis=1), np.array([-1, 4, -1, -1, -1, -1]), np.ascontiguousarray(Q.T), \
        bound_sums(Q)
    for j in range(6):  # the queries' sums (numpy) are the rows' (the kernel's): one definition
        sums = np.empty(qsums.shape[1])
        _block_sums(Q[j], sums)
        np.testing.assert_allclose(qsums[j], sums, rtol=1e-12)
    full, out = np.empty((6, 2000)), np.empty((6, 2000))
    exact_block(Q, QT, qn, exclude, rows, 0, 2000, full, qsums, np.zeros(6))
    assert full[1, 4] == -1 and (full[np.arange(6) != 1] >= 0).all()
    floor = np.sort(full, axis=1)[:, -10]  # each query's 10th best
    exact_block(Q, QT, qn, exclude, rows, 0, 2000, out, qsums, floor)
    pruned = out == PRUNED
    assert not pruned[:, 1::2].any()
    assert np.array_equal(out[~pruned], full[~pruned])
    assert (full[pruned] < np.broadcast_to(floor[:, None], full.shape)[pruned]).all()
    below = full[:, 0::2] < floor[:, None]
    assert pruned[:, 0::2].sum() > 0.5 * below.sum()


def test_coarse_rows_give_gmm_within_their_quantisation():
    """A coarse row (int8 levels of max|v|/127) gives a GMM whose error is bounded by half a
    level per coordinate: |ΔS| ≤ Σ scale/2 over the row's stored values, so |ΔGMM| ≤ that
    times (‖q‖₁ + ‖v‖₁) / (‖q‖₁ + ‖v‖₁ − S)², signed values alike. A sparse row has no levels
    (its header says count 0) and gives −1: it is scored exactly instead."""
    rng = np.random.default_rng(11)
    X = rng.normal(size=(60, 50)) * rng.gamma(1.0, size=(60, 1))
    X[rng.random(X.shape) < 0.6] = 0
    X[:, 3] += 0.5
    X32 = X.astype(np.float32)
    voff, vi, vf, norms, coff, cdata = _mirror_rows(X32)
    levels, head, counts = cdata.view(np.int8), cdata.view(np.float32), cdata.view(np.int32)
    for trial in range(5):
        q = rng.normal(size=50)
        q[rng.random(50) < 0.4] = 0
        q[trial] = 1.0
        qn = float(np.abs(q).sum())
        for r in range(60):
            exact = gmm(q, X32[r].astype(np.float64))
            got = coarse_gmm(q.astype(np.float32), qn, coff, levels, head, counts, r)
            if r % 2:  # sparse
                assert got == -1, r
                continue
            scale = np.abs(X32[r]).max() / LEVELS
            s = exact * (qn + norms[r]) / (1 + exact)
            bound = np.count_nonzero(X32[r]) * scale / 2 * (qn + norms[r]) / (qn + norms[r] - s) ** 2
            assert abs(got - exact) <= bound + 1e-5, (trial, r)
        assert counts[coff[:-1] // 4 + 2].tolist() == [0 if r % 2 else 50 for r in range(60)]
    assert np.diff(coff).tolist() == [12 if r % 2 else 12 + 52 for r in range(60)]  # header, or header and levels


def test_coarse_gmm_stays_a_similarity_where_rounding_adds_to_a_row():
    """Rounding can give a row more than it holds: a query equal to the rounded values of a row
    (127 and 0.6s, levels 127 and 1s) shares 227 with its coarse copy against a norm of 187, a
    ratio of 1.21 — as a level, past the histogram candidates are chosen by. A coarse GMM is a
    similarity: at most 1 (``_ratio`` caps it)."""
    row = np.r_[127.0, np.full(100, 0.6)].astype(np.float32)
    voff, vi, vf, norms, coff, cdata = _mirror_rows(np.vstack([row, row]))  # row 0 stored dense
    q = np.r_[127.0, np.ones(100)]
    got = coarse_gmm(q.astype(np.float32), float(q.sum()), coff, cdata.view(np.int8), cdata.view(np.float32),
                     cdata.view(np.int32), 0)
    assert gmm(q, row.astype(np.float64)) < got <= 1.0


def _lists(first, planes, cuts, nlist, words, bits, rows) -> Lists:
    """Lists as the search kernel reads them: k-modes of the first-stage rows of ``[0, cuts[-1])``,
    profiles of those lists, and segments of the rows between consecutive ``cuts`` (every row in
    the list of its best profile), one after another in the arenas; rows ``[cuts[-1], rows)``: the tail."""
    listed = cuts[-1]
    P = profiles(planes, np.arange(listed), assign(first[:listed], kmodes(first[:listed], nlist, seed=0)), nlist,
                 words, bits)
    segs, lstarts, lrows, lfirst, lplanes = [], [], [], [], []
    e = 0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        labels = assign_profiles(planes, np.arange(lo, hi), P, words, bits)
        order = lo + np.argsort(labels, kind="stable")
        starts = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=nlist))]).astype(np.int64)
        row = np.zeros(SEG_FIELDS, np.int64)
        row[:5] = lo, hi, e, e + order.shape[0], len(lstarts) * (nlist + 1)
        segs.append(row)
        lstarts.append(e + starts)
        lrows.append(order.astype(np.uint32))
        lfirst.append(list_layout(first[order], starts))
        lplanes.append(planes[order][:, :min(4, bits) * words])
        e += order.shape[0]
    return Lists(frozen(P), frozen(np.array(segs).reshape(-1, SEG_FIELDS)), frozen(np.concatenate(lstarts)),
                 frozen(np.concatenate(lrows)), frozen(np.concatenate(lfirst)),
                 frozen(np.ascontiguousarray(np.concatenate(lplanes))), listed, rows)


def _budget(words, probes=1 << 30, shortlist=2000, rank_planes=4, candidates=200, refine=30, two=True) -> Budget:
    return Budget(words, two, probes, shortlist, rank_planes, candidates, refine)


def test_list_layout_scores_every_entry_as_its_first_stage_row():
    rng = np.random.default_rng(12)
    A = _codes(rng, 300, 512, 8)
    first = first_rows(bit_planes(A, 8), plane_words(512), 8)
    q = first[7] ^ rng.integers(0, 2**63, size=FIRST_WORDS, dtype=np.uint64)
    starts = np.array([0, 0, 1, 64, 100, 300], np.int64)  # an empty list, odd sizes
    L = list_layout(first, starts)
    for c in range(5):
        out = np.empty(starts[c + 1] - starts[c] + 1, np.uint16)
        list_scores(L, starts[c], starts[c + 1] - starts[c], q, out)
        want = [first_agreement(first[e], q) for e in range(starts[c], starts[c + 1])]
        np.testing.assert_array_equal(out[:starts[c + 1] - starts[c]], want)


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_profiles_are_per_sample_modes_and_score_their_two_bit_agreement(bits):
    rng = np.random.default_rng(13 + bits)
    k, nlist = 200, 5
    A = _codes(rng, 120, k, bits)
    labels = rng.integers(0, nlist, 120)
    labels[:nlist] = np.arange(nlist)
    planes = bit_planes(A, bits)
    words = plane_words(k)
    P = profiles(planes, np.arange(120), labels, nlist, words, bits)
    low = A & 3
    q = _codes(rng, 1, k, bits)[0]
    qp = bit_planes(q, bits)
    got = np.empty(nlist, np.int64)
    profile_scores(P, qp, words, bits >= 2, got)
    for c in range(nlist):
        mode = np.array([np.argmax(np.bincount(low[labels == c, j], minlength=4)) for j in range(k)])
        want = int(((q & 3) == mode).sum()) + words * 64 - k  # samples past k agree on both sides
        assert got[c] == want
    rows = np.arange(0, 120, 3)
    best = []
    for r in rows:
        profile_scores(P, planes[r], words, bits >= 2, got)
        best.append(int(np.argmax(got)))  # the first of the best
    np.testing.assert_array_equal(assign_profiles(planes, rows, P, words, bits), best)


def _brute_shortlist(first, lists, chosen, q, count):
    """Refs of the best ``count`` scanned entries (segment by segment, chosen list by chosen list,
    then the tail), in scan order, ties to the earliest."""
    refs, scores = [], []
    for seg in np.asarray(lists.segs):
        starts = lists.lstarts[seg[4]:seg[4] + lists.profiles.shape[1] + 1]
        for c in chosen:
            for e in range(starts[c], starts[c + 1]):
                refs.append(e)
                scores.append(first_agreement(first[lists.lrows[e]], q))
    for r in range(lists.tail_lo, lists.tail_hi):
        refs.append(lists.lrows.shape[0] + r)
        scores.append(first_agreement(first[r], q))
    keep = np.sort(np.lexsort((np.arange(len(scores)), -np.array(scores)))[:count])
    return np.array(refs)[keep]


@pytest.mark.parametrize("shortlist", [1, 17, 120, 500, 5000])
@pytest.mark.parametrize("cuts", [(0, 1300), (0, 700, 1000, 1300)])
def test_the_first_stage_keeps_the_best_of_the_probed_lists_and_the_tail(shortlist, cuts):
    """In one segment or several; ties included (2-bit codes over few distinct rows tie a lot),
    whether the estimated cut keeps enough or not, and with a tail whose size is no multiple of
    the group."""
    rng = np.random.default_rng(14)
    base = _codes(rng, 40, 256, 2)
    A = base[rng.integers(0, 40, 1500)]
    noisy = rng.random(A.shape) < 0.3
    A[noisy] = rng.integers(0, 4, size=noisy.sum())
    planes = bit_planes(A, 2)
    words = plane_words(256)
    first = first_rows(planes, words, 2)
    lists = _lists(first, planes, cuts, 9, words, 2, 1500)
    rows = Rows(*[frozen(np.zeros(1, t)) for t in (np.uint8, np.float64, np.float32)], frozen(planes), frozen(first),
                *[frozen(np.zeros(1, t)) for t in (np.int64, np.uint32, np.float32, np.int64, np.uint8)], 1)
    for probes in (2, 5, 9):
        q = planes[rng.integers(0, 1500)]
        qf = first_rows(q[None, :], words, 2)[0]
        pscore = np.empty(9, np.int64)
        profile_scores(lists.profiles, q, words, True, pscore)
        chosen = np.sort(np.lexsort((np.arange(9), -pscore))[:probes])
        refs, scanned = shortlist_of(_query(q, qf, np.zeros(1)), rows, lists, _budget(words, probes, shortlist))
        np.testing.assert_array_equal(refs, _brute_shortlist(first, lists, chosen, qf, shortlist))
        starts = [lists.lstarts[seg[4]:seg[4] + 10] for seg in np.asarray(lists.segs)]
        assert scanned == sum(st[c + 1] - st[c] for st in starts for c in chosen) + 200


def _index_of(X32, k, nlist, cuts, seed=0):
    planes = bit_planes(bbit_codes(sketch(X32, k, seed=seed), 8, seed=seed), 8)
    words = plane_words(k)
    first = first_rows(planes, words, 8)
    return planes, first, _lists(first, planes, cuts, nlist, words, 8, X32.shape[0])


def test_search_with_everything_scanned_returns_every_live_row_exactly():
    rng = np.random.default_rng(5)
    n, dim, k = 300, 24, 128
    X = rng.random((n, dim))
    X[rng.random(X.shape) < 0.5] = 0
    X[:, 0] += 0.1
    X32 = X.astype(np.float32)
    planes, first, lists = _index_of(X32, k, 4, (0, 120, 200))
    alive = np.ones(n, np.uint8)
    alive[[3, 250]] = 0
    rows = _rows(X32, planes, first, alive)
    q = X[17] * 1.5
    qp = bit_planes(bbit_codes(sketch(q.astype(np.float32)[None, :], k), 8), 8)[0]
    qf = first_rows(qp[None, :], plane_words(k), 8)[0]
    out_rows, out_sims = np.empty(n, np.int64), np.empty(n)
    live = sorted(set(range(n)) - {3, 250, 17})
    for refine in (n, 0):
        budget = _budget(plane_words(k), shortlist=n, candidates=n, refine=refine)
        m, scanned, ranked = search(_query(qp, qf, q, 17), rows, lists, budget, out_rows, out_sims)
        assert scanned == n and ranked == (len(live) if refine else m)
        if refine:
            assert sorted(out_rows[:m].tolist()) == live
            want = np.array([gmm(q, X32[r].astype(np.float64)) for r in out_rows[:m]])
            np.testing.assert_allclose(out_sims[:m], want, rtol=1e-12)
        else:  # unscored: every candidate, the excluded and retired rows ranked last but still there
            assert set(live) <= set(out_rows[:m].tolist()) and not out_sims[:m].any()


def test_search_scores_exactly_the_best_candidates_by_coarse_gmm():
    """With ``refine`` below ``candidates``: the rows scored are the ``refine`` best of the
    candidates by coarse GMM, and their similarities are exact."""
    rng = np.random.default_rng(15)
    n, dim, k = 600, 40, 256
    X32 = (rng.gamma(0.7, size=(n, dim)) * (rng.random((n, dim)) < 0.7)).astype(np.float32)
    X32[:, 0] += 0.2
    planes, first, lists = _index_of(X32, k, 3, (0, n))
    bundle = _rows(X32, planes, first)
    _, _, _, _, coff, cdata = _mirror_rows(X32)
    q = X32[40].astype(np.float64) * 0.9
    qp, qf = planes[40], first[40]
    qn = float(np.abs(q).sum())
    rows, sims = np.empty(n, np.int64), np.empty(n)
    m, _, _ = search(_query(qp, qf, q), bundle, lists, _budget(plane_words(k), shortlist=300, candidates=100, refine=0),
                     rows, sims)
    candidates = rows[:m].copy()
    levels, head, counts = cdata.view(np.int8), cdata.view(np.float32), cdata.view(np.int32)
    def coarse_or_exact(r):  # a sparse row has no coarse copy and is ranked by its exact GMM
        g = coarse_gmm(q.astype(np.float32), qn, coff, levels, head, counts, r)
        return g if g >= 0 else gmm(q, X32[r].astype(np.float64))

    coarse = np.array([int(4095 * coarse_or_exact(r)) for r in candidates])
    want = candidates[np.sort(np.lexsort((np.arange(m), -coarse))[:20])]
    m2, _, ranked = search(_query(qp, qf, q), bundle, lists,
                           _budget(plane_words(k), shortlist=300, candidates=100, refine=20), rows, sims)
    assert ranked == 100
    np.testing.assert_array_equal(rows[:m2], want)
    np.testing.assert_allclose(sims[:m2], [gmm(q, X32[r].astype(np.float64)) for r in want], rtol=1e-12)


def test_search_finds_a_near_copy_through_a_single_probe():
    rng = np.random.default_rng(6)
    n, dim, k = 2000, 64, 256
    X = rng.gamma(0.5, size=(n, dim))
    X32 = X.astype(np.float32)
    planes, first, lists = _index_of(X32, k, 8, (0, n))
    rows = _rows(X32, planes, first)
    hits = 0
    for target in range(0, n, 97):
        q = X[target] * 1.01
        qp = bit_planes(bbit_codes(sketch(q[None, :], k), 8), 8)[0]
        qf = first_rows(qp[None, :], plane_words(k), 8)[0]
        out_rows, out_sims = np.empty(20, np.int64), np.empty(20)
        m, scanned, _ = search(_query(qp, qf, q), rows, lists,
                               _budget(plane_words(k), probes=1, shortlist=50, candidates=20, refine=20),
                               out_rows, out_sims)
        assert scanned < n / 2
        hits += out_rows[:m][np.argmax(out_sims[:m])] == target
    assert hits >= 19  # of 21: its own list is the best-agreeing profile's almost always


def test_sparse_query_buffer_equals_merge_join():
    dim = 5000
    rng = np.random.default_rng(7)
    X = sp.random(30, dim, density=0.01, random_state=8, format="csr", dtype=np.float64)
    X.data[::2] *= -1
    X = X + sp.csr_matrix(([1.0] * 30, (range(30), [0] * 30)), shape=(30, dim))
    X32 = X.astype(np.float32).toarray()
    voff, vi, vf, norms, _, _ = _mirror_rows(X32)
    q = np.zeros(dim)
    idx = rng.choice(dim, 60, replace=False)
    q[idx] = rng.normal(size=60)
    q[0] = 0.7
    qn = float(np.abs(q).sum())
    for r in range(30):
        assert row_gmm(q, qn, voff, vi, vf, norms, r) == pytest.approx(gmm(q, X32[r].astype(np.float64)), rel=1e-12)


def test_top_k_is_a_stable_descending_sort_short_or_long():
    rng = np.random.default_rng(16)
    for n, k in ((0, 5), (7, 10), (50, 10), (5000, 10), (5000, 0), (300, 64), (300, 65), (5000, 1000)):
        v = rng.integers(0, 20, n).astype(np.float64)  # many ties
        for values in (v, np.sort(v), np.sort(v)[::-1].copy()):  # and every insertion at the front, or none
            want = np.lexsort((np.arange(n), -values))[:k]
            np.testing.assert_array_equal(top_k(values, k), want)
