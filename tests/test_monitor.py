"""The online recall monitor (:mod:`gmmlsh.index.monitor`), in process, on a real LMDB index.

Fashion-MNIST, 10,000 rows; the search is *mistuned* by publishing a tuning that probes one
list (recall@10 ≈ 0.83 on these rows), as a stale or unlucky tuning would leave it. With every
served query checked (``fixed_share`` 1) the monitor's sample is the whole traffic, so its
estimate must equal the true recall of what was served, computed here against exact search.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from gmmlsh.index import monitor, tuner
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index

ROWS = 10_000
SERVED = 64


@pytest.fixture(scope="module")
def data(fmnist):
    train, _, test, _ = fmnist
    return train[:ROWS].astype(np.float32), test[:SERVED].astype(np.float32)


def _open(path, search=None) -> Index:
    return Index.open(path, IndexConfig(dim=784), maintain=False, search=search)


@pytest.fixture(scope="module")
def built(tmp_path_factory, data):
    X, _ = data
    path = tmp_path_factory.mktemp("monitor") / "idx"
    with _open(path) as ix:
        ix.upsert([str(i) for i in range(ROWS)], X)
        ix.maintain()
    return path


def _until(done, seconds: float = 10.0) -> None:
    """Wait for ``done()``: a query hands its records to the flusher's thread and returns."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "not handed over"
        time.sleep(0.01)


def _mistune(ix: Index) -> None:
    """Publish a tuning that probes one list, as if the tuner had chosen it."""
    bad = ix.view().search.with_overrides(probes=1)
    ix.mirror.publish(lambda state: state.update(search=bad.to_dict()))


def _true_recalls(ix: Index, Q, answers) -> np.ndarray:
    exact = [ix.query(q, k=10, mode="exact") for q in Q]
    return np.array([monitor.served_recall(np.array([n.similarity for n in a.neighbors]),
                                           np.array([n.similarity for n in e.neighbors]))
                     for a, e in zip(answers, exact, strict=True)])


def test_served_recall_counts_ties_and_short_answers():
    exact = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.4, 0.3, 0.2, 0.2])
    assert monitor.served_recall(exact[:10], exact) == 1.0
    tied = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.4, 0.3, 0.2])  # the other 0.2: a tie, a hit
    assert monitor.served_recall(tied, exact) == 1.0
    missed = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.4, 0.3, 0.1])
    assert monitor.served_recall(missed, exact) == 0.9
    assert monitor.served_recall(np.array([0.9, -1.0]), np.array([0.9, 0.1])) == 0.5  # 2 rows; 1 found


def test_the_share_is_derived_from_the_first_query(built, data):
    """A tuning measures the exact search: the share a budget allows is known before the worker
    has re-run any query (not the budget itself, ~10x too many on these rows)."""
    _, Q = data
    assert monitor.read_state(built)["checked"] == 0  # no exact re-run timed yet
    with _open(built) as ix:
        exact = ix.recorder.exact_seconds
        assert exact > 0
        answer = ix.query(Q[0], k=10)
        assert answer.mode == "sketch"
        share = ix.recorder.share
        assert share == pytest.approx(monitor.BUDGET * ix.recorder.served_seconds / exact)
        assert 0 < share < monitor.BUDGET / 2


def test_without_a_measured_cost_one_query_is_recorded_to_measure_it(built, data, tmp_path):
    """The monitor's state lost (no exact cost known, no tuning since): the first served query is
    recorded alone and handed over at once; the worker's re-run gives the cost the share needs."""
    import shutil

    _, Q = data
    path = tmp_path / "copy"
    shutil.copytree(built, path)
    for state in path.rglob("monitor.json"):
        state.unlink()
    with _open(path) as ix:
        assert ix.recorder.exact_seconds == 0
        answers = [ix.query(q, k=10) for q in Q[:3]]
        assert {a.mode for a in answers} == {"sketch"} and ix.recorder.share == 0
        _until(lambda: monitor.pending(ix.mirror.dir) and ix.recorder.held == 0)  # one record, handed over
        done = ix.maintain()
        assert done["monitor"] == [{"checked": 1}]
        state = monitor.read_state(ix.mirror.dir)
        assert state["exact_measured"] and state["exact_seconds"] > 0
        ix.query(Q[3], k=10)
        assert ix.recorder.held == 0  # one probe a process: no second record at share 0


def test_a_mistuned_search_is_measured_and_retuned(built, data):
    _, Q = data
    with _open(built) as ix:
        _mistune(ix)
        ix.recorder.fixed_share = 1.0
        answers = [ix.query(q, k=10) for q in Q]
        assert {a.mode for a in answers} == {"sketch"}
        truth = _true_recalls(ix, Q, answers)
        assert truth.mean() < tuner.TARGET_RECALL - 0.05  # the mistuning shows
        done = ix.maintain()  # the monitor's checks, then the re-tune they ask for
        assert done["monitor"] == [{"checked": SERVED}] and "tune" in done
        rec = ix.stats()["recall"]
        assert rec["checked"] == 0  # a new epoch: the new tuning's
        assert rec["previous"]["checked"] == SERVED
        assert rec["previous"]["estimate"] == pytest.approx(truth.mean(), abs=5e-5)  # shown to 4 places
        assert rec["previous"]["lower"] <= truth.mean() <= rec["previous"]["upper"]
        assert len(rec["retunes"]) == 1 and rec["retunes"][0]["checked"] in monitor.CHECKS
        assert ix.view().search.probes != 1
        again = [ix.query(q, k=10) for q in Q]
        assert _true_recalls(ix, Q, again).mean() >= tuner.TARGET_RECALL


