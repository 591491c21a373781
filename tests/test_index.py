"""Index acceptance tests (issue 3), run against both backends: a real LMDB on disk and a real redis-server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import numba
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import FMNIST as FMNIST_PATH
from gmmlsh.core import gcws, nrff
from gmmlsh.core.gmm import gmm, gmm_matrix
from gmmlsh.core.validate import DimensionError, NonFiniteError, ZeroVectorError
from gmmlsh.index.answer_cache import AnswerCache
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.index.planner import candidate_probability
from gmmlsh.index.store.base import ConfigConflict
from redis_fixtures import redis_url  # noqa: F401


@pytest.fixture(params=["lmdb", "redis"])
def location(request, tmp_path):
    """Where a fresh index lives: an LMDB directory, or a fresh prefix on a real Redis (whose
    buckets spill into their own keys past 16 iids, so that both bucket forms get used)."""
    if request.param == "lmdb":
        return str(tmp_path / "idx"), {}
    url = request.getfixturevalue("redis_url")
    return url, {"prefix": f"t{uuid.uuid4().hex[:12]}", "spill_bytes": 64}


def _open(location, config=None, **kw):
    loc, opts = location
    return Index.open(loc, config, **opts, **kw)


def _ids(a, b):
    return [f"v{i}" for i in range(a, b)]


def _in_another_process(location, code: str) -> None:
    """Run ``code`` in a fresh Python process with ``ix`` open on the same index (and ``X``,
    the Fashion-MNIST train vectors): another process's writes, not this one's."""
    loc, opts = location
    script = textwrap.dedent(f"""
        import numpy as np
        from gmmlsh.index.index import Index
        X = np.load({str(FMNIST_PATH)!r})["train"]
        with Index.open({loc!r}, **{opts!r}) as ix:
    """) + textwrap.indent(textwrap.dedent(code), "    ")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _answers(ix, Q, mode="lsh"):
    return [[(n.id, round(n.similarity, 12)) for n in ix.query(q, k=10, mode=mode).neighbors] for q in Q]


def test_reopen_in_new_process_gives_same_answers(location, fmnist, tmp_path):
    X, _, Q, _ = fmnist
    cfg = IndexConfig(dim=784)
    with _open(location, cfg) as ix:
        ix.upsert(_ids(0, 10_000), X[:10_000])
        assert ix.count() == 10_000
        before = _answers(ix, Q[:20])
    loc, opts = location
    script = textwrap.dedent(f"""
        import json, numpy as np
        from gmmlsh.index.index import Index
        Q = np.load({str(tmp_path / "q.npy")!r})
        with Index.open({loc!r}, **{opts!r}) as ix:
            out = [[(n.id, round(n.similarity, 12)) for n in ix.query(q, k=10).neighbors] for q in Q]
            print(json.dumps([ix.count(), out]))
    """)
    np.save(tmp_path / "q.npy", Q[:20])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    import json

    count, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert count == 10_000
    assert [[tuple(p) for p in row] for row in after] == before


def test_upsert_replaces_and_delete_removes_everywhere(location, fmnist):
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784, bands=16, rows=4)) as ix:
        ix.upsert(_ids(0, 500), X[:500], [{"n": i} for i in range(500)])
        old_keys = [bytes(k) for k in ix.banding.keys_from_codes(ix._codes(X[7:8].astype(float)))[0]]
        # v7 now holds another image: its old buckets must not list it any more.
        ix.upsert(["v7"], X[900:901], [{"n": "new"}])
        assert ix.count() == 500
        got = ix.get("v7")
        np.testing.assert_array_equal(got.values, X[900].astype(np.float32))
        assert got.metadata == {"n": "new"}
        iid = int(ix.store.lookup(["v7"])[0])
        new_keys = {bytes(k) for k in ix.banding.keys_from_codes(ix._codes(X[900:901].astype(float)))[0]}
        for key in old_keys:
            members = ix.store.bucket_members([key])
            assert (iid in members.tolist()) == (key in new_keys)
        # The replaced vector is found as itself, with similarity 1.
        top = ix.query(X[900], k=1).neighbors[0]
        assert top.id == "v7" and top.similarity == pytest.approx(1.0)
        # Delete: gone from lookups, queries (every mode) and buckets.
        assert ix.delete(["v7", "v8", "nope"]) == 2
        assert ix.count() == 498
        assert not ix.contains("v7")
        with pytest.raises(UnknownIdError):
            ix.get("v8")
        for mode in ("lsh", "exact"):
            for q in (X[900], X[8]):
                assert {n.id for n in ix.query(q, k=50, mode=mode).neighbors}.isdisjoint({"v7", "v8"})
        all_members = np.concatenate([m for _, m in ix.store.scan_buckets()])
        assert iid not in set(all_members.tolist())
        assert ix.count() == sum(len(i) for i, _ in ix.store.scan("vector"))


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
            for mode in ("lsh", "exact"):
                for n in ix.query(Q[qi], k=10, mode=mode).neighbors:
                    assert n.similarity == pytest.approx(gmm(Q[qi].astype(np.float64), base[int(n.id[1:])]), abs=1e-12)
            # nrff: the neighbours are the best by estimated RBF among the scanned features,
            # reported with their exact RBF.
            res = ix.query(Q[qi], k=10, mode="nrff", candidates=10)
            f = nrff.features(Q[qi].astype(np.float64), 128, 1.0).astype(np.float32)
            est_top = set(np.argsort(-(F @ f))[:10].tolist())
            assert {int(n.id[1:]) for n in res.neighbors} == est_top
            q = Q[qi].astype(np.float64)
            for n in res.neighbors:
                x = base[int(n.id[1:])].astype(np.float64)
                rho = q @ x / np.linalg.norm(q) / np.linalg.norm(x)
                assert n.similarity == pytest.approx(np.exp(-(1 - rho)), abs=1e-6)


@pytest.mark.slow
def test_recall_at_10_default_parameters(fmnist, tmp_path):
    """Recall@10 of lsh vs exact ≥ 0.95: 1,000 test queries over the 60,000 train vectors."""
    X, _, Q, _ = fmnist
    Qs = Q[:1000]
    with Index.open(tmp_path / "full", IndexConfig(dim=784)) as ix:
        for lo in range(0, 60_000, 10_000):
            ix.upsert([str(i) for i in range(lo, lo + 10_000)], X[lo : lo + 10_000])
        S = np.vstack(
            [gmm_matrix(Qs[i : i + 100].astype(np.float64), X.astype(np.float32)) for i in range(0, 1000, 100)]
        )
        truth = np.argsort(-S, axis=1)[:, :10]
        hit = 0
        for qi in range(1000):
            got = {int(n.id) for n in ix.query(Qs[qi], k=10).neighbors}
            hit += len(got & set(truth[qi].tolist()))
        recall = hit / 10_000
        print(f"recall@10 = {recall:.4f}")
        assert recall >= 0.95


def test_s_curve_matches_planner(fmnist, tmp_path):
    """The share of pairs that become candidates, binned by GMM, follows 1 − (1 − p^r)^L.

    The prediction is an expectation over hash draws, while every pair in one index
    shares the same L·r hash functions (and on Fashion-MNIST i* concentrates on a few
    central pixels, so pairs are strongly correlated within a draw). So the observed
    share is pooled over four independent seeds at the default layout.
    """
    X, _, Q, _ = fmnist
    base = X[:4000]
    S = gmm_matrix(Q[:60].astype(np.float64), base.astype(np.float32))
    cand = np.zeros((4,) + S.shape, dtype=bool)
    for seed in range(4):
        cfg = IndexConfig(dim=784, seed=seed)
        with Index.open(tmp_path / f"s{seed}", cfg) as ix:
            ix.upsert([str(i) for i in range(4000)], base)
            for qi in range(60):
                iids, _ = ix.candidates(ix._codes(Q[qi : qi + 1].astype(np.float64)))
                cand[seed, qi, [int(n) for n in ix.store.external_ids(iids)]] = True
    edges = np.linspace(0.25, 0.75, 11)
    checked = 0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = (S >= lo) & (S < hi)
        if sel.sum() < 200:
            continue
        predicted = candidate_probability(S[sel], cfg.bands, cfg.rows, cfg.bits).mean()
        observed = cand[:, sel].mean()
        assert abs(observed - predicted) <= 0.05, (lo, hi, observed, predicted)
        checked += 1
    assert checked >= 6


def test_sparse_high_dimensional_and_signed(location):
    rng = np.random.default_rng(5)
    dim, n = 55_197, 400
    rows = []
    for _ in range(n):
        idx = np.sort(rng.choice(dim, size=160, replace=False))
        rows.append((idx, rng.lognormal(size=160)))
    indptr = np.cumsum([0] + [len(r[0]) for r in rows])
    X = sp.csr_matrix(
        (np.concatenate([r[1] for r in rows]), np.concatenate([r[0] for r in rows]), indptr), shape=(n, dim)
    )
    with _open(location, IndexConfig(dim=dim, storage="sparse", bands=16, rows=4)) as ix:
        ix.upsert([f"s{i}" for i in range(n)], X)
        # A near copy of row 3 finds row 3 first, in every mode that applies.
        idx, val = rows[3]
        res = ix.query((idx, val * 1.01), k=5)
        assert res.neighbors[0].id == "s3" and res.neighbors[0].similarity == pytest.approx(1 / 1.01, rel=1e-6)
        assert ix.query(id="s3", k=5, mode="exact").neighbors[0].id != "s3"
        got = ix.get("s3")
        np.testing.assert_array_equal(got.indices, idx)
        np.testing.assert_allclose(got.values, val.astype(np.float32))
    signed = np.random.default_rng(6).normal(size=(300, 40))
    with _open(
        (location[0] + "-signed", {})
        if not location[0].startswith("redis")
        else (location[0], {"prefix": location[1]["prefix"] + "s"}),
        IndexConfig(dim=40, bands=16, rows=2),
    ) as ix:
        ix.upsert([str(i) for i in range(300)], signed)
        # Differs from row 0 only in its negative coordinates: GMM < 1 and it must not be treated as equal.
        q = signed[0].copy()
        q[q < 0] *= 3
        res = ix.query(q, k=300, mode="exact")
        sims = {n.id: n.similarity for n in res.neighbors}
        # Queries are compared at storage precision (float32), like stored vectors.
        f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
        assert sims["0"] == pytest.approx(gmm(f32(q), f32(signed[0])), abs=1e-12)
        assert sims["0"] < 0.9
        assert ix.query(signed[0], k=1).neighbors[0].id == "0"


def test_scan_sees_vectors_written_by_another_process(location, fmnist):
    """A warmed-up reader's sketch scan picks up vectors another process inserts later."""
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784, bands=8, rows=4)) as ix:
        ix.upsert(_ids(0, 300), X[:300])
        ix.warm()
        assert ix.query(X[400], k=1).neighbors[0].id != "v400"
        _in_another_process(location, """
            for i in range(300, 460):  # one at a time: every Redis shard gets its turn
                ix.upsert([f"v{i}"], X[i : i + 1])
        """)
        for i in range(300, 460, 7):
            top = ix.query(X[i], k=1).neighbors[0]
            assert top.id == f"v{i}" and top.similarity == pytest.approx(1.0)


