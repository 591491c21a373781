"""The LMDB backend: the shared store contract plus what only an embedded store has to get right
(persistence across reopen, other processes, crashes mid-batch, a full map)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from store_contract import StoreContract, make_batch, read_all

from gmmlsh.index.store.base import FIELDS, RecordBatch, StoreError, StoreUnavailable
from gmmlsh.index.store.lmdb import LmdbStore

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


class TestLmdbContract(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path):
        made: list[LmdbStore] = []
        counter = itertools.count()

        def make() -> LmdbStore:
            made.append(LmdbStore(tmp_path / f"db{next(counter)}"))
            return made[-1]

        yield make
        for s in made:
            s.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / "index"


@pytest.fixture
def store(db_path):
    s = LmdbStore(db_path)
    yield s
    s.close()


def snapshot_of(store) -> dict:
    """Every live record of a store, by external id."""
    out = {}
    for names, iids in store.scan_ids():
        for name, rec in zip(names, read_all(store, iids), strict=True):
            out[name] = rec
    return out


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a python snippet in a fresh interpreter that can import the package and the tests."""
    prelude = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def spawn_child(code: str, *args: str) -> subprocess.Popen:
    prelude = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("child never reached the marker")
        time.sleep(0.01)


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


# --- persistence ---------------------------------------------------------------------------
def test_reopen_after_close_keeps_everything(db_path, rng):
    s = LmdbStore(db_path)
    s.init_config({"dim": 3})
    s.write(make_batch([f"a{i}" for i in range(40)], rng)[0])
    s.delete(["a5", "a6"])
    before, token = snapshot_of(s), s.token()
    s.close()
    s.close()  # idempotent
    s = LmdbStore(db_path)
    try:
        assert s.read_config() == {"dim": 3}
        assert snapshot_of(s) == before and s.token() == token
        s.write(make_batch(["fresh"], rng)[0])
        assert s.lookup(["fresh"])[0] >= token[0], "iids are never reused"
    finally:
        s.close()


def test_closed_store_is_unavailable(store, rng):
    store.write(make_batch(["x"], rng)[0])
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.ping()
    for call in (store.count, store.token, lambda: list(store.scan(FIELDS)),
                 lambda: store.write(make_batch(["y"], rng)[0])):
        with pytest.raises(StoreUnavailable):
            call()
    store.close()


def test_close_during_scan_raises_unavailable(store, rng):
    store.write(make_batch([f"z{i}" for i in range(20)], rng)[0])
    it = store.scan(FIELDS, batch_size=5)
    next(it)
    store.close()
    with pytest.raises(StoreUnavailable):
        list(it)


def test_second_open_in_same_process_is_a_clear_error(store, db_path):
    with pytest.raises(StoreError, match="already open in this process"):
        LmdbStore(db_path)


def test_info_and_counters(store, rng):
    store.write(make_batch([f"n{i}" for i in range(30)], rng)[0])
    store.delete(["n0", "n1"])
    info = store.info()
    assert info["kind"] == "lmdb" and info["path"] == str(store.path)
    assert info["bytes"] == (store.path / "data.mdb").stat().st_size > 0
    assert info["map_size"] == 1 << 40
    assert info["vectors"] == store.count() == 28
    assert info["iids_handed_out"] == 30 and info["retired"] == 2
    assert info["max_readers"] >= 1024


# --- threads ------------------------------------------------------------------------------------
def test_readers_see_whole_batches(store, rng):
    """A batch is one transaction: a reader never sees part of it."""
    batch_n = 40
    batches = [make_batch([f"t{j}_{i}" for i in range(batch_n)], rng)[0] for j in range(15)]
    errors: list[BaseException] = []
    stop = threading.Event()
    seen = set()

    def reader():
        try:
            while not stop.is_set():
                c = store.count()
                assert c % batch_n == 0, f"saw {c} records: a half-committed batch"
                total = sum(len(i) for i, _ in store.scan(["sketch"]))
                assert total % batch_n == 0
                seen.add(c)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for b in batches:
            store.write(b)
            time.sleep(0.002)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert store.count() == 15 * batch_n
    assert len(seen) > 1


def test_use_after_fork_is_refused(store, rng):
    store.write(make_batch(["f"], rng)[0])
    pid = os.fork()
    if pid == 0:  # child: the inherited environment must not be used
        code = 1
        try:
            store.count()
        except StoreError as e:
            code = 0 if "fork" in str(e) else 2
        except BaseException:
            code = 3
        store.close()  # must not close the parent's environment
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.count() == 1


