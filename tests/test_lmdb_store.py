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
from gmmlsh.index.store.base import RecordBatch, StoreError, StoreUnavailable
from gmmlsh.index.store.lmdb import LmdbStore
from store_contract import (
    KEY_BYTES,
    N_BANDS,
    Model,
    StoreContract,
    assert_matches,
    band_keys_of,
    flip,
    make_batch,
)

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


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a python snippet in a fresh interpreter that can import the package and the tests."""
    prelude = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn_child(code: str, *args: str) -> subprocess.Popen:
    prelude = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


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
    model = Model()
    s = LmdbStore(db_path)
    s.init_config({"dim": 3, "bands": N_BANDS})
    batch, recs = make_batch([f"a{i}" for i in range(40)], rng)
    model.upsert(s, batch, recs)
    model.delete(s, ["a5", "a6"])
    iid_of = assert_matches(s, model)
    bound = s.iid_bound()
    s.close()
    s.close()  # idempotent

    s = LmdbStore(db_path)
    try:
        assert s.read_config() == {"dim": 3, "bands": N_BANDS}
        assert assert_matches(s, model) == iid_of
        assert s.iid_bound() == bound
        batch, recs = make_batch(["fresh"], rng)
        model.upsert(s, batch, recs)
        assert s.lookup(["fresh"])[0] >= bound, "iids are never reused for a new id"
        assert_matches(s, model)
    finally:
        s.close()


def test_closed_store_is_unavailable(store, rng):
    store.upsert(make_batch(["x"], rng)[0], band_keys_of)
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.ping()
    with pytest.raises(StoreUnavailable):
        store.count()
    with pytest.raises(StoreUnavailable):
        store.bucket_members([b"\x00" * KEY_BYTES])
    with pytest.raises(StoreUnavailable):
        list(store.scan("vector"))
    with pytest.raises(StoreUnavailable):
        store.upsert(make_batch(["y"], rng)[0], band_keys_of)
    store.close()


def test_close_during_scan_raises_unavailable(store, rng):
    store.upsert(make_batch([f"z{i}" for i in range(20)], rng)[0], band_keys_of)
    it = store.scan("vector", batch_size=5)
    next(it)
    store.close()
    with pytest.raises(StoreUnavailable):
        list(it)


def test_second_open_in_same_process_is_a_clear_error(store, db_path):
    with pytest.raises(StoreError, match="already open in this process"):
        LmdbStore(db_path)


def test_info_and_counters(store, rng):
    model = Model()
    batch, recs = make_batch([f"n{i}" for i in range(30)], rng)
    model.upsert(store, batch, recs)
    model.delete(store, ["n0", "n1"])
    info = store.info()
    assert info["kind"] == "lmdb"
    assert info["path"] == str(store.path)
    assert info["bytes"] == (store.path / "data.mdb").stat().st_size > 0
    assert info["map_size"] == 1 << 40
    assert info["vectors"] == store.count() == 28
    assert info["bucket_entries"] == N_BANDS * 28
    assert info["entries"] > info["bucket_entries"]
    assert info["max_readers"] >= 1024


# --- input checks ----------------------------------------------------------------------------
def test_bad_inputs_are_value_errors_and_write_nothing(store, rng):
    batch, _ = make_batch(["ok", ""], rng)
    with pytest.raises(ValueError, match="id"):
        store.upsert(batch, band_keys_of)
    batch, _ = make_batch(["ok", "x" * 600], rng)
    with pytest.raises(ValueError, match="id"):
        store.upsert(batch, band_keys_of)
    batch, _ = make_batch(["ok", "ok2"], rng)
    bad = RecordBatch(ids=batch.ids, vectors=batch.vectors[:1], sketches=batch.sketches, band_keys=batch.band_keys)
    with pytest.raises(ValueError, match="vectors"):
        store.upsert(bad, band_keys_of)
    bad = RecordBatch(
        ids=batch.ids, vectors=batch.vectors, sketches=batch.sketches, band_keys=batch.band_keys.astype(np.int64)
    )
    with pytest.raises(ValueError, match="band_keys"):
        store.upsert(bad, band_keys_of)
    assert store.count() == 0 and store.iid_bound() == 0
    with pytest.raises(ValueError, match="field"):
        store.fetch(np.array([0]), "vectors")
    with pytest.raises(ValueError, match="field"):
        list(store.scan("nope"))
    # Ids that cannot be stored are simply unknown to the readers.
    assert store.lookup(["", "x" * 600]).tolist() == [-1, -1]
    assert store.delete(["", "x" * 600], band_keys_of) == 0


def test_bucket_members_input_forms(store, rng):
    batch, _ = make_batch([f"b{i}" for i in range(30)], rng)
    store.upsert(batch, band_keys_of)
    keys = batch.band_keys[:3].reshape(-1, KEY_BYTES)
    as_bytes = [k.tobytes() for k in keys]
    want = sorted(store.bucket_members(as_bytes).tolist())
    assert sorted(store.bucket_members(keys).tolist()) == want  # 2-D uint8 array
    # Odd keys (empty, too long, another length) are answered, not crashed on.
    odd = as_bytes + [b"", b"\x00" * 600, b"\x00\x01\x02"]
    assert sorted(store.bucket_members(odd).tolist()) == want
    assert store.bucket_members([b""]).tolist() == []


def test_bucket_members_is_one_c_call(store, rng):
    """The hot path must not loop over members in Python: a big bucket costs ~ a small one."""
    n = 20_000
    sk = np.zeros((n, 8), dtype=np.uint8)  # every record in the same 4 buckets
    ids = [f"h{i}" for i in range(n)]
    batch = RecordBatch(ids=ids, vectors=[b"v"] * n, sketches=sk, band_keys=band_keys_of(sk))
    store.upsert(batch, band_keys_of)
    keys = [k.tobytes() for k in band_keys_of(sk[:1])[0]]
    got = store.bucket_members(keys)
    assert got.shape == (N_BANDS * n,)
    assert np.array_equal(np.sort(got[:n]), np.arange(n, dtype=np.uint32))
    t0 = time.perf_counter()
    for _ in range(20):
        store.bucket_members(keys)
    per_call = (time.perf_counter() - t0) / 20
    # 80,000 ids; a per-member Python loop would take tens of milliseconds.
    assert per_call < 0.02, f"bucket_members took {per_call * 1e3:.1f} ms for 80k ids"


def test_upsert_writes_only_changed_records(store, rng):
    """Replacing one of many records leaves the others' bucket entries untouched."""
    model = Model()
    batch, recs = make_batch([f"u{i}" for i in range(50)], rng)
    model.upsert(store, batch, recs)
    old_iid = int(store.lookup(["u3"])[0])
    before = {k: m.tolist() for k, m in store.scan_buckets()}
    b2, r2 = make_batch(["u3"], rng, sketches=flip(batch.sketches[3:4]))
    model.upsert(store, b2, r2)
    after = {k: m.tolist() for k, m in store.scan_buckets()}
    new_iid = int(store.lookup(["u3"])[0])

    def others(buckets: dict) -> dict:
        out = {k: [i for i in v if i not in (old_iid, new_iid)] for k, v in buckets.items()}
        return {k: v for k, v in out.items() if v}

    assert others(before) == others(after)
    assert sum(v.count(old_iid) for v in after.values()) == 0
    assert sum(v.count(new_iid) for v in after.values()) == N_BANDS
    assert_matches(store, model)


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
                total = sum(len(i) for i, _ in store.scan("sketch"))
                assert total % batch_n == 0
                seen.add(c)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for b in batches:
            store.upsert(b, band_keys_of)
            time.sleep(0.002)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert store.count() == 15 * batch_n
    assert len(seen) > 1