def test_a_warm_redis_query_is_one_round_trip(redis_url, fmnist):  # noqa: F811
    """In steady state the answer's own read confirms that the sketch cache was current
    (Index._result), so a query is one pipelined round trip; after another writer's
    insert the confirmation fails, and the query refreshes and answers again."""
    X, _, Q, _ = fmnist
    opts = {"prefix": f"t{uuid.uuid4().hex[:12]}"}
    with Index.open(redis_url, IndexConfig(dim=784, bands=8, rows=4), **opts) as ix, \
            Index.open(redis_url, **opts) as writer:
        ix.upsert(_ids(0, 500), X[:500])
        ix.warm()
        ix.query(Q[0])
        trips = []
        real = ix.store._pipeline
        ix.store._pipeline = lambda commands: trips.append(len(commands)) or real(commands)
        for q in Q[:20]:
            ix.query(q, k=5)
        assert len(trips) == 20
        writer.upsert(["new"], X[600:601])
        trips.clear()
        top = ix.query(X[600], k=1).neighbors[0]
        assert top.id == "new" and top.similarity == pytest.approx(1.0)
        assert len(trips) >= 3  # the failed confirmation, the refresh, the answer
        trips.clear()
        ix.query(X[600], k=1)
        assert len(trips) == 1


def test_warm_loads_names_so_first_queries_read_no_records(location, fmnist):
    """warm() also loads the names and metadata of the vectors it holds: a fresh reader's
    first answers then come from its name cache after one counter read, and equal the
    answers read record by record."""
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784, bands=8, rows=4)) as ix:
        ix.upsert(_ids(0, 600), X[:600], metadata=[{"i": i} for i in range(600)])
        ix.delete(_ids(0, 600)[::50])
        ix.warm(names=False)
        expected = [(r.neighbors, r.candidates) for r in (ix.query(q, k=5) for q in Q[:20])]
        ix._answers = AnswerCache()  # as a fresh reader's
        ix.warm()
        reads = []
        for name in ("ids_fetch_and_news", "ids_and_fetch", "external_ids", "fetch"):
            real = getattr(ix.store, name)
            setattr(ix.store, name, lambda *a, _real=real, _name=name: reads.append(_name) or _real(*a))
        got = [(r.neighbors, r.candidates) for r in (ix.query(q, k=5) for q in Q[:20])]
        assert got == expected and reads == []
        assert all(nb.metadata == {"i": int(nb.id[1:])} for ns, _ in got for nb in ns)