# --- other processes ------------------------------------------------------------------------------
READ_IN_CHILD = """
import json, sys
import numpy as np
from gmmlsh.index.store.lmdb import LmdbStore
from store_contract import make_batch
s = LmdbStore(sys.argv[1], readonly=sys.argv[2] == "ro")
iids = s.lookup(["p0", "p7", "nope"])
out = {
    "count": s.count(),
    "iids": iids.tolist(),
    "vec": [v.hex() if v else None for v in s.read(iids, ["vector"])["vector"]],
    "config": s.read_config(),
    "token": list(s.token()),
    "cleared": s.stale_readers_cleared,
}
if sys.argv[2] == "rw":
    s.write(make_batch(["from-child"], np.random.default_rng(1))[0])
s.close()
print(json.dumps(out))
"""


def test_second_process_sees_committed_data(store, db_path, rng):
    store.init_config({"dim": 5})
    batch, recs = make_batch([f"p{i}" for i in range(10)], rng)
    store.write(batch)
    for mode in ("ro", "rw"):
        token = list(store.token())
        res = run_child(READ_IN_CHILD, str(db_path), mode)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["count"] == 10
        assert out["iids"][2] == -1
        assert out["iids"][:2] == store.lookup(["p0", "p7"]).tolist()
        assert out["vec"][:2] == [recs[0]["vector"].hex(), recs[7]["vector"].hex()]
        assert out["config"] == {"dim": 5} and out["token"] == token
    # ... and this process sees what the child committed: its token too (read before the
    # child's commit, it is kept only while the environment shows no newer transaction).
    assert store.token()[0] == token[0] + 1
    assert store.lookup(["from-child"])[0] >= 0
    assert store.count() == 11


def test_readonly_store(db_path, rng):
    s = LmdbStore(db_path)
    s.init_config({"dim": 2})
    s.write(make_batch(["r"], rng)[0])
    s.close()
    ro = LmdbStore(db_path, readonly=True)
    try:
        assert ro.count() == 1
        assert ro.init_config({"dim": 99}) == {"dim": 2}
        with pytest.raises(StoreError, match="read-only"):
            ro.write(make_batch(["w"], rng)[0])
        assert ro.count() == 1
        ro.ping()
    finally:
        ro.close()
    with pytest.raises(StoreError, match="no LMDB index"):
        LmdbStore(db_path.parent / "missing", readonly=True)


# --- crashes ------------------------------------------------------------------------------------------
KILL_MID_WRITE = """
import os, sys, time
import numpy as np
from gmmlsh.index.store import lmdb as lmdb_store
from store_contract import make_batch

class StallingState:
    # The feed's counters are packed inside the write transaction, after the batch was written.
    def __init__(self, real):
        self.real = real
    def unpack(self, raw):
        return self.real.unpack(raw)
    def pack(self, *values):
        open(sys.argv[2], "w").close()
        time.sleep(120)
        return self.real.pack(*values)

s = lmdb_store.LmdbStore(sys.argv[1])
n = int(sys.argv[3])
batch, _ = make_batch([f"k{i}" for i in range(n)] + ["seed0"], np.random.default_rng(3))
if sys.argv[4] == "stall":
    lmdb_store._STATE = StallingState(lmdb_store._STATE)
else:
    print("start", flush=True)
s.write(batch)
print("committed", flush=True)
time.sleep(120)
"""


def _assert_batch_all_or_nothing(store: LmdbStore, before: dict, n: int) -> bool:
    """After a killed writer: either the whole batch is there, or none of it."""
    present = int((store.lookup([f"k{i}" for i in range(n)]) >= 0).sum())
    assert present in (0, n), f"{present} of {n} records of the killed batch are visible"
    if present == 0:
        assert snapshot_of(store) == before
    else:
        assert store.count() == len(before) + n - ("seed0" not in before)
    return present == n


def test_sigkill_inside_write_txn_leaves_nothing(store, db_path, tmp_path, rng):
    store.write(make_batch(["seed0", "seed1"], rng)[0])  # seed0 gets replaced by the killed batch
    before = snapshot_of(store)
    marker = tmp_path / "in_txn"
    n = 3000
    proc = spawn_child(KILL_MID_WRITE, str(db_path), str(marker), str(n), "stall")
    try:
        wait_for(marker, proc)  # the child is inside upsert's write transaction now
    finally:
        kill(proc)
    assert not _assert_batch_all_or_nothing(store, before, n)
    assert store.lookup(["k0"]).tolist() == [-1]
    # The dead writer's lock is recovered: this process can write again.
    store.write(make_batch(["after"], rng)[0])
    assert store.count() == 3
    store.close()
    # A fresh process opens fine and its reader_check runs.
    res = run_child(READ_IN_CHILD, str(db_path), "rw")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["count"] == 3


