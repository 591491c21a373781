"""Upkeep beside the queries: a query never waits for it, and a kill in the middle of it loses
nothing (the index opens, answers and passes its check)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import FMNIST as FMNIST_PATH

from gmmlsh.core import parallel
from gmmlsh.index import segments, tuner
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index


def _ids(a, b):
    return [f"v{i}" for i in range(a, b)]


def _write_elsewhere_and_find_it(ix: Index, path, X) -> None:
    """Another process upserts training image 7000 as "written"; ``ix`` finds it at once."""
    code = textwrap.dedent(f"""
        import numpy as np
        from gmmlsh.index.index import Index
        X = np.load({str(FMNIST_PATH)!r})["train"]
        with Index.open({str(path)!r}, maintain=False) as ix:
            ix.upsert(["written"], X[7000:7001])
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    top = ix.query(X[7000], k=1, mode="exact").neighbors[0]
    assert top.id == "written" and top.similarity == pytest.approx(1.0)


@pytest.mark.parametrize("lane", ["fast", "slow"])
def test_a_query_after_a_write_never_waits_for_upkeep(tmp_path, fmnist, monkeypatch, lane):
    """Upkeep is held in the middle of a task — a segment being built (fast lane) or a tuning
    (slow lane) — while another process writes: queries answer meanwhile, and see the write."""
    X, _, Q, _ = fmnist
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 5000), X[:5000])
        ix.maintain()
        inside, release = threading.Event(), threading.Event()
        held = segments.build_segment if lane == "fast" else tuner.tune

        def slow(*args, **kwargs):
            inside.set()
            assert release.wait(120)
            return held(*args, **kwargs)

        monkeypatch.setattr(segments if lane == "fast" else tuner, held.__name__, slow)
        if lane == "fast":
            ix.upsert(_ids(5000, 5000 + segments.TAIL_ROWS), X[5000:5000 + segments.TAIL_ROWS])
            work = threading.Thread(target=ix.maintain)
        else:
            work = threading.Thread(target=ix.maintain, kwargs={"queries": Q[:tuner.MIN_QUERIES]})
        work.start()
        try:
            assert inside.wait(120)
            _write_elsewhere_and_find_it(ix, tmp_path / "i", X)
            assert ix.query(X[7000], k=1).neighbors[0].id == "written"  # the tuned search, the tail scanned
            assert work.is_alive() and not release.is_set()  # the upkeep is still held: nobody waited for it
        finally:
            release.set()
            work.join(300)
        assert ix.check().ok


_CHILD = """
import numpy as np, sys
from gmmlsh.index import segments, tuner
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index

X = np.load({fmnist!r})["train"]
phase = {phase!r}
held = getattr(segments, "build_segment") if phase == "segment" else getattr(tuner, "tune")

def marked(*args, **kwargs):
    print("inside", flush=True)
    return held(*args, **kwargs)

setattr(segments if phase == "segment" else tuner, held.__name__, marked)
with Index.open({loc!r}, IndexConfig(dim=784, samples=128), maintain=False) as ix:
    n = ix.count()
    for step in range(100):
        lo = n + step * 700
        ix.upsert(["v%d" % i for i in range(lo, lo + 700)], X[lo % 50000:lo % 50000 + 700])
        ix.delete(["v%d" % i for i in range(lo - 600, lo - 500)])
        ix.maintain(queries=X[50000:50000 + tuner.MIN_QUERIES] if phase == "tune" else None)
"""