def test_cached_answer_names_die_with_their_vectors(location, fmnist):
    """A reader answers from its cache of names while the store's epoch stands still; a
    delete or replacement by another process moves the epoch, so the reader never answers
    with a dead name or a replaced version's metadata (Index._result)."""
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784, bands=8, rows=4)) as reader:
        reader.upsert(_ids(0, 800), X[:800], metadata=[{"v": 1}] * 800)
        reader.warm()
        q = X[5]
        first = reader.query(q, k=5)
        reads = []
        real = reader.store.ids_fetch_and_news
        reader.store.ids_fetch_and_news = lambda *a: reads.append(1) or real(*a)
        assert reader.query(q, k=5) == first and not reads  # answered from the cache
        top, second = first.neighbors[0].id, first.neighbors[1].id
        assert top == "v5"
        _in_another_process(location, f"ix.delete([{top!r}])")
        after_delete = reader.query(q, k=5)
        assert top not in [n.id for n in after_delete.neighbors] and reads
        assert after_delete.neighbors[0].id == second
        j = int(second[1:])
        _in_another_process(location, f"ix.upsert([{second!r}], X[{j}:{j + 1}], metadata=[{{'v': 2}}])")
        replaced = reader.query(q, k=5)
        assert replaced.neighbors[0].id == second and replaced.neighbors[0].metadata == {"v": 2}
        assert [n.id for n in replaced.neighbors].count(second) == 1
        assert reader.query(q, k=5) == replaced


