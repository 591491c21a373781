"""The postings search (core/postings.py): head columns, its answers against exact search,
and the tuner's choice of it on text — reported and overridable."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA

from gmmlsh.core.postings import HEAD_SHARE, head_levels, head_plan
from gmmlsh.index import segments
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.service.cli.common import describe_search


def _postings(X: sp.csr_matrix):
    """Postings of a CSR matrix (coordinate → rows and values), as a segment holds them."""
    X = X.tocsc()
    return X.indptr.astype(np.int64), X.indices.astype(np.uint32), X.data.astype(np.float32)


def _zipf_text(n: int, dim: int, seed: int, signed: bool = False) -> sp.csr_matrix:
    """Rows of ~40 word counts drawn from a Zipf-like vocabulary (a few words in most rows)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, dim + 1)
    p /= p.sum()
    rows = []
    for _ in range(n):
        words, counts = np.unique(rng.choice(dim, 60, p=p), return_counts=True)
        vals = counts.astype(np.float32)
        if signed:
            vals *= rng.choice([-1.0, 1.0], vals.shape[0]).astype(np.float32) * rng.uniform(0.5, 2.0, vals.shape[0])
        rows.append((words, vals))
    indptr = np.cumsum([0] + [w.shape[0] for w, _ in rows])
    return sp.csr_matrix((np.concatenate([v for _, v in rows]), np.concatenate([w for w, _ in rows]), indptr),
                         shape=(n, dim))


def head_columns(post_starts, post_rows, post_vals, rows, sparse_rows):
    """The head columns a fit plans from these postings, and their levels over rows ``[0, rows)``."""
    slot, nbytes, scale = head_plan(post_starts, post_vals, sparse_rows)
    byte_cols, nibble_cols = head_levels(slot, nbytes, scale, post_starts, post_rows, post_vals, 0, rows)
    return slot, byte_cols, nibble_cols, np.array([scale], np.float32)


def _head_values(slot, byte_cols, nibble_cols, c, rows):
    """Column ``c``'s levels, row by row, from whichever kind of head column holds it."""
    j = slot[c]
    if j < byte_cols.shape[0]:
        return byte_cols[j].astype(np.int64)
    packed = nibble_cols[j - byte_cols.shape[0]]
    return np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)[:rows].astype(np.int64)


def test_head_columns_hold_counts_exactly_and_other_values_within_half_a_level():
    """Counts: exact in a byte column, exact in a packed column up to 15 (a column is packed
    where at most 1/256 of its values pass 15; those saturate). Other non-negative values:
    levels of one scale (the largest value / 255), within half a level. Signed data: none."""
    X = _zipf_text(400, 300, seed=1)
    X.data[:50] = 40  # a few large counts: the columns holding them stay bytes
    slot, byte_cols, nibble_cols, scale = head_columns(*_postings(X), rows=400, sparse_rows=400)
    held = np.diff(X.tocsc().indptr)
    assert byte_cols.shape[0] + nibble_cols.shape[0] == (held >= 400 * HEAD_SHARE).sum() > 0 and scale[0] == 1.0
    assert byte_cols.shape[0] > 0 and nibble_cols.shape[0] > 0 and nibble_cols.shape[1] == 200
    dense = X.toarray()
    for c in np.flatnonzero(slot >= 0):
        got = _head_values(slot, byte_cols, nibble_cols, c, 400)
        if slot[c] < byte_cols.shape[0]:
            np.testing.assert_array_equal(got, dense[:, c])
        else:
            assert (dense[:, c] > 15).mean() <= 1 / 256
            np.testing.assert_array_equal(got, np.minimum(dense[:, c], 15))
    Y = X.copy()
    Y.data = Y.data * np.float32(0.37)
    slot, byte_cols, nibble_cols, scale = head_columns(*_postings(Y), rows=400, sparse_rows=400)
    dense = Y.toarray()
    assert scale[0] == pytest.approx(dense[:, slot >= 0].max() / 255)
    for c in np.flatnonzero(slot >= 0):
        got = _head_values(slot, byte_cols, nibble_cols, c, 400)
        want = np.minimum(dense[:, c], (15 if slot[c] >= byte_cols.shape[0] else 255) * scale[0])
        assert np.abs(got * scale[0] - want).max() <= scale[0] / 2 + 1e-6
    slot, byte_cols, nibble_cols, _ = head_columns(*_postings(_zipf_text(400, 300, seed=2, signed=True)), rows=400,
                                                   sparse_rows=400)
    assert (slot < 0).all() and byte_cols.shape[0] == nibble_cols.shape[0] == 0


