"""The Index, end to end on both backends: a real LMDB on disk and a real redis-server."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import FMNIST as FMNIST_PATH
from conftest import replaced_over_and_over
from redis_fixtures import redis_url  # noqa: F401

from gmmlsh.core import nrff, parallel
from gmmlsh.core.codes import bbit_codes, pack_codes
from gmmlsh.core.gcws import sketch
from gmmlsh.core.gmm import gmm, gmm_matrix
from gmmlsh.core.validate import DimensionError, NonFiniteError, SparseIndexError, VectorError, ZeroVectorError
from gmmlsh.index import segments
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.index.mirror import Mirror
from gmmlsh.index.records import DENSE, SPARSE_GIVEN_DENSE, SPARSE_GIVEN_SPARSE, decode_vector
from gmmlsh.index.search import query_codes
from gmmlsh.index.store.base import ConfigConflict


def _open(location, config=None, **kw):
    loc, opts = location
    return Index.open(loc, config, **opts, **kw)


def _ids(a, b):
    return [f"v{i}" for i in range(a, b)]


def _in_another_process(location, code: str) -> str:
    """Run ``code`` in a fresh Python process with ``ix`` open on the same index and ``X`` the
    Fashion-MNIST train vectors; returns what it printed."""
    loc, opts = location
    script = textwrap.dedent(f"""
        import json, numpy as np
        from gmmlsh.index.index import Index
        X = np.load({str(FMNIST_PATH)!r})["train"]
        with Index.open({loc!r}, **{opts!r}) as ix:
    """) + textwrap.indent(textwrap.dedent(code), "    ")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _answers(ix, Q, **kw):
    return [[(n.id, round(n.similarity, 12)) for n in ix.query(q, k=10, **kw).neighbors] for q in Q]


def test_reopen_in_new_process_gives_same_answers(location, fmnist, tmp_path):
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784)) as ix:
        ix.upsert(_ids(0, 5000), X[:5000])
        ix.maintain()
        before = _answers(ix, Q[:20])
    np.save(tmp_path / "q.npy", Q[:20])
    out = _in_another_process(location, f"""
        Q = np.load({str(tmp_path / "q.npy")!r})
        print(json.dumps([ix.count(), [[(n.id, round(n.similarity, 12)) for n in ix.query(q, k=10).neighbors]
                                       for q in Q]]))
    """)
    count, after = json.loads(out.strip().splitlines()[-1])
    assert count == 5000
    assert [[tuple(p) for p in row] for row in after] == before


def test_upsert_replaces_and_delete_removes_everywhere(location, fmnist):
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784)) as ix:
        ix.upsert(_ids(0, 3000), X[:3000], [{"n": i} for i in range(3000)])
        ix.maintain()  # lists over the first versions
        ix.upsert(["v7"], X[3100:3101], [{"n": "new"}])  # v7 now holds another image
        assert ix.count() == 3000
        got = ix.get("v7")
        np.testing.assert_array_equal(got.values, X[3100].astype(np.float32))
        assert got.metadata == {"n": "new"}
        for mode in ("auto", "exact"):
            top = ix.query(X[3100], k=1, mode=mode).neighbors[0]
            assert top.id == "v7" and top.similarity == pytest.approx(1.0) and top.metadata == {"n": "new"}
            # the old version is never an answer, not even through its old list
            assert all(n.similarity < 1.0 or n.id != "v7" for n in ix.query(X[7], k=20, mode=mode).neighbors)
        assert ix.delete(["v7", "v8", "nope"]) == 2
        assert ix.count() == 2998 and not ix.contains("v7")
        with pytest.raises(UnknownIdError):
            ix.get("v8")
        for mode in ("auto", "exact"):
            for q in (X[3100], X[8], X[7]):
                assert {n.id for n in ix.query(q, k=50, mode=mode).neighbors}.isdisjoint({"v7", "v8"})
        view = ix.view()
        assert int(view.alive.sum()) == 2998
        report = ix.check()
        assert report.ok, report.summary()


def test_exact_mode_is_brute_force_and_similarities_are_exact_gmm(location, fmnist):
    X, _, Q, _ = fmnist
    base = X[:3000]
    with _open(location, IndexConfig(dim=784, nrff_k=128, gamma=1.0)) as ix:
        ix.upsert(_ids(0, 3000), base)
        S = gmm_matrix(Q[:10].astype(np.float64), base.astype(np.float32))
        F = nrff.features(base.astype(np.float64), 128, 1.0).astype(np.float32)
        for qi in range(10):
            res = ix.query(Q[qi], k=10, mode="exact")
            assert res.mode == "exact" and res.candidates == 3000
            want = np.argsort(-S[qi], kind="stable")[:10]
            np.testing.assert_allclose([n.similarity for n in res.neighbors], S[qi, want], rtol=0, atol=1e-12)
            assert [n.id for n in res.neighbors][:5] == [f"v{i}" for i in want[:5]]
            for mode in ("auto", "exact"):
                for n in ix.query(Q[qi], k=10, mode=mode).neighbors:
                    assert n.similarity == pytest.approx(gmm(Q[qi].astype(np.float64), base[int(n.id[1:])]), abs=1e-12)
            # nrff: the best by estimated RBF among the stored features, reported with their exact RBF
            res = ix.query(Q[qi], k=10, mode="nrff", candidates=10)
            f = nrff.features(Q[qi].astype(np.float64), 128, 1.0).astype(np.float32)
            assert {int(n.id[1:]) for n in res.neighbors} == set(np.argsort(-(F @ f))[:10].tolist())
            q = Q[qi].astype(np.float64)
            for n in res.neighbors:
                x = base[int(n.id[1:])].astype(np.float64)
                rho = q @ x / np.linalg.norm(q) / np.linalg.norm(x)
                assert n.similarity == pytest.approx(np.exp(-(1 - rho)), abs=1e-6)


@pytest.mark.slow
def test_recall_at_10_default_parameters(fmnist, tmp_path):
    """Recall@10 of the default query vs exact ≥ 0.95: 1,000 test queries over the 60,000 train
    vectors, with the parameters the index chose for itself."""
    X, _, Q, _ = fmnist
    Qs = Q[:1000]
    with Index.open(tmp_path / "full", IndexConfig(dim=784)) as ix:
        for lo in range(0, 60_000, 20_000):
            ix.upsert([str(i) for i in range(lo, lo + 20_000)], X[lo:lo + 20_000])
        done = ix.maintain()
        assert done["fit"][0]["fit"] == 1 and done["tune"][0]["chosen"] == "sketch"
        S = np.vstack([gmm_matrix(Qs[i:i + 100].astype(np.float64), X.astype(np.float32))
                       for i in range(0, 1000, 100)])
        tenth = np.sort(S, axis=1)[:, -10]
        hits = sum(sum(n.similarity >= tenth[i] - 1e-12 for n in r.neighbors)
                   for i, r in enumerate(ix.query_batch(Qs, k=10)))
        recall = hits / 10_000
        print(f"recall@10 = {recall:.4f} with {ix.stats()['search']}")
        assert recall >= 0.95


def test_sparse_high_dimensional_and_signed(location):
    rng = np.random.default_rng(5)
    dim, n = 55_197, 400
    rows = [(np.sort(rng.choice(dim, size=160, replace=False)), rng.lognormal(size=160)) for _ in range(n)]
    indptr = np.cumsum([0] + [len(r[0]) for r in rows])
    X = sp.csr_matrix((np.concatenate([r[1] for r in rows]), np.concatenate([r[0] for r in rows]), indptr),
                      shape=(n, dim))
    with _open(location, IndexConfig(dim=dim, samples=128)) as ix:
        ix.upsert([f"s{i}" for i in range(n)], X)
        # A near copy of row 3 finds row 3 first, in every mode that applies.
        idx, val = rows[3]
        for mode in ("auto", "exact"):
            res = ix.query((idx, val * 1.01), k=5, mode=mode)
            assert res.neighbors[0].id == "s3"
            assert res.neighbors[0].similarity == pytest.approx(1 / 1.01, rel=1e-6)
        assert ix.query(id="s3", k=5, mode="exact").neighbors[0].id != "s3"
        got = ix.get("s3")
        np.testing.assert_array_equal(got.indices, idx)
        np.testing.assert_allclose(got.values, val.astype(np.float32))
    signed = np.random.default_rng(6).normal(size=(300, 40))
    second = ((location[0] + "-signed", {}) if not location[0].startswith("redis")
              else (location[0], {**location[1], "prefix": location[1]["prefix"] + "s"}))
    with _open(second, IndexConfig(dim=40, samples=64)) as ix:
        ix.upsert([str(i) for i in range(300)], signed)
        # Differs from row 0 only in its negative coordinates: GMM < 1, and not taken as equal.
        q = signed[0].copy()
        q[q < 0] *= 3
        sims = {n.id: n.similarity for n in ix.query(q, k=300, mode="exact").neighbors}
        f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731  (stored precision)
        assert sims["0"] == pytest.approx(gmm(f32(q), f32(signed[0])), abs=1e-12)
        assert sims["0"] < 0.9
        assert ix.query(signed[0], k=1).neighbors[0].id == "0"


@pytest.mark.parametrize("signed", [False, True])
def test_exact_on_sparse_data_equals_a_numpy_reference(location, signed):
    """Brute force over sparse rows (a CSR scan) gives numpy's min/max sums exactly."""
    rng = np.random.default_rng(11 + signed)
    n, dim = 500, 20_000
    X = sp.random(n, dim, density=0.006, random_state=12, format="csr", dtype=np.float64)
    X.data = np.round(X.data * 20) + 1  # counts
    if signed:
        X.data[rng.random(X.data.shape[0]) < 0.4] *= -1
    Q = sp.random(20, dim, density=0.01, random_state=13, format="csr", dtype=np.float64)
    Q.data = np.round(Q.data * 20) + 1
    Q = Q + X[:20]  # neighbours to find
    with _open(location, IndexConfig(dim=dim)) as ix:
        ix.upsert([f"d{i}" for i in range(n)], X)
        for i in range(20):
            q = Q[i].toarray().ravel()
            xs = X.toarray()
            pos = lambda a: np.maximum(a, 0)  # noqa: E731
            neg = lambda a: np.maximum(-a, 0)  # noqa: E731
            num = np.minimum(pos(q), pos(xs)).sum(1) + np.minimum(neg(q), neg(xs)).sum(1)
            den = np.maximum(pos(q), pos(xs)).sum(1) + np.maximum(neg(q), neg(xs)).sum(1)
            ref = num / den
            res = ix.query(Q[i], k=10, mode="exact")
            want = np.argsort(-ref, kind="stable")[:10]
            np.testing.assert_allclose([nb.similarity for nb in res.neighbors], ref[want], rtol=1e-12)