@pytest.mark.parametrize("phase", ["segment", "tune"])
def test_killed_in_the_middle_of_upkeep_the_index_opens_answers_and_checks(tmp_path, fmnist, phase):
    """A process absorbing rows into segments, merging them, fitting lists anew and tuning is
    SIGKILLed while it builds a segment (or tunes), several times: each time the index opens,
    answers (the killed work is simply not there: a later run redoes it) and passes its check,
    and every acknowledged write is in it."""
    X = fmnist[0]
    loc = str(tmp_path / "i")
    with Index.open(loc, IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
    rng = np.random.default_rng(7)
    for _ in range(4):  # kills
        script = _CHILD.format(fmnist=str(FMNIST_PATH), phase=phase, loc=loc)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            for _ in range(1 + int(rng.integers(0, 3))):  # into the first, second or third such task
                assert child.stdout.readline().strip() == "inside", "the child ended before upkeep began"
            threading.Event().wait(float(rng.uniform(0, 0.3)))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        with Index.open(loc, maintain=False) as ix:
            assert ix.count() >= 3000
            report = ix.check()
            assert report.ok, report.summary()
            view = ix.view()
            some = int(np.flatnonzero(view.alive)[-1])
            name = view.name(some)
            got = ix.get(name)
            top = ix.query(got.values, k=1, mode="exact").neighbors[0]
            assert top.similarity == pytest.approx(1.0)
            ix.maintain()  # what the kill interrupted, done now
            assert ix.check().ok and ix.query(got.values, k=1).neighbors[0].similarity == pytest.approx(1.0)


def test_a_checkpoint_holds_no_lock_a_query_waits_for(tmp_path, fmnist, monkeypatch):
    """A checkpoint's fsyncs (slow on a busy disk) run outside the mirror's ``sync`` lock: while
    one is held on its way, another process writes and a query here applies the write and
    answers."""
    X, _, _, _ = fmnist
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 2000), X[:2000])
        ix.query(X[0], k=1, mode="exact")
        inside, release = threading.Event(), threading.Event()
        fsync = os.fsync

        def slow_fsync(fd):
            if threading.current_thread().name == "checkpoint":
                inside.set()
                assert release.wait(120)
            return fsync(fd)

        monkeypatch.setattr(os, "fsync", slow_fsync)
        work = threading.Thread(target=ix.mirror.checkpoint, name="checkpoint")
        work.start()
        try:
            assert inside.wait(120)
            _write_elsewhere_and_find_it(ix, tmp_path / "i", X)
            assert work.is_alive() and not release.is_set()  # the checkpoint is still on its way
        finally:
            release.set()
            work.join(300)
        assert ix.check().ok


def test_a_worker_keeps_its_slow_lane_while_its_fast_lane_works(tmp_path, fmnist):
    """A worker's lanes stop together, once neither has had work for ``idle`` seconds: no other
    worker starts on the machine while one lives, so a slow lane that stopped on its own left
    the re-tune a recall monitor asked for undone as long as a writer kept the fast lane busy
    (text at a million: served recall 0.69 for eight minutes). Here a writer keeps the fast
    lane busy past the slow lane's idle time, then enough queries are served to tune on: the
    worker's slow lane tunes on them."""
    X, _, Q, _ = fmnist
    idle = 1.0
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 5000), X[:5000])
        ix.maintain()
        assert not ix.view().tuned_on_queries
        worker = threading.Thread(target=ix.upkeep.work, kwargs={"idle": idle})
        worker.start()
        try:
            at = 5000
            for _ in range(6):  # ~3 idle periods of the slow lane, the fast lane absorbing a segment each 0.5 s
                ix.upsert(_ids(at, at + segments.TAIL_ROWS), X[at:at + segments.TAIL_ROWS])
                at += segments.TAIL_ROWS
                threading.Event().wait(idle / 2)
            assert worker.is_alive()
            for q in Q[:tuner.MIN_QUERIES]:
                ix.query(q, k=10)
            ix.flush_served()
            deadline = time.monotonic() + 60
            while not ix.view().tuned_on_queries and worker.is_alive() and time.monotonic() < deadline:
                rows = np.arange(at, at + segments.TAIL_ROWS)  # the writer goes on, the fast lane busy as before
                ix.upsert(_ids(at, at + segments.TAIL_ROWS), X[rows % X.shape[0]])
                at += segments.TAIL_ROWS
                threading.Event().wait(idle / 2)
            assert ix.view().tuned_on_queries, "the worker stopped its slow lane while the fast lane worked"
            kinds = [e["kind"] for e in ix.upkeep.events]
            assert "absorb" in kinds and "tune" in kinds
        finally:
            worker.join(120)
        assert not worker.is_alive()