@pytest.mark.parametrize("threads", [1, 2])
def test_query_batch_answers_as_single_queries(location, fmnist, threads):
    """The batched kernel (parallel over queries or serial) and the batch's one answer read
    give exactly the single queries' answers, also with retired versions still cached."""
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784, bands=8, rows=4)) as ix:
        ix.upsert(_ids(0, 1500), X[:1500], metadata=[{"i": i} for i in range(1500)])
        ix.warm()
        deleted = set(_ids(0, 1500)[::7])
        ix.delete(sorted(deleted))
        replaced = _ids(1, 1500)[::9]
        ix.upsert(replaced, X[1500:1500 + len(replaced)])
        current = {f"v{i}": X[i] for i in range(1500)} | {r: X[1500 + j] for j, r in enumerate(replaced)}
        deleted -= set(replaced)  # deleted, then inserted again
        batches = []
        real = ix._lsh_fused_batch
        ix._lsh_fused_batch = lambda *a: batches.append(1) or real(*a)
        numba.set_num_threads(threads)
        try:
            first = ix.query_batch(Q[:40], k=7, min_similarity=0.3)  # meets the retired versions
            single = [ix.query(q, k=7, min_similarity=0.3) for q in Q[:40]]
            again = ix.query_batch(Q[:40], k=7, min_similarity=0.3)  # names cached now
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert batches and again == single
        gone = {r.neighbors[0].id for r in single[:5]}
        ix.delete(sorted(gone))  # names the batch path has cached die
        assert not gone & {n.id for r in ix.query_batch(Q[:40], k=7, min_similarity=0.3) for n in r.neighbors}
        # the first batch met retired versions (a scan may rank them; they are skipped and
        # forgotten), so its candidates differ, but it names live, current versions only
        for q, r in zip(Q[:40], first, strict=True):
            assert r.neighbors and not deleted & {n.id for n in r.neighbors}
            for n in r.neighbors:
                assert n.similarity == pytest.approx(gmm(q, current[n.id]), abs=1e-9)
        assert all(n.metadata is None or n.metadata["i"] == int(n.id[1:]) for r in single for n in r.neighbors)