def test_storage_follows_the_data_and_reads_back_as_given(location):
    """A row with fewer than dim/4 nonzeros is stored sparse, whatever shape it came in;
    it reads back in the shape it was given in."""
    dim = 400
    dense_rows = np.zeros((3, dim))
    dense_rows[0] = 1.0  # dense
    dense_rows[1, :50] = 2.0  # mostly zeros, given dense
    dense_rows[2, :150] = 3.0
    sparse_rows = sp.csr_matrix(dense_rows.copy())
    with _open(location, IndexConfig(dim=dim, samples=64)) as ix:
        ix.upsert(["d0", "d1", "d2"], dense_rows)
        ix.upsert(["s0", "s1", "s2"], sparse_rows)
        iids = ix.store.lookup(["d0", "d1", "d2", "s0", "s1", "s2"])
        kinds = [decode_vector(b)[1] for b in ix.store.read(iids, ["vector"])["vector"]]
        assert kinds == [DENSE, SPARSE_GIVEN_DENSE, DENSE, DENSE, SPARSE_GIVEN_SPARSE, DENSE]
        np.testing.assert_array_equal(ix.get("d1").values, dense_rows[1].astype(np.float32))
        assert ix.get("d1").indices is None
        np.testing.assert_array_equal(ix.get("s1").indices, np.arange(50))
        assert ix.query(dense_rows[1], k=2, mode="exact").neighbors[0].similarity == pytest.approx(1.0)


def test_a_query_given_dense_or_sparse_gets_the_same_answer(tmp_path):
    """The same vector as a dense array or as its nonzeros: the same neighbours with the same
    similarities, bit for bit, in every mode. Values of very different magnitudes make a sum's
    last bit depend on its order: a query's L1 norm summed by numpy (pairwise over the dense
    row, plainly over the nonzeros) scored the vector against itself 0.9999999999999997 one way
    and 0.9999999999999998 the other, in 20 of 300 such vectors (found by the fuzz test)."""
    rng = np.random.default_rng(11)
    dim = 12
    scales = [48.0, 1e3, 3.0, 2.7e-13, 1e-9, 0.37, -5.0, -1e-11, 700.0]
    with Index.open(str(tmp_path / "idx"), IndexConfig(dim=dim, samples=64), maintain=False) as ix:
        X = np.zeros((120, dim))
        for x in X:
            at = rng.choice(dim, rng.integers(2, dim + 1), replace=False)
            x[at] = rng.choice(scales, at.size) * rng.uniform(0.5, 2.0, at.size)
        ix.upsert([f"d{i}" for i in range(len(X))], X)
        ix.upsert([f"s{i}" for i in range(len(X))], sp.csr_matrix(X))
        ix.maintain()
        for x in X:
            nz = np.flatnonzero(x)
            for mode in ("auto", "exact"):
                as_dense, as_sparse = ix.query(x, k=5, mode=mode), ix.query((nz, x[nz]), k=5, mode=mode)
                assert [(n.id, n.similarity) for n in as_dense.neighbors] == \
                    [(n.id, n.similarity) for n in as_sparse.neighbors], (mode, x.tolist())