def test_a_lane_in_a_long_task_keeps_its_worker_s_other_lane(tmp_path, fmnist, monkeypatch):
    """A lane in a task counts as work: the slow lane holds in a tuning (at 2M rows under a
    writer one took 63 s) while the fast lane has nothing to do for longer than the idle time;
    rows then arrive, and the fast lane is still there to make them a segment."""
    X, _, Q, _ = fmnist
    idle = 1.0
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 5000), X[:5000])
        ix.maintain()
        inside, release = threading.Event(), threading.Event()
        held = tuner.tune

        def slow(*args, **kwargs):
            inside.set()
            assert release.wait(120)
            return held(*args, **kwargs)

        monkeypatch.setattr(tuner, "tune", slow)
        for q in Q[:tuner.MIN_QUERIES]:  # a tuning on served queries falls due
            ix.query(q, k=10)
        ix.flush_served()
        worker = threading.Thread(target=ix.upkeep.work, kwargs={"idle": idle})
        worker.start()
        try:
            assert inside.wait(120)
            release.wait(3 * idle)  # not set: the fast lane idle for three idle times
            ix.upsert(_ids(5000, 5000 + segments.TAIL_ROWS), X[5000:5000 + segments.TAIL_ROWS])
            waited = threading.Event()
            for _ in range(300):
                if ix.view().tail_start == 5000 + segments.TAIL_ROWS:
                    break
                waited.wait(0.1)
            assert ix.view().tail_start == 5000 + segments.TAIL_ROWS, "no fast lane made the new rows a segment"
            assert not release.is_set() and worker.is_alive()  # while the tuning still held
        finally:
            release.set()
            worker.join(120)
        assert not worker.is_alive() and ix.view().tuned_on_queries


def test_the_fast_lane_builds_its_segments_on_its_own_thread(tmp_path, fmnist, monkeypatch):
    """The fast lane's tasks run on its thread alone, not spread over the process's pool, which
    the slow lane's work fills: at a million rows an absorb of 1,500 rows queued there behind a
    fit for 5.6 s, while the tail every query scans grew (issue 30)."""
    X = fmnist[0]
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 5000), X[:5000])
        ix.maintain()
        built = segments.build_segment
        spreads: dict[str, int] = {}

        def recorded(*args, **kwargs):
            spreads[threading.current_thread().name] = parallel.threads()
            return built(*args, **kwargs)

        monkeypatch.setattr(segments, "build_segment", recorded)
        ix.upsert(_ids(5000, 5000 + segments.TAIL_ROWS), X[5000:5000 + segments.TAIL_ROWS])
        worker = threading.Thread(target=ix.upkeep.work, kwargs={"idle": 0.5})
        worker.start()
        worker.join(120)
        assert ix.view().tail_start == 5000 + segments.TAIL_ROWS
        assert spreads == {"gmmlsh-upkeep-fast": 1}


def test_upkeep_lanes_lower_their_own_priority_only():
    """A worker's lanes run below the queries' priority, as batch threads (no preemption on
    wakeup), its follower (which takes the lock a query may wait for) at the process's: the
    priority and the policy are set per thread, and the threads a lane starts inherit them."""
    from gmmlsh.index import upkeep

    def priority() -> tuple[int, int]:
        tid = threading.get_native_id()
        return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

    mine = priority()
    seen = {}

    def lane():
        upkeep._lower_priority()
        seen["lane"] = priority()
        child = threading.Thread(target=lambda: seen.update(child=priority()))
        child.start()
        child.join()

    t = threading.Thread(target=lane)
    t.start()
    t.join()
    assert seen["lane"] == (min(19, mine[0] + upkeep.NICE), os.SCHED_BATCH) and seen["child"] == seen["lane"]
    assert priority() == mine