def test_an_overridden_search_is_reported_not_retuned(built, data):
    _, Q = data
    with _open(built) as ix:
        ix.maintain()
    with _open(built, search={"probes": 1}) as ix:
        ix.recorder.fixed_share = 1.0
        tuned = ix.view().search
        answers = [ix.query(q, k=10) for q in Q]
        truth = _true_recalls(ix, Q, answers)
        done = ix.maintain()
        assert done["monitor"] == [{"checked": SERVED}] and "tune" not in done
        assert ix.view().search == tuned
        rec = ix.stats()["recall"]
        assert rec["checked"] == SERVED and rec["estimate"] == pytest.approx(truth.mean(), abs=5e-5)
        assert rec["upper"] < tuner.TARGET_RECALL and "overridden" in rec["note"]
        assert "retune_requested" not in rec


def test_records_beyond_the_budget_are_dropped_at_random(built, data):
    _, Q = data
    with _open(built) as ix:
        ix.recorder.fixed_share = 1.0
        for q in Q:
            ix.query(q, k=10)
        ix.flush_recorded()
        checker = monitor.Checker(ix.mirror, ix.config, budget=0.0, seed=1)
        checker.run()  # no budget but the burst: what the burst pays for
        state = monitor.read_state(ix.mirror.dir)
        assert state["dropped"] + state["checked"] == SERVED and state["exact_seconds"] > 0
        assert not monitor.pending(ix.mirror.dir)


def test_a_bad_budget_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="monitor_budget"):
        Index.open(tmp_path / "idx", IndexConfig(dim=4), monitor_budget=2.0)
    with pytest.raises(ValueError, match="monitor_share"):
        Index.open(tmp_path / "idx", IndexConfig(dim=4), monitor_share=-0.1)


def test_the_shared_sample_of_served_queries_merges_uniformly_and_keeps_rows_exact(tmp_path):
    """Two processes' reservoirs merged into the shared sample: at most SIZE rows, the counts
    add up, every row kept is one offered (dense and sparse alike, values exact), and each
    side's share follows what it saw (1,000 each: Binomial(256, 1/2), within 5 sd of 128; the
    merge draws from an unseeded generator, so a false failure has odds under one in a million)."""
    import scipy.sparse as sp

    from gmmlsh.index import served

    rng = np.random.default_rng(3)
    dense = rng.random((1000, 20), dtype=np.float32)
    sparse = sp.random(1000, 20, density=0.2, format="csr", dtype=np.float32, random_state=4)
    shared = served.SharedSample(tmp_path, 20)
    a, b = served.QuerySample(seed=1), served.QuerySample(seed=2)
    a.add(dense)
    for i in range(sparse.shape[0]):
        b.add(sparse[i])
    shared.add(a, lambda name: contextlib.nullcontext())
    shared.add(b, lambda name: contextlib.nullcontext())
    seen, rows = shared.load()
    assert seen == 2000 and len(rows) == served.SIZE == shared.count()
    offered = {r.tobytes() for r in dense} | {sparse[i].toarray().tobytes() for i in range(sparse.shape[0])}
    kept = [r.toarray().astype(np.float32).tobytes() for r in rows]
    assert all(k in offered for k in kept)
    from_dense = sum(k in {r.tobytes() for r in dense} for k in kept)
    assert abs(from_dense - 128) <= 5 * 8


def test_served_queries_are_saved_off_the_query_thread(built, data, monkeypatch):
    """The query that makes the served sample due hands its merge and file writes to the
    flusher's thread and returns: with that merge held up, queries keep answering, no second
    merge starts beside it, and once it goes on the shared sample holds what was served."""
    import threading

    from gmmlsh.index import served

    _, Q = data
    release, started, calls = threading.Event(), threading.Event(), []
    real = served.SharedSample.add

    def held_up(self, sample, lock):
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(30)
        real(self, sample, lock)

    monkeypatch.setattr(served.SharedSample, "add", held_up)
    with _open(built) as ix:
        ix.shared.held = 0  # eager: due every FLUSH_QUERIES queries
        for q in Q[:served.FLUSH_QUERIES]:
            ix.query(q)
        assert started.wait(10)
        for q in Q[:served.FLUSH_QUERIES]:  # due again, the first merge still held up
            ix.query(q)
        assert calls == ["gmmlsh-flush_0"]
        release.set()
        ix._flusher.wait(10)
        assert ix.shared.count() >= served.FLUSH_QUERIES