def test_rows_given_one_by_one_dense_or_sparse_keep_their_shapes(location):
    """``prepare_rows`` takes what a request mixes: each row dense or an (indices, values) pair,
    stored and read back in its own shape, in the given order; a bad row is named by its place
    among all the rows, and its part (indices or values)."""
    dim = 40
    dense = np.zeros(dim)
    dense[[1, 7]] = [1.0, 2.0]
    with _open(location, IndexConfig(dim=dim, samples=64)) as ix:
        rows = [dense, ([3, 9], [0.5, 1.5]), 2 * dense, ([0], [4.0])]
        with pytest.raises(SparseIndexError) as info:
            ix.prepare_rows(["a", "b", "c", "d"], [*rows[:3], ([9, 3], [1.0, 1.0])])
        assert (info.value.row, info.value.part, info.value.field) == (3, "indices", "vectors[3].indices")
        with pytest.raises(VectorError) as info:
            ix.prepare_rows(["a", "b", "", "d"], rows)
        assert (info.value.row, info.value.part) == (2, "id")
        with pytest.raises(VectorError) as info:
            ix.prepare_rows(list("abcd"), rows, [None, None, None, {"x": {1, 2}}])
        assert (info.value.row, info.value.part) == (3, "metadata")
        assert ix.count() == 0
        assert ix.write(ix.prepare_rows(list("abcd"), rows, [None, {"m": 1}, None, None])).vectors == 4
        a, b, c, d = (ix.get(i) for i in "abcd")
        assert a.indices is None and np.array_equal(a.values, dense.astype(np.float32))
        assert b.indices.tolist() == [3, 9] and b.values.tolist() == [0.5, 1.5] and b.metadata == {"m": 1}
        assert c.indices is None and np.array_equal(c.values, 2 * dense.astype(np.float32))
        assert d.indices.tolist() == [0] and d.values.tolist() == [4.0]


def test_another_process_writes_are_seen_by_the_next_query(location, fmnist):
    """A process's next query sees what another process (or replica) wrote and deleted."""
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784, samples=128)) as ix:
        ix.upsert(_ids(0, 300), X[:300], [{"v": 1}] * 300)
        assert ix.query(X[400], k=1).neighbors[0].id != "v400"
        _in_another_process(location, """
            for i in range(300, 460, 4):
                ix.upsert([f"v{i}"], X[i : i + 1])
        """)
        for i in range(300, 460, 12):
            top = ix.query(X[i], k=1).neighbors[0]
            assert top.id == f"v{i}" and top.similarity == pytest.approx(1.0)
        first = ix.query(X[5], k=5)
        top, second = first.neighbors[0].id, first.neighbors[1].id
        assert top == "v5"
        _in_another_process(location, f"ix.delete([{top!r}])")
        after = ix.query(X[5], k=5)
        assert top not in [n.id for n in after.neighbors] and after.neighbors[0].id == second
        j = int(second[1:])
        _in_another_process(location, f"ix.upsert([{second!r}], X[{j}:{j + 1}], metadata=[{{'v': 2}}])")
        replaced = ix.query(X[5], k=5)
        assert replaced.neighbors[0].id == second and replaced.neighbors[0].metadata == {"v": 2}
        assert [n.id for n in replaced.neighbors].count(second) == 1


def test_an_id_being_replaced_is_found_by_every_query_meanwhile(location):
    """Ids replaced over and over (by the same vectors) while queries look for them: every exact
    query finds its id, once. A sync used to clear the old row's live flag in the mapped column
    before publishing the row count that takes in the new one, so a query between found the id
    in neither row (11 of 3,000 queries missed it); each view now copies the flags as of its
    state, which names the rows it retires."""
    X = np.random.default_rng(0).random((300, 16))
    names = [f"v{i:03d}" for i in range(len(X))]
    hot = list(range(0, len(X), 10))
    missed = []
    with _open(location, IndexConfig(dim=16, samples=64), maintain=False) as ix:
        ix.upsert(names, X)
        with replaced_over_and_over(ix, names, X, hot):
            pick = random.Random(2)
            for _ in range(3000):
                i = pick.choice(hot)
                found = [n.id for n in ix.query(X[i], k=2, mode="exact").neighbors]
                if found[0] != names[i] or found[1] == names[i]:
                    missed.append((names[i], found))
    assert not missed, missed[:5]


def test_a_record_retired_while_a_sync_reads_it_leaves_its_id_in_the_view(location):
    """A sync reads the store's changes up to a token, then the records added; a write that does
    not wait for it (any Redis writer; an LMDB bulk load) can retire one of those records in
    between. The id must stay found: the sync follows on to the write's new record. It used to
    skip the gone record and still publish the old row's retirement, so the view held the id in
    neither row until the next sync (one of 3,000 queries in the test above, on Redis)."""
    X = np.random.default_rng(3).random((42, 16))
    with _open(location, IndexConfig(dim=16, samples=64), maintain=False) as ix:
        ix.upsert(_ids(0, 40), X[:40])
        ix.store.write(ix.prepare(["v7"], X[[40]]))  # not in the mirror yet: the sync below reads it
        changes, late = ix.store.changes, []

        def changes_then_a_write(since):  # the writer gets in between the sync's two reads
            out = changes(since)
            if not late:
                late.append(ix.store.write(ix.prepare(["v7"], X[[41]])))
            return out

        ix.store.changes = changes_then_a_write
        view = ix.mirror.sync(ix.store)
        assert late
        rows = view.live_rows()
        assert view.names_of(rows.tolist()).count("v7") == 1
        ix.store.changes = changes
        found = ix.query(X[41], k=2, mode="exact").neighbors
        assert [n.id for n in found].count("v7") == 1 and found[0].id == "v7"


def test_flags_a_killed_sync_published_but_did_not_clear_are_cleared(tmp_path):
    """A sync publishes the rows it retires, then clears their flags. Killed between the two, it
    leaves a replaced id's old row live on disk: views still see the id once (they clear the rows
    the state names), and the next sync clears the flag for good."""
    X = np.random.default_rng(1).random((50, 8))
    with Index.open(tmp_path / "ix", IndexConfig(dim=8), maintain=False) as ix:
        ix.upsert(_ids(0, 50), X)
        ix.upsert(["v3"], X[[3]])
        mirror_dir = ix.mirror.dir
    (old,) = json.loads((mirror_dir / "state.json").read_text())["retiring"]
    alive = np.memmap(mirror_dir / "alive.u1", np.uint8, mode="r+")
    assert alive[old] == 0
    alive[old] = 1  # as the killed process left it
    alive.flush()
    with Index.open(tmp_path / "ix", maintain=False) as ix:
        assert [n.id for n in ix.query(X[3], k=2, mode="exact").neighbors].count("v3") == 1
        assert ix.check().ok
        ix.upsert(["v60"], X[[4]])
        assert json.loads((mirror_dir / "state.json").read_text())["retiring"] == []  # the next sync's own: none
    assert np.memmap(mirror_dir / "alive.u1", np.uint8, mode="r")[old] == 0