def test_use_after_fork_is_refused(store, rng):
    store.upsert(make_batch(["f"], rng)[0], band_keys_of)
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
from store_contract import band_keys_of, make_batch
s = LmdbStore(sys.argv[1], readonly=sys.argv[2] == "ro")
iids = s.lookup(["p0", "p7", "nope"])
out = {
    "count": s.count(),
    "iids": iids.tolist(),
    "vec": [v.hex() if v else None for v in s.fetch(iids, "vector")],
    "config": s.read_config(),
    "members": sorted(s.bucket_members([bytes.fromhex(sys.argv[3])]).tolist()),
    "cleared": s.stale_readers_cleared,
}
if sys.argv[2] == "rw":
    batch, _ = make_batch(["from-child"], np.random.default_rng(1))
    s.upsert(batch, band_keys_of)
s.close()
print(json.dumps(out))
"""


def test_second_process_sees_committed_data(store, db_path, rng):
    store.init_config({"dim": 5})
    batch, recs = make_batch([f"p{i}" for i in range(10)], rng)
    store.upsert(batch, band_keys_of)
    key = batch.band_keys[0, 0].tobytes()
    for mode in ("ro", "rw"):
        res = run_child(READ_IN_CHILD, str(db_path), mode, key.hex())
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["count"] == 10
        assert out["iids"][2] == -1
        assert out["iids"][:2] == store.lookup(["p0", "p7"]).tolist()
        assert out["vec"][:2] == [recs[0].vector.hex(), recs[7].vector.hex()]
        assert out["config"] == {"dim": 5}
        assert out["members"] == sorted(store.bucket_members([key]).tolist())
    # ... and this process sees what the child committed.
    assert store.lookup(["from-child"])[0] >= 0
    assert store.count() == 11


def test_readonly_store(db_path, rng):
    s = LmdbStore(db_path)
    s.init_config({"dim": 2})
    s.upsert(make_batch(["r"], rng)[0], band_keys_of)
    s.close()
    ro = LmdbStore(db_path, readonly=True)
    try:
        assert ro.count() == 1
        assert ro.init_config({"dim": 99}) == {"dim": 2}
        with pytest.raises(StoreError, match="read-only"):
            ro.upsert(make_batch(["w"], rng)[0], band_keys_of)
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
from gmmlsh.index.store.lmdb import LmdbStore
from store_contract import band_keys_of, make_batch

class Stall(bytes):
    # Converted to bytes inside the write transaction, after most of the batch was written.
    def __bytes__(self):
        open(sys.argv[2], "w").close()
        time.sleep(120)
        return bytes.__bytes__(self)

s = LmdbStore(sys.argv[1])
n = int(sys.argv[3])
batch, _ = make_batch([f"k{i}" for i in range(n)] + ["seed0"], np.random.default_rng(3))
if sys.argv[4] == "stall":
    batch.vectors[-1] = Stall(batch.vectors[-1])
else:
    print("start", flush=True)
s.upsert(batch, band_keys_of)
print("committed", flush=True)
time.sleep(120)
"""