def test_the_upkeep_worker_shares_the_session_of_the_process_that_starts_it(tmp_path, fmnist):
    """Linux's autogroups share the CPU between sessions before threads: a worker started in a
    session of its own took half of a busy machine whatever its lanes' nice values. It runs in
    its starter's session, in a process group of its own (a terminal's Ctrl-C is not for it)."""
    X = fmnist[0]
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=64)) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        deadline = time.monotonic() + 60
        while ix.upkeep._worker is None and time.monotonic() < deadline:
            ix.query(X[0], k=1)  # a query looks at what is due, and starts a worker
            time.sleep(0.1)
        worker = ix.upkeep._worker
        assert worker is not None, "no upkeep worker started"
        assert os.getsid(worker.pid) == os.getsid(0)
        assert os.getpgid(worker.pid) == worker.pid != os.getpgid(0)


def test_an_lmdb_write_is_searchable_when_acknowledged_and_a_query_never_syncs_for_another(tmp_path, fmnist,
                                                                                          monkeypatch):
    """LMDB: a write returns once its rows are in the machine's mirror, so a query in another
    process finds it without applying anything; a query meeting a sync under way elsewhere (a
    write not yet acknowledged) answers from the mirror as it is, at once."""
    X, _, _, _ = fmnist
    loc = tmp_path / "i"
    with Index.open(loc, IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 2000), X[:2000])
        assert ix.mirror.refresh().token == ix.store.token()  # applied before upsert returned
        ix.query(X[0], k=1, mode="exact")

        def no_sync(*args, **kwargs):
            raise AssertionError("the query applied writes itself")

        monkeypatch.setattr(ix.mirror, "sync", no_sync)
        _write_elsewhere_and_find_it(ix, loc, X)
        monkeypatch.undo()

        held, release = threading.Event(), threading.Event()

        def hold_sync_lock():
            with ix.mirror.locked():
                held.set()
                assert release.wait(120)

        holder = threading.Thread(target=hold_sync_lock)
        holder.start()
        try:
            assert held.wait(60)
            ix.store.write(ix.prepare(["unacknowledged"], X[7001:7002]))  # in the store, not applied
            done = []
            query = threading.Thread(target=lambda: done.append(ix.query(X[7001], k=1, mode="exact")))
            query.start()
            query.join(60)
            assert done, "the query waited for the sync lock"
            assert done[0].neighbors[0].id != "unacknowledged"
        finally:
            release.set()
            holder.join(60)
        ix.query(X[7001], k=1, mode="exact")  # the lock free: this query applies it (its answer stands) ...
        assert ix.mirror.refresh().token == ix.store.token()
        assert ix.query(X[7001], k=1, mode="exact").neighbors[0].id == "unacknowledged"  # ... and the next finds it
        assert ix.check().ok


def test_a_query_answers_once_when_a_local_write_lands_during_it(tmp_path, fmnist, monkeypatch):
    """LMDB: a write that the mirror lacks when a query reads its view was acknowledged after the
    query began (its writer holds the sync lock until the mirror has it), so the query answers
    once, from its view, whether that writer is still applying it or has finished; answering
    again on the newer view cost a few per cent of the queries under a steady writer."""
    X, _, _, _ = fmnist
    with Index.open(tmp_path / "i", IndexConfig(dim=784, samples=128), maintain=False) as ix:
        ix.upsert(_ids(0, 3000), X[:3000])
        answers, real = [], ix._answer
        monkeypatch.setattr(ix, "_answer", lambda *a, **kw: answers.append(1) or real(*a, **kw))
        stop, written = threading.Event(), [3000]

        def write():
            while not stop.is_set():
                i = written[0]
                ix.upsert(_ids(i, i + 10), X[i:i + 10])
                written[0] = i + 10

        writer = threading.Thread(target=write)
        writer.start()
        queries = moved = 0
        try:
            while moved < 100 and queries < 5000:
                before = ix.mirror.refresh().token
                ix.query(X[queries % 3000], k=5, mode="exact")
                queries += 1
                moved += ix.store.token() != before
        finally:
            stop.set()
            writer.join(60)
        assert moved == 100  # a write landed during each of 100 queries
        assert len(answers) == queries
        assert ix.query(X[written[0] - 1], k=1, mode="exact").neighbors[0].id == f"v{written[0] - 1}"