def test_a_query_reads_the_store_once_when_nothing_changed(location, fmnist):
    """Steady state: one token read per query (one LMDB get, one Redis round trip), no records."""
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 500), X[:500])
        ix.query(Q[0])
        calls = []
        for name in ("token", "token_later", "changes", "read", "lookup", "scan"):
            real = getattr(ix.store, name)
            setattr(ix.store, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
        for q in Q[:20]:
            ix.query(q, k=5)
        # one token asked for per query (LMDB's token_later reads it at once, through token())
        assert calls.count("token_later") == 20 and calls.count("token") <= 20
        assert set(calls) <= {"token_later", "token"}


@pytest.mark.parametrize("threads", [1, 2])
def test_query_batch_answers_as_single_queries(location, fmnist, threads):
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784)) as ix:
        ix.upsert(_ids(0, 3000), X[:3000], metadata=[{"i": i} for i in range(3000)])
        ix.maintain()
        ix.delete(_ids(0, 3000)[::7])
        replaced = _ids(1, 3000)[::9]
        ix.upsert(replaced, X[3000:3000 + len(replaced)])
        parallel.set_threads(threads)
        try:
            batch = ix.query_batch(Q[:40], k=7, min_similarity=0.3)
        finally:
            parallel.set_threads(numba.config.NUMBA_NUM_THREADS)
        single = [ix.query(q, k=7, min_similarity=0.3) for q in Q[:40]]
        assert batch == single
        assert all(n.metadata is None or n.metadata["i"] == int(n.id[1:]) for r in single for n in r.neighbors)


def test_codes_hashed_elsewhere_answer_as_hashing_here(tmp_path, fmnist):
    """A query's codes made by another process (a router) give the sketch search's answer bit for
    bit; another query's codes give another (they are used); codes of the wrong shape or width
    are refused naming ``codes``."""
    X, _, Q, _ = fmnist
    with _open((str(tmp_path / "ix"), {}), IndexConfig(dim=784, samples=64)) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        ix.maintain()
        codes = query_codes(Q[:20], ix.config)
        assert codes.shape == (20, 64) and codes.dtype == np.uint16
        here = ix.query_batch(Q[:20], k=7, mode="sketch")
        assert ix.query_batch(Q[:20], k=7, mode="sketch", codes=codes) == here
        assert [ix.query(Q[i], k=7, mode="sketch", codes=codes[i:i + 1]) for i in range(3)] == here[:3]
        assert ix.query_batch(Q[:20], k=7, mode="sketch", codes=codes[::-1]) != here
        for bad in (codes[:, :63], codes[:19], codes.astype(np.float32), np.full_like(codes, 256)):
            with pytest.raises(VectorError) as err:
                ix.query_batch(Q[:20], mode="sketch", codes=bad)
            assert err.value.field == "codes"


def test_bad_input_changes_nothing(location):
    with _open(location, IndexConfig(dim=8, samples=32)) as ix:
        ix.upsert(["a"], np.ones((1, 8)))
        bad = [
            (np.ones((1, 7)), DimensionError),
            (np.array([[np.nan] * 8]), NonFiniteError),
            (np.zeros((1, 8)), ZeroVectorError),
            (np.full((1, 8), 1e39), NonFiniteError),  # overflows float32 storage
        ]
        for X, err in bad:
            with pytest.raises(err):
                ix.upsert(["b"], X)
        with pytest.raises(ZeroVectorError):  # one bad row refuses the whole batch
            ix.upsert(["c", "d"], np.vstack([np.ones(8), np.zeros(8)]))
        assert ix.count() == 1 and not ix.contains("c")
        with pytest.raises(UnknownIdError):
            ix.query(id="zz")
        for kw in ({"k": 0}, {"k": 5000}, {"mode": "fast"}, {"candidates": 0}, {"probes": -1}):
            with pytest.raises(ValueError):
                ix.query(np.ones(8), **kw)
    with pytest.raises(ConfigConflict):
        _open(location, IndexConfig(dim=8, samples=33))


def test_sketches_are_stored_as_rehash(location, fmnist):
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784, samples=64)) as ix:
        ix.upsert(_ids(0, 200), X[:200])
        stored = ix.store.read(ix.store.lookup(_ids(0, 200)), ["sketch"])["sketch"]
        want = pack_codes(bbit_codes(sketch(X[:200].astype(np.float32), 64), 8), 8)
        np.testing.assert_array_equal(np.frombuffer(b"".join(stored), np.uint8).reshape(200, -1), want)


def test_the_search_is_tuned_reported_and_overridable(location, fmnist):
    """The index chooses its search from its own data, says so, and every choice can be overridden."""
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784), search={"candidates": 77}) as ix:
        ix.upsert(_ids(0, 6000), X[:6000])
        done = ix.maintain()
        assert done["tune"][0]["chosen"] in ("sketch", "exact") and done["fit"][0]["fit"] == 1
        search = ix.stats()["search"]
        assert search["tuned_at_rows"] == 6000 and search["candidates"] == 77 and search["overrides"]
        assert ix.query(Q[0], k=5).candidates <= 77
        assert ix.query(Q[0], k=5, candidates=9).candidates <= 9
        wide = ix.query(Q[0], k=5, probes=0, candidates=6000)  # every list, everything reranked: exact
        assert [n.id for n in wide.neighbors] == [n.id for n in ix.query(Q[0], k=5, mode="exact").neighbors]
    with _open(location, maintain=False) as ix:  # another process's view of the same index
        assert ix.stats()["search"]["tuned_at_rows"] == 6000