@pytest.mark.parametrize("signed", [False, True])
def test_postings_search_with_everything_read_and_reranked_is_exact(tmp_path, signed):
    """Reading every coordinate and reranking every row, the postings search answers what
    exact search answers, over two segments and a tail (signed data included: it has no head
    columns, and reads postings only); narrower, every similarity it returns is exact."""
    X = _zipf_text(3600, 2000, seed=4, signed=signed)
    Q = _zipf_text(20, 2000, seed=5, signed=signed)
    ids = [str(i) for i in range(X.shape[0])]
    with Index.open(tmp_path / "p", IndexConfig(dim=2000), search={"rare": 1.0, "candidates": 3600},
                    maintain=False) as ix:
        for lo, hi in ((0, 2200), (2200, 3300), (3300, 3600)):
            ix.upsert(ids[lo:hi], X[lo:hi])
            if hi < 3600:
                ix.maintain()
        ix.delete(ids[::7])
        view = ix.view()
        assert len(view.segments) == 2 and view.rows > view.tail_start == 3300
        assert view.postings_search != signed  # head columns hold non-negative data only
        for i in range(Q.shape[0]):
            got = ix.query(Q[i], k=10, mode="postings")
            want = ix.query(Q[i], k=10, mode="exact")
            assert got.mode == "postings"
            np.testing.assert_allclose([n.similarity for n in got.neighbors],
                                       [n.similarity for n in want.neighbors], rtol=1e-9)
            narrow = ix.query(Q[i], k=10, mode="postings", candidates=20)
            assert narrow.candidates <= 20 + view.rows - view.tail_start  # and the tail, scored exactly
            q, rows = Q[i].toarray()[0], X[[int(n.id) for n in narrow.neighbors]].toarray()
            same = np.where(np.sign(rows) == np.sign(q), np.minimum(np.abs(rows), np.abs(q)), 0).sum(axis=1)
            want = same / (np.abs(q).sum() + np.abs(rows).sum(axis=1) - same)
            np.testing.assert_allclose([n.similarity for n in narrow.neighbors], want, rtol=1e-6)


def test_postings_search_on_a_fresh_thread_whatever_the_row_count(tmp_path):
    """A thread's first query sizes its scratch to twice the rows; at an odd count (2,501 here,
    Brown's 4,505 alike) that is no whole number of 64-bit words, and the selection, which
    reads levels four at a time, must still read only the rows (regression: it raised)."""
    from concurrent.futures import ThreadPoolExecutor

    MIN_ROWS = segments.MIN_ROWS

    X = _zipf_text(2501, 800, seed=7)
    assert X.shape[0] >= MIN_ROWS and 2 * X.shape[0] % 4
    Q = _zipf_text(5, 800, seed=8)
    with Index.open(tmp_path / "p", IndexConfig(dim=800), search={"rare": 1.0, "candidates": 2501},
                    maintain=False) as ix:
        ix.upsert([str(i) for i in range(X.shape[0])], X)
        ix.maintain()
        assert ix.view().tail_start == X.shape[0]

        def both(i):
            return ix.query(Q[i], k=10, mode="postings"), ix.query(Q[i], k=10, mode="exact")

        for i in range(Q.shape[0]):
            with ThreadPoolExecutor(1) as fresh:  # a new thread: no scratch yet
                got, want = fresh.submit(both, i).result()
            assert got.mode == "postings"
            np.testing.assert_allclose([n.similarity for n in got.neighbors],
                                       [n.similarity for n in want.neighbors], rtol=1e-9)


def test_postings_search_ranks_large_counts_over_many_head_columns(tmp_path):
    """k-mer-like counts: every row holds the same 300 coordinates (256 of them head columns,
    the most kept) with counts up to ~1,000, in families of similar rows, and a few rare ones.
    Levels (the largest count / 255 each) summed over 256 columns reach 65,280: the head sums
    must hold that, and counts above 255 must not all look alike; the postings search then
    finds what exact search finds."""
    rng = np.random.default_rng(11)
    n, dim, common = 2500, 2000, 300
    base = rng.integers(100, 1000, size=(40, common))

    def rows(m):
        counts = np.clip(base[rng.integers(0, 40, m)] + rng.normal(0, 60, (m, common)), 1, None).round()
        rare = np.sort(rng.choice(np.arange(common, dim), size=(m, 5)), axis=1)
        dense = np.zeros((m, dim), np.float32)
        dense[:, :common] = counts
        np.put_along_axis(dense, rare, rng.integers(1, 5, (m, 5)).astype(np.float32), axis=1)
        return sp.csr_matrix(dense)

    X, Q = rows(n), rows(10)
    with Index.open(tmp_path / "k", IndexConfig(dim=dim), search={"rare": 1.0, "candidates": 100},
                    maintain=False) as ix:
        ix.upsert([str(i) for i in range(n)], X)
        ix.maintain()
        assert ix.view().postings_search
        for i in range(Q.shape[0]):
            got = ix.query(Q[i], k=10, mode="postings")
            want = ix.query(Q[i], k=10, mode="exact")
            np.testing.assert_allclose([nb.similarity for nb in got.neighbors],
                                       [nb.similarity for nb in want.neighbors], rtol=1e-9)