def test_bad_input_changes_nothing(location):
    with _open(location, IndexConfig(dim=8, bands=4, rows=2)) as ix:
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
        for kw in ({"k": 0}, {"mode": "fast"}, {"candidates": 0}):
            with pytest.raises(ValueError):
                ix.query(np.ones(8), **kw)
    with pytest.raises(ConfigConflict):
        _open(location, IndexConfig(dim=8, bands=5, rows=2))


def test_sketches_are_stored_as_rehash(location, fmnist):
    X, _, _, _ = fmnist
    with _open(location, IndexConfig(dim=784, bands=8, rows=4)) as ix:
        ix.upsert(_ids(0, 200), X[:200])
        iids = ix.store.lookup(_ids(0, 200))
        stored = np.frombuffer(b"".join(ix.store.fetch(iids, "sketch")), np.uint8).reshape(200, -1)
        want = gcws.pack_codes(gcws.bbit_codes(gcws.sketch(X[:200].astype(np.float32), 32), 8), 8)
        np.testing.assert_array_equal(stored, want)


def test_fused_query_answers_exactly_as_the_step_by_step_path(location, fmnist, monkeypatch):
    """The default query runs as one compiled call (core.query_kernel); with it switched off the
    step-by-step path must give the same neighbours, similarities and candidate counts — cold
    (vectors fetched on demand), warm, by vector and by id, with deletes in between."""
    X, _, Q, _ = fmnist
    with _open(location, IndexConfig(dim=784)) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        ix.delete(_ids(0, 3000)[::97])

        def answers():
            out = [ix.query(q, k=10, candidates=60) for q in Q[:40]]
            out += [ix.query(id=f"v{i}", k=10) for i in range(1, 3000, 150)]
            return [(r.candidates, [(n.id, n.similarity) for n in r.neighbors]) for r in out]

        cold = answers()  # first touch: chosen rows are not cached yet
        ix.warm()
        warm = answers()
        calls = []
        real = Index._lsh_fused
        monkeypatch.setattr(Index, "_lsh_fused", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
        assert answers() == warm and len(calls) == 60, "the fused path answers the default query"
        monkeypatch.setattr(Index, "_fused_applies", lambda self, qh: False)
        assert answers() == warm == cold