@pytest.mark.parametrize("answers_only", [False, True])
def test_where_no_sketch_search_reaches_the_target_the_index_answers_exactly(tmp_path, fmnist, monkeypatch,
                                                                             answers_only):
    """When the tuner finds no setting reaching its target recall and exact search costs at most
    EXACT_MARGIN times the widest sketch search, the default query answers by brute force and says
    so; a query's own knobs still reach the lists. ``answers_only``: the trials' candidates reach
    it but no finalist's answers do (the coarse ranking lost true rows): no sketch search either.
    Exact search is timed at half the margin (at 3,000 rows it costs ~2× the widest sketch search
    here, and a noisy timing of 8 queries passed 3×)."""
    from gmmlsh.index import tuner

    X, _, Q, _ = fmnist
    # nothing reaches the target; or only the candidates do
    monkeypatch.setattr(tuner, "_recall", lambda *a, scored=False: 1.0 if answers_only and not scored else 0.0)
    monkeypatch.setattr(tuner, "_exact_seconds", lambda view, qs, rival: rival / 2)
    with Index.open(tmp_path / "t", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        done = ix.maintain()
        assert done["tune"][0]["chosen"] == "exact" and ix.stats()["search"]["exact"]
        res = ix.query(Q[0], k=3)
        assert res.mode == "exact" and res.candidates == 3000
        assert ix.query(Q[0], k=3, candidates=50).mode == "sketch"


def test_where_exact_search_costs_past_the_margin_the_widest_search_answers(tmp_path, fmnist, monkeypatch):
    """No cliff: where nothing reaches the target and exact search costs more than EXACT_MARGIN
    times the widest sketch search, the index keeps that search and says it missed."""
    from gmmlsh.index import tuner

    X, _, Q, _ = fmnist
    monkeypatch.setattr(tuner, "_recall", lambda *a, scored=False: 0.0)
    monkeypatch.setattr(tuner, "_exact_seconds", lambda view, qs, rival: rival * 2)
    with Index.open(tmp_path / "t", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        report = ix.maintain()["tune"][0]
        assert report["chosen"] == "sketch" and not ix.stats()["search"]["exact"]
        assert report["widened"] and report["widest_recall_bound"] == 0.0
        assert ix.query(Q[0], k=3).mode == "sketch"


def test_tuning_trials_find_the_rows_the_search_finds_and_its_recall(tmp_path, fmnist):
    """A tuning trial runs the search without its GMM stages (it counts which rows reach the
    candidates, unscored): for lists and tail, retired rows and every kind of setting, the rows
    the search scores exactly are among the trial's candidates, and the trial's recall is the
    recall of the search's answers (the coarse ranking keeps every true row among the best)."""
    from gmmlsh.index import tuner
    from gmmlsh.index.config import SearchParams
    from gmmlsh.index.search import run_exact, run_sketch

    X, _, _, _ = fmnist
    with Index.open(tmp_path / "t", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 4000), X[:4000])
        ix.maintain()
        ix.delete(_ids(0, 4000)[::5])
        ix.upsert(_ids(4000, 4600), X[4000:4600])  # an unlisted tail
        view = ix.view()
        qs, _ = tuner._sample(view, ix.config, 40, 1, None)
        truth = tuner.truth(view, qs)
        tenth = [np.sort(run_exact(view, q)[1])[-10] for q in qs]
        for probes, shortlist, bits, cands in [(2, 100, 2, 10), (4, 500, 4, 50), (8, 1000, 4, 200), (0, 250, 2, 75)]:
            params = SearchParams(probes=probes, shortlist=shortlist, rank_bits=bits, candidates=cands)
            found = run_sketch(view, qs, params, ix.config)
            trials = run_sketch(view, qs, params, ix.config, scored=False)
            for (rows, _, _), (trial_rows, trial_sims, _) in zip(found, trials, strict=True):
                assert set(rows.tolist()) <= set(trial_rows.tolist()) and not trial_sims.any()
            per_query = np.array([(np.sort(sims)[::-1][:10] >= t).sum() / 10
                                  for (_, sims, _), t in zip(found, tenth, strict=True)])
            bound = per_query.mean() - tuner.CONFIDENCE_Z * per_query.std(ddof=1) / np.sqrt(len(qs))
            assert tuner._recall(view, qs, truth, params, ix.config) == pytest.approx(bound, abs=1e-12)
            assert tuner._recall(view, qs, truth, params, ix.config, scored=True) == pytest.approx(bound, abs=1e-12)


def test_a_tuning_times_a_setting_once_per_pass_and_the_finalists_again(tmp_path, fmnist):
    """Strokes at 2M rows: the cheapest postings search caps several widenings, and it was timed
    again each time (~2 s on the index's 16 timing queries). One pass of a setting is timed once
    in a tuning (the same seconds each time it is asked); the finalists' three passes are timed
    afresh."""
    from dataclasses import replace

    from gmmlsh.index import tuner
    from gmmlsh.index.config import SearchParams

    X, _, _, _ = fmnist
    with Index.open(tmp_path / "t", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        ix.maintain()
        view = ix.view()
        qs, _ = tuner._sample(view, ix.config, 16, 1, None)
        trials = tuner._Trials(view, qs, tuner.truth(view, qs), ix.config, 0.96, hash_s=0.0)
        params = SearchParams(probes=4, shortlist=200, rank_bits=4, candidates=50)
        once = trials.seconds(params)
        assert once > 0 and trials.seconds(params) == once
        assert trials.seconds(replace(params, probes=8)) != once
        assert trials.seconds(params, rounds=3, qs=qs) != once


def test_the_ladder_walk_ends_one_list_count_past_the_first_that_reaches(monkeypatch):
    """Strokes at 1.9M rows: at a fixed shortlist more lists can recall less (96 lists reached
    the target, 128 to every list missed it), and the walk went on to every list, with both
    rank widths: the trials ran out and the slowest of them took the tuning's time. A walk ends
    one list count past its first that reaches; the walk with fewer rank bits takes those two."""
    from gmmlsh.index import tuner

    walked = []

    def recall(view, qs, true, params, config, scored=False):
        walked.append((params.probes, params.rank_bits))
        reach = (params.probes, params.rank_bits) == (96, 4) and params.shortlist >= 3000 and params.candidates >= 300
        return 0.97 if reach else 0.95 + params.shortlist * 1e-6  # below the target, growing with the shortlist

    monkeypatch.setattr(tuner, "_recall", recall)
    monkeypatch.setattr(tuner._Trials, "seconds", lambda self, params, rounds=1, qs=None: 1e-3)
    trials = tuner._Trials(view=None, qs=[], true=[], config=None, target=0.96, hash_s=0.0)
    reached = tuner._sketch_settings(trials, 3710, [4, 2])
    assert {p.probes for _, p, _ in reached} == {96} and {p.rank_bits for _, p, _ in reached} == {4}
    ladder = tuner._probe_ladder(3710)
    assert {p for p, bits in walked if bits == 4} == set(ladder[:ladder.index(128) + 1])
    assert {p for p, bits in walked if bits == 2} == {96, 128}  # never every list (0), nor 192 and up


def test_a_near_miss_is_widened_before_any_slow_postings_search_is_explored(tmp_path, fmnist, monkeypatch):
    """Strokes at 1.9M rows: the sketch searches the exploration found reaching the target
    missed it on the whole sample, scored; the postings searches (0.12 s a query) were explored
    next and took the tuning's time, no widening was left, and exact search answered (0.24 s a
    query) where more lists and a longer shortlist reached the target at 1.25 ms. Postings searches costing over
    ``NEAR_MISS`` times the near miss are not explored: the sketch search is widened first."""
    from gmmlsh.index import tuner
    from gmmlsh.index.mirror import View

    X, _, _, _ = fmnist
    tried = []

    def recall(view, qs, true, params, config, scored=False):
        tried.append("postings" if params.rare else "sketch")
        if params.rare:
            return 0.0
        return 0.99 if params.shortlist >= (2000 if scored else 500) and not 0 < params.probes < 6 else 0.9

    monkeypatch.setattr(tuner, "_recall", recall)
    monkeypatch.setattr(View, "postings_search", property(lambda self: True))
    monkeypatch.setattr(tuner._Trials, "seconds",
                        lambda self, p, rounds=1, qs=None: 0.1 if p.rare else 1e-6 * (1 + (p.probes or 100)))
    with Index.open(tmp_path / "t", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        ix.upsert(_ids(0, 6000), X[:6000])
        report = ix.maintain()["tune"][0]
        search = ix.stats()["search"]
    assert report["chosen"] == "sketch" and search["shortlist"] >= 2000 and search["rare"] == 0
    assert "postings" not in tried


def test_a_search_that_misses_on_the_whole_sample_is_widened_a_step_at_a_time_then_trimmed(monkeypatch):
    """Fashion-MNIST at a million: the cheapest settings the exploration found (16–24 lists)
    missed the target on the whole sample, scored, and the search went straight to every list
    (6 ms a query where 32 lists took 0.56). Strokes at a million: the lists were not what
    limited recall, and climbing to every list before lengthening the shortlist chose every
    list (8–32 ms where 96–128 lists and a longer shortlist took 2.3–7). Widening goes a step at
    a time, the three ways in turn — the next rung of lists, the shortlist doubled, the
    candidates doubled — to the first setting reaching the target (here recall as a step at a
    known width); then each way is narrowed back a step while the target holds, so a step the
    last one made unneeded is undone, and no setting is tried twice."""
    from types import SimpleNamespace

    from gmmlsh.index import tuner
    from gmmlsh.index.config import SearchParams

    tried = []

    def step(view, qs, true, params, config, scored=False):
        assert scored
        tried.append((params.probes, params.shortlist, params.candidates))
        return 0.97 if reach(params) else 0.9

    monkeypatch.setattr(tuner, "_recall", step)
    trials = SimpleNamespace(view=SimpleNamespace(list_count=1000), config=None, target=0.96, key=tuner._Trials.key,
                             late=False)
    start = SearchParams(probes=16, shortlist=500, rank_bits=2, candidates=200)
    reach = lambda p: p.probes >= 32  # noqa: E731 - the lists limit: the shortlist and candidates undone
    assert tuner._widened(trials, [], [], start) == (SearchParams(probes=32, shortlist=500, rank_bits=2,
                                                                  candidates=200), 0.97)
    assert tried == [(24, 500, 200), (24, 1000, 200), (24, 1000, 400), (32, 1000, 400),  # widened
                     (32, 500, 400), (24, 500, 400), (32, 500, 200)]  # trimmed: the lists are kept
    tried.clear()
    reach = lambda p: p.shortlist >= 2000  # noqa: E731 - the first stage limits: no climb to every list
    params, r = tuner._widened(trials, [], [], start, turn=1)
    assert (params.probes, params.shortlist, params.candidates, r) == (16, 2000, 200, 0.97)
    assert tried == [(16, 1000, 200), (16, 1000, 400), (24, 1000, 400), (24, 2000, 400),
                     (16, 2000, 400), (16, 2000, 200)]
    tried.clear()
    reach = lambda p: False  # noqa: E731
    params, r = tuner._widened(trials, [], [], start)
    assert (params.probes, params.shortlist, params.candidates, r) == (0, *tuner._WIDEST, 0.9)
    assert len(tried) == len(set(tried))  # every step wider than the last, none tried twice


def test_where_nothing_reaches_the_target_both_families_are_widened_and_the_better_one_answers(monkeypatch):
    """Text at a million under a writer: no setting the exploration found reached the target on
    the whole sample; only the sketch search was widened (to every list, 32,000, 4,000: recall
    0.87) while a postings search recalled 0.955, and the index served 0.69. Now the sketch
    search is widened while a step costs less than the cheapest postings search, then (text-like
    data) the postings search (candidates and rare share a rung up in turn, from its setting that
    recalled most), then the sketch search further, each step cheaper than a postings search
    that reached; where neither reaches the target, the one recalling most answers. Where the
    sketch search reaches it cheaply (strokes), no postings search is widened (that took a
    re-tune 97 s)."""
    from types import SimpleNamespace

    from gmmlsh.index import tuner
    from gmmlsh.index.config import SearchParams

    tried = []

    def recall(view, qs, true, params, config, scored=False):
        tried.append(("postings", params.rare, params.candidates) if params.rare else
                     ("sketch", params.probes, params.shortlist, params.candidates))
        return postings(params) if params.rare else sketch(params)

    monkeypatch.setattr(tuner, "_recall", recall)
    # a postings search costs 10 ms; a sketch search 0.1 ms a list probed (every list: 100 ms)
    trials = SimpleNamespace(view=SimpleNamespace(list_count=1000, postings_search=True), config=None, target=0.96,
                             key=tuner._Trials.key, seconds=lambda p: 0.010 if p.rare else 1e-4 * (p.probes or 1000),
                             late=False)
    found = [(0.004, SearchParams(probes=16, shortlist=500, rank_bits=4, candidates=200), 0.97),
             (0.012, SearchParams(rare=1 / 256, candidates=300), 0.965),
             (0.011, SearchParams(rare=1 / 128, candidates=200), 0.97)]
    widest = SearchParams(probes=0, shortlist=3000, rank_bits=4, candidates=400)
    postings = lambda p: 0.97 if p.rare >= 1 / 64 and p.candidates >= 400 else 0.95  # noqa: E731
    sketch = lambda p: 0.87  # noqa: E731
    assert tuner._widest(trials, [], [], found, widest) == [(SearchParams(rare=1 / 64, candidates=400), 0.97)]
    first = next(i for i, t in enumerate(tried) if t[0] == "postings")
    assert first > 0 and all(t[0] == "sketch" and 0 < t[1] < 100 for t in tried[:first])  # under 10 ms a step
    # from the postings setting that recalled most, a rung of candidates, then of rare share, in turn; then
    # the sketch search's next step (128 lists: 12.8 ms) is slower than that postings search: not taken
    assert tried[first:] == [("postings", 1 / 128, 200), ("postings", 1 / 128, 300), ("postings", 1 / 64, 300),
                             ("postings", 1 / 64, 400)]
    tried.clear()
    postings = lambda p: 0.955 if p.candidates >= 1200 else 0.94  # noqa: E731 - neither reaches it
    assert tuner._widest(trials, [], [], found, widest) == [(SearchParams(rare=1 / 64, candidates=4000), 0.955)]
    assert tried[-1][0] == "sketch" and len(tried) == len(set(tried))  # the sketch search widened to its end
    tried.clear()
    sketch = lambda p: 0.97 if p.shortlist >= 2000 else 0.9  # noqa: E731 - cheap: no postings search tried
    params, r = tuner._widest(trials, [], [], found, widest)[0]
    assert (params.rare, params.shortlist, r) == (0.0, 2000, 0.97) and all(t[0] == "sketch" for t in tried)
    tried.clear()
    trials.view.postings_search = False  # data without postings: the sketch search alone, past any cost
    sketch = lambda p: 0.97 if p.probes == 0 else 0.9  # noqa: E731
    assert tuner._widest(trials, [], [], found[:1], widest)[0][0].probes == 0
    assert all(t[0] == "sketch" for t in tried)
    tried.clear()
    trials.late = True  # the tuning has run WIDEN_SECONDS: no step is taken, each family's start is scored
    trials.view.postings_search = True
    assert tuner._widest(trials, [], [], found, widest) == [(SearchParams(rare=1 / 128, candidates=200), 0.94)]
    assert tried == [("sketch", 16, 500, 200), ("postings", 1 / 128, 200)]  # the sketch search's start: 0.9
    tried.clear()
    sketch = lambda p: 0.95  # noqa: E731 - its start recalls more than the postings search's: it answers
    assert tuner._widest(trials, [], [], found, widest) == [(found[0][1], 0.95)]
    tried.clear()
    # strokes at 2M under a writer: the truth took most of the time, the sketch searches the exploration
    # found missed on the whole sample and it found no postings search (each 0.1 s a query). The sketch
    # search's start answers with its recall; no postings search is started (its first pass took 13 s,
    # and with the sketch search's recall counted as 0 it answered: 0.78 at 0.1 s a query)
    assert tuner._widest(trials, [], [], found[:1], widest) == [(found[0][1], 0.95)]
    assert tried == [("sketch", 16, 500, 200)]


def _listed(view) -> np.ndarray:
    """Every mirror row some segment lists (with repeats, if any)."""
    lists = view.lists
    return np.concatenate([np.asarray(lists.lrows[g["e"]:g["e"] + g["n"]], dtype=np.int64) for g in view.segments])


def test_segments_absorb_rows_without_rewriting_and_merges_drop_retired_rows(tmp_path, fmnist):
    """New rows become a segment of their own (the segments before are not rewritten); small
    segments are merged four at a time, their rows keeping their lists and the retired ones
    dropped; a segment mostly retired is rebuilt alone; a new fit when the index has doubled, the
    old one put aside until upkeep deletes it."""
    X, _, _, _ = fmnist
    T = segments.TAIL_ROWS
    with Index.open(tmp_path / "g", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 5000), X[:5000])
        assert ix.maintain()["fit"][0]["fit"] == 1
        view = ix.view()
        base = view.segments[0]
        assert view.fit.lists == 5000 // segments.LIST_ROWS and (base["lo"], base["hi"]) == (0, 5000)
        ix.delete(_ids(0, 100))
        ix.upsert(_ids(5000, 5000 + T), X[5000:5000 + T])
        assert ix.view().rows - ix.view().tail_start == T
        top = ix.query(X[5010], k=1).neighbors[0]  # in the tail: found by its scan
        assert top.id == "v5010" and top.similarity == pytest.approx(1.0)
        assert len(ix.maintain()["absorb"]) == 1
        view = ix.view()
        assert view.segments[0] == base and len(view.segments) == 2 and view.tail_start == view.rows
        assert ix.query(X[5010], k=1).neighbors[0].id == "v5010"  # now through the lists
        for n in (1, 2):
            ix.upsert(_ids(5000 + n * T, 5000 + (n + 1) * T), X[5000 + n * T:5000 + (n + 1) * T])
            ix.maintain()
        view = ix.view()
        lists_of = {}  # the list each row of the three small segments was put in
        for g in view.segments[1:]:
            starts = np.asarray(view.lists.lstarts[g["ls"]:g["ls"] + view.fit.lists + 1])
            for c in range(view.fit.lists):
                lists_of.update(dict.fromkeys(np.asarray(view.lists.lrows[starts[c]:starts[c + 1]]).tolist(), c))
        assert len(view.segments) == 4 and len(lists_of) == 3 * T
        ix.delete(_ids(5000, 5000 + T // 2))  # half of the first small segment
        ix.upsert(_ids(5000 + 3 * T, 5000 + 4 * T), X[5000 + 3 * T:5000 + 4 * T])
        done = ix.maintain()  # a fourth small segment: four of one tier, merged
        view = ix.view()
        assert done["merge"][0]["merged"] == 4 and len(view.segments) == 2 and view.segments[0] == base
        merged = view.segments[1]
        assert (merged["lo"], merged["hi"]) == (5000, 5000 + 4 * T) and merged["n"] == 4 * T - T // 2
        starts = np.asarray(view.lists.lstarts[merged["ls"]:merged["ls"] + view.fit.lists + 1])
        for c in range(view.fit.lists):
            rows = np.asarray(view.lists.lrows[starts[c]:starts[c + 1]]).tolist()
            assert all(lists_of[r] == c for r in rows if r in lists_of)
        ix.delete(_ids(100, 2000))  # most of the base segment
        done = ix.maintain()
        view = ix.view()
        assert done["merge"][0]["merged"] == 1 and view.segments[0]["n"] == 3000
        assert set(_listed(view).tolist()) == set(np.flatnonzero(view.alive).tolist())  # each live row, once
        assert ix.check().ok
        n = view.rows
        ix.upsert(_ids(9200, 9200 + n), X[9200:9200 + n])  # the index doubles: a new fit
        done = ix.maintain()
        view = ix.view()
        assert done["fit"][0]["fit"] == 2 and view.fit.lists == view.live // segments.LIST_ROWS
        assert len(view.segments) == 1 and sorted(_listed(view).tolist()) == np.flatnonzero(view.alive).tolist()
        assert not (ix.mirror.dir / segments.fit_name(1)).exists()
        retired = ix.mirror.dir / (segments.RETIRED + segments.fit_name(1))
        assert retired.is_dir()  # put aside: a process dropping its last map of it would free its pages
        segments.delete_retired(ix.mirror.dir)
        assert retired.is_dir()
        segments.delete_retired(ix.mirror.dir, after=0)
        assert not retired.exists()
        assert ix.check().ok


def test_the_mirror_is_derived_data(location, fmnist):
    """Deleted, it is rebuilt from the store with the same answers; a mirror made for another
    index at the same place is discarded; two processes share one mirror."""
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784, samples=128)) as ix:
        ix.upsert(_ids(0, 2000), X[:2000])
        before = _answers(ix, Q[:10], mode="exact")
        mirror_dir = ix.mirror.dir
        size = ix.mirror.disk_bytes()
    out = _in_another_process(location, "print(json.dumps([str(ix.mirror.dir), ix.query(X[1], k=1).neighbors[0].id]))")
    other_dir, top = json.loads(out.strip().splitlines()[-1])
    assert other_dir == str(mirror_dir) and top == "v1"
    shutil.rmtree(mirror_dir)
    with _open(location, maintain=False) as ix:
        assert _answers(ix, Q[:10], mode="exact") == before
        assert ix.mirror.disk_bytes() <= size * 1.1


def test_a_fit_replaced_while_another_process_loads_it(tmp_path, fmnist):
    """A worker reads the state, another publishes a new fit and removes the one the state
    named, then the worker opens it: it reads the state again and gets the new one (the soak
    test's two workers once answered 500 here)."""
    X = fmnist[0]
    with Index.open(tmp_path / "r", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 4000), X[:4000])
        ix.maintain()
        writer = ix.mirror

        class Raced(Mirror):
            """A mirror whose state is overtaken, once, right after it has been read."""

            raced = False

            def _read_state(self):
                state = super()._read_state()
                if state.get("lists") and not Raced.raced:
                    Raced.raced = True
                    ix.upkeep._refit(writer.sync(ix.store))  # the same profiles, fresh arenas
                return state

        reader = Raced(writer.dir, ix.config)
        assert Raced.raced and reader.view.fit.number == 2 == writer.view.fit.number
        assert not (writer.dir / segments.fit_name(1)).exists()


def test_exact_in_batches_equals_exact_one_at_a_time(tmp_path, fmnist, monkeypatch):
    """The tuner's truth comes from batched exact search: rows scored in blocks against all
    queries, or query by query through postings, whichever is faster on the data. Both give
    run_exact's best similarities, and its count, with each stored query's own row left out;
    several blocks, the last one short, the later ones leaving out the rows their bound rules
    out (dense rows, signed too)."""
    from gmmlsh.index import search
    from gmmlsh.index.search import prepare_row, prepare_vectors, run_exact, run_exact_many

    X, _, Q, _ = fmnist
    rng = np.random.default_rng(3)
    S = sp.random(3000, 20_000, density=0.003, random_state=4, format="csr", dtype=np.float32)
    S.data = np.round(S.data * 9 + 1)
    S = S[np.diff(S.indptr) > 0]
    mean = X[:3000].mean(axis=0)
    for name, data, queries, dim in (("dense", X[:3000], Q[:5], 784), ("signed", X[:3000] - mean, Q[:5] - mean, 784),
                                     ("sparse", S, S[:5], 20_000)):
        with Index.open(tmp_path / name, IndexConfig(dim=dim, samples=64), maintain=False) as ix:
            ix.upsert([str(i) for i in range(data.shape[0])], data)
            ix.delete(["7", "8"])
            ix.maintain()
            view = ix.view()
            qs = [prepare_row(view, int(r), ix.config) for r in rng.choice(view.rows, 6, replace=False)]
            qs += prepare_vectors(queries.astype(np.float32), ix.config, sketch=False)
            monkeypatch.setattr(search, "_EXACT_BLOCK_BYTES", 8 * len(qs) * 1100)  # blocks of 1,100 rows
            monkeypatch.setattr(search, "_FIRST_STEP", 300)
            for k in (1, 10):
                for many in (run_exact_many, search._exact_block):  # the chosen path, and the blocks
                    for q, (rows, sims, scored) in zip(qs, many(view, qs, k), strict=True):
                        _, want, want_scored = run_exact(view, q, k)
                        assert scored == want_scored and q.exclude not in rows.tolist()
                        assert np.array_equal(np.sort(sims)[::-1][:k], np.sort(want)[::-1][:k])
                        assert view.alive[rows].all() and len(rows) >= min(k, want_scored)


def test_a_mirror_ahead_of_its_store_is_rebuilt(tmp_path, fmnist):
    """A restored backup is behind the mirror left in its directory: the mirror starts over."""
    X, _, _, _ = fmnist
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        ix.upsert(_ids(0, 100), X[:100])
        ix.query(X[0])
        ix.snapshot(tmp_path / "snap")
        ix.upsert(_ids(100, 200), X[100:200])
        ix.query(X[0])
    shutil.copytree(tmp_path / "i" / "mirror", tmp_path / "snap" / "mirror")
    with Index.open(tmp_path / "snap", maintain=False) as ix:
        assert ix.query(X[150], k=1).neighbors[0].id != "v150"
        assert ix.view().rows == 100 and ix.check().ok


@pytest.fixture
def small_disk(tmp_path, tmpfs):
    """A 24 MiB filesystem (tmpfs); needs the right to mount, else the test says why it skips."""
    return tmpfs(tmp_path / "small", "24m")


def test_a_full_disk_is_a_clear_error_loses_nothing_and_writes_resume(small_disk):
    """Writes to an index on a full disk fail with DiskFull (not a crash: the mirror's files
    reserve their space before mapping it); what was acknowledged stays; after space is freed,
    writes and queries go on."""
    from gmmlsh.index.store.base import DiskFull

    X = np.random.default_rng(0).random((200, 784)).astype(np.float32)
    ballast = small_disk / "ballast"
    with Index.open(small_disk / "idx", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        acknowledged = 0
        with pytest.raises(DiskFull, match="no space left"):
            for b in range(100):
                ix.upsert([f"{b}-{i}" for i in range(200)], X)
                acknowledged = ix.count()
                ix.view()
                ballast.write_bytes(b"\0" * (256 << 10) * (b + 1))  # the disk fills from outside too
        assert ix.count() >= acknowledged > 0
        assert "no space left" in ix.write_problem()  # what /health reports meanwhile
        ballast.unlink()
        assert ix.write_problem() is None
        ix.upsert(["after"], X[:1] + 1)
        assert ix.query(X[0] + 1, k=1).neighbors[0].id == "after"
        assert ix.check().ok


@pytest.mark.parametrize("dim", [784, 5000])
def test_a_sparse_query_is_prepared_as_its_dense_form(dim):
    """A sparse query row is prepared dense where the index's hashing table fits (784: one
    compiled call) and as a CSR row where it does not (5,000 × 512 samples): either way the
    same planes, first-stage row, values and norm as the vector sent dense."""
    from gmmlsh.core.gcws import table_fits
    from gmmlsh.index.records import query_rows
    from gmmlsh.index.search import prepare_vectors

    config = IndexConfig(dim=dim)
    assert table_fits(dim, config.samples) == (dim == 784)
    rng = np.random.default_rng(dim)
    x = np.zeros(dim, np.float32)
    nz = np.sort(rng.choice(dim, 140, replace=False))
    x[nz] = rng.integers(1, 255, nz.shape[0]) * rng.choice([-1, 1], nz.shape[0])
    sparse = query_rows((nz, x[nz]), dim)
    assert not isinstance(sparse, np.ndarray)  # a SparseRow, as the API makes of (indices, values)
    (got,), (want,) = prepare_vectors(sparse, config), prepare_vectors(query_rows(x, dim), config)
    for field in ("planes", "first", "dense"):
        np.testing.assert_array_equal(getattr(got.q, field), getattr(want.q, field))
    assert got.q.norm == want.q.norm
    assert (got.nonzero is None) == (dim == 784)  # prepared dense where the table fits