def _assert_batch_all_or_nothing(store: LmdbStore, model: Model, n: int) -> bool:
    """After a killed writer: either the whole batch is there, or none of it."""
    iids = store.lookup([f"k{i}" for i in range(n)])
    present = int((iids >= 0).sum())
    assert present in (0, n), f"{present} of {n} records of the killed batch are visible"
    if present == 0:
        assert_matches(store, model)
    else:
        assert store.count() == len(model.recs) + n - ("seed0" not in model.recs)
    return present == n


def test_sigkill_inside_write_txn_leaves_nothing(store, db_path, tmp_path, rng):
    model = Model()
    batch, recs = make_batch(["seed0", "seed1"], rng)
    model.upsert(store, batch, recs)  # seed0 gets replaced by the killed batch
    marker = tmp_path / "in_txn"
    n = 3000
    proc = spawn_child(KILL_MID_WRITE, str(db_path), str(marker), str(n), "stall")
    try:
        wait_for(marker, proc)  # the child is inside upsert's write transaction now
    finally:
        kill(proc)
    assert not _assert_batch_all_or_nothing(store, model, n)
    assert store.lookup(["k0"]).tolist() == [-1]
    # The dead writer's lock is recovered: this process can write again.
    batch, recs = make_batch(["after"], rng)
    model.upsert(store, batch, recs)
    assert_matches(store, model)
    store.close()
    # A fresh process opens fine and its reader_check runs.
    res = run_child(READ_IN_CHILD, str(db_path), "rw", "00")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["count"] == 3


@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_sigkill_during_large_upsert_is_all_or_nothing(store, db_path, rng, delay):
    model = Model()
    batch, recs = make_batch(["seed0", "seed1"], rng)
    model.upsert(store, batch, recs)
    n = 20_000
    proc = spawn_child(KILL_MID_WRITE, str(db_path), "-", str(n), "plain")
    try:
        assert proc.stdout.readline().strip() == "start", proc.stderr.read()
        time.sleep(delay)
    finally:
        kill(proc)
    committed = _assert_batch_all_or_nothing(store, model, n)
    if committed:  # the child won the race; the batch must then be complete and consistent
        full = {f"k{i}" for i in range(n)}
        assert set(store.external_ids(store.lookup(sorted(full)))) == full
    batch, recs = make_batch(["after"], rng)
    store.upsert(batch, band_keys_of)
    assert store.lookup(["after"])[0] >= 0


HOLD_READER = """
import sys, time
from gmmlsh.index.store.lmdb import LmdbStore
s = LmdbStore(sys.argv[1])
it = s.scan("vector", batch_size=1)
next(it)                      # a read transaction (and its reader slot) is now held
open(sys.argv[2], "w").close()
time.sleep(120)
"""


def test_reader_check_clears_slots_of_killed_processes(store, db_path, tmp_path, rng):
    store.upsert(make_batch(["a", "b"], rng)[0], band_keys_of)
    # This process keeps the environment open, so the lock file (and its reader
    # table) survives the child: only reader_check can free the dead slot.
    marker = tmp_path / "reading"
    proc = spawn_child(HOLD_READER, str(db_path), str(marker))
    try:
        wait_for(marker, proc)
    finally:
        kill(proc)
    res = run_child(READ_IN_CHILD, str(db_path), "ro", "00")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["cleared"] >= 1
    assert store.count() == 2


# --- map full ------------------------------------------------------------------------------------------
def test_map_full_is_a_clear_error_and_rolls_back(tmp_path, rng):
    s = LmdbStore(tmp_path / "tiny", map_size=256 * 1024)
    try:
        s.upsert(make_batch(["small"], rng)[0], band_keys_of)
        n = 2000
        batch = RecordBatch(
            ids=[f"big{i}" for i in range(n)],
            vectors=[bytes(2048)] * n,
            sketches=np.zeros((n, 8), np.uint8),
            band_keys=band_keys_of(np.zeros((n, 8), np.uint8)),
        )
        with pytest.raises(StoreError, match="map full.*map_size") as exc:
            s.upsert(batch, band_keys_of)
        assert not isinstance(exc.value, StoreUnavailable)
        assert s.count() == 1
        assert s.lookup(["big0", "small"]).tolist()[0] == -1
        s.ping()
        s.upsert(make_batch(["small2"], rng)[0], band_keys_of)  # still writable
        assert s.count() == 2
    finally:
        s.close()