@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_sigkill_during_large_upsert_is_all_or_nothing(store, db_path, rng, delay):
    store.write(make_batch(["seed0", "seed1"], rng)[0])
    before = snapshot_of(store)
    n = 20_000
    proc = spawn_child(KILL_MID_WRITE, str(db_path), "-", str(n), "plain")
    try:
        assert proc.stdout.readline().strip() == "start", proc.stderr.read()
        time.sleep(delay)
    finally:
        kill(proc)
    committed = _assert_batch_all_or_nothing(store, before, n)
    if committed:  # the child won the race; the batch must then be complete and consistent
        full = sorted(f"k{i}" for i in range(n))
        names = store.read(store.lookup(full), ["name"])["name"]
        assert [b.decode() for b in names] == full
    store.write(make_batch(["after"], rng)[0])
    assert store.lookup(["after"])[0] >= 0


HOLD_READER = """
import sys, time
from gmmlsh.index.store.lmdb import LmdbStore
s = LmdbStore(sys.argv[1])
it = s.scan(["vector"], batch_size=1)
next(it)                      # a read transaction (and its reader slot) is now held
open(sys.argv[2], "w").close()
time.sleep(120)
"""


def test_reader_check_clears_slots_of_killed_processes(store, db_path, tmp_path, rng):
    store.write(make_batch(["a", "b"], rng)[0])
    # This process keeps the environment open, so the lock file (and its reader
    # table) survives the child: only reader_check can free the dead slot.
    marker = tmp_path / "reading"
    proc = spawn_child(HOLD_READER, str(db_path), str(marker))
    try:
        wait_for(marker, proc)
    finally:
        kill(proc)
    res = run_child(READ_IN_CHILD, str(db_path), "ro")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["cleared"] >= 1
    assert store.count() == 2


# --- map full ------------------------------------------------------------------------------------------
def test_map_full_is_a_clear_error_and_rolls_back(tmp_path, rng):
    s = LmdbStore(tmp_path / "tiny", map_size=256 * 1024)
    try:
        s.write(make_batch(["small"], rng)[0])
        n = 2000
        batch = RecordBatch(ids=[f"big{i}" for i in range(n)], vectors=[bytes(2048)] * n,
                            sketches=np.zeros((n, 8), np.uint8))
        with pytest.raises(StoreError, match="map full.*map_size") as exc:
            s.write(batch)
        assert not isinstance(exc.value, StoreUnavailable)
        assert s.count() == 1
        assert s.lookup(["big0", "small"]).tolist()[0] == -1
        s.ping()
        s.write(make_batch(["small2"], rng)[0])  # still writable
        assert s.count() == 2
    finally:
        s.close()


def test_a_write_is_in_the_mirror_when_it_returns_without_being_read_back(tmp_path, monkeypatch):
    """An LMDB write is applied to the search mirror under the lock it is written in, from the
    batch the process holds (as a Redis write is): nothing is read back from the store."""
    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.index import Index

    X = np.random.default_rng(5).random((205, 8)).astype(np.float32)
    with Index.open(str(tmp_path / "ix"), IndexConfig(dim=8), maintain=False) as ix:
        ix.upsert([f"v{i}" for i in range(200)], X[:200], [{"n": i} for i in range(200)])
        ix.view()
        read: list[int] = []
        real = ix.store.read
        monkeypatch.setattr(ix.store, "read", lambda iids, fields: read.extend(np.asarray(iids).tolist())
                            or real(iids, fields))
        ix.upsert(["v7", "w1", "w2", "w1"], X[200:204], [None, {"m": 1}, None, {"m": 2}])
        ix.delete(["v8"])
        assert tuple(ix.mirror.refresh().token) == ix.store.token()
        assert read == []
        monkeypatch.undo()
        report = ix.check()
        assert report.ok and report.mirror_behind == 0, report
        assert ix.query(X[202], k=1, mode="exact").neighbors[0].id == "w2" and ix.get("w1").metadata == {"m": 2}
        assert not ix.contains("v8") and ix.count() == 201