@pytest.fixture(scope="module")
def brown():
    path = DATA / "brown-passages.npz"
    if not path.exists():
        pytest.fail(f"Brown passages not found at {path}; set GMMLSH_DATA to the folder holding them")
    d = np.load(path)

    def csr(split):
        return sp.csr_matrix((d[f"{split}_data"], d[f"{split}_indices"], d[f"{split}_indptr"]),
                             shape=tuple(d[f"{split}_shape"]))
    return csr("train"), csr("test")


def _recall(ix: Index, Q: sp.csr_matrix, **kw) -> float:
    hits = []
    for i in range(Q.shape[0]):
        truth = [n.similarity for n in ix.query(Q[i], k=10, mode="exact").neighbors]
        got = [n.similarity for n in ix.query(Q[i], k=10, **kw).neighbors]
        hits.append(sum(s >= truth[-1] - 1e-9 for s in got) / 10)
    return float(np.mean(hits))


def test_on_text_the_tuner_weighs_the_postings_search_reports_it_and_it_can_be_overridden(tmp_path, brown):
    """Brown passages: the tuner chooses between sketches, postings and exact search by
    cost at its target recall and says which; an operator's ``rare`` override switches the
    postings search off (0) or on; a query may ask for it by mode."""
    X, Q = brown
    ids = [str(i) for i in range(X.shape[0])]
    with Index.open(tmp_path / "b", IndexConfig(dim=X.shape[1]), maintain=False) as ix:
        ix.upsert(ids, X)
        tuned = ix.maintain()["tune"][-1]
        search = ix.stats()["search"]
        assert ix.view().postings_search
        assert tuned["chosen"] in ("sketch", "postings", "exact")
        assert (search["rare"] > 0) == (tuned["chosen"] == "postings")
        assert search["exact"] == (tuned["chosen"] == "exact")
        assert ix.query(Q[0], k=5).mode == tuned["chosen"]
        if tuned["chosen"] == "postings":
            assert describe_search(search).startswith("postings")
        # asked for by mode, at the default share of rare coordinates and a rerank of 400
        assert _recall(ix, Q[:40], mode="postings", candidates=400) >= 0.95
    with Index.open(tmp_path / "b", search={"rare": 0.0}, maintain=False) as ix:
        assert ix.query(Q[0], k=5).mode in ("sketch", "exact")
    with Index.open(tmp_path / "b", search={"rare": 1 / 64}, maintain=False) as ix:
        assert ix.query(Q[0], k=5).mode in ("postings", "exact")


def test_the_postings_ladder_goes_past_800_candidates_as_text_grows():
    """At a million Brown rows the tuner's exploration sees the postings search reach recall 0.96
    only past 800 candidates (measured: 0.955 at 800 with 1/64 of the rows' rare coordinates read,
    docs/tuning.md). The
    tuner's bisection on each share's candidates goes that far and keeps the fewest that reach
    the target (here a step in recall at a known count per share, none at the rarest two)."""
    from types import SimpleNamespace

    from gmmlsh.index import tuner

    need = {1 / 1024: None, 1 / 256: None, 1 / 128: 3200, 1 / 64: 1600}

    class Step:
        target, spent, view = 0.96, False, SimpleNamespace(postings_search=True)

        def recall(self, p):
            return 0.97 if need[p.rare] and p.candidates >= need[p.rare] else 0.9

        def seconds(self, p):
            return p.candidates * 1e-6

    assert set(need) == set(tuner._RARE_SHARES)
    found = tuner._postings_settings(Step(), float("inf"))
    assert sorted((p.rare, p.candidates) for _, p, _ in found) == [(1 / 128, 3200), (1 / 64, 1600)]
