"""`gmmlsh check` finds every kind of corruption, and `gmmlsh snapshot` makes a restorable copy.

Each corruption is written straight into the real store (LMDB named databases, Redis
hashes) or into the search mirror's files, behind the index's back, the way a bug, a
bad restore or a hand edit would leave it; the check must name it, and the CLI must
exit 1 with a readable report. Clean indexes of both backends must pass.
"""

from __future__ import annotations

import json
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest
from redis_fixtures import redis_url  # noqa: F401  (session fixture)
from test_crash import record

from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.store.lmdb import pack_record, unpack_record
from gmmlsh.service.cli import main

DIM = 24
N = 200


def _data(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    X = rng.random((N, DIM))
    X[X < 0.4] = 0.0
    X[:, 0] += 0.1  # no all-zero rows
    return X


def _fill(ix: Index) -> None:
    X = _data()
    ix.upsert([f"v{i}" for i in range(N)], X, metadata=[{"i": i} for i in range(N)])
    ix.upsert([f"v{i}" for i in range(20)], X[:20] * 2 + 0.5)  # replacements retire old iids
    ix.delete([f"v{i}" for i in range(20, 30)])
    ix.view()  # the mirror is current


class Corrupter:
    """Writes into an index's store (one backend's layout) or its mirror, behind its back."""

    def __init__(self, ix: Index):
        self.ix = ix
        self.store = ix.store

    def iid(self, ext: str) -> int:
        return int(self.store.lookup([ext])[0])

    def get(self, iid: int, field: str) -> bytes:
        return self.store.read(np.array([iid]), [field])[field][0]

    # --- the mirror (the same files on every backend) ---------------------------------------------
    def row(self, ext: str) -> int:
        return self.ix.view().row_of(self.iid(ext))

    def mirror_column(self, name: str, dtype) -> np.memmap:
        return np.memmap(self.ix.mirror.dir / name, dtype=dtype, mode="r+")


class LmdbCorrupter(Corrupter):
    def _txn(self) -> lmdb.Transaction:
        return self.store._env.begin(write=True)

    @staticmethod
    def _be(iid: int) -> bytes:
        return iid.to_bytes(4, "big")

    def set(self, iid: int, field: str, blob: bytes | None) -> None:
        db = self.store._db["record"]
        with self._txn() as txn:
            rec = unpack_record(txn.get(self._be(iid), db=db))
            rec[field] = blob
            if all(v is None for v in rec.values()):
                txn.delete(self._be(iid), db=db)
            else:
                txn.put(self._be(iid), pack_record(rec), db=db)

    def add_count(self, d: int) -> None:
        with self._txn() as txn:
            nxt, live, retired = struct.unpack("<QQQ", txn.get(b"state", db=self.store._db["counters"]))
            txn.put(b"state", struct.pack("<QQQ", nxt, live + d, retired), db=self.store._db["counters"])

    def set_id(self, ext: str, iid: int | None) -> None:
        with self._txn() as txn:
            if iid is None:
                txn.delete(ext.encode(), db=self.store._db["ext2iid"])
            else:
                txn.put(ext.encode(), self._be(iid), db=self.store._db["ext2iid"])


class RedisCorrupter(Corrupter):
    """Raw commands on the Redis key layout, found through the store's own key helpers."""

    _FAMILY = {"name": "n", "vector": "v", "sketch": "k", "nrff": "f", "meta": "m"}

    def set(self, iid: int, field: str, blob: bytes | None) -> None:
        key, f = self.store._loc(iid, self._FAMILY[field], self.store.shards)
        r = self.store._r()
        r.hdel(key, f) if blob is None else r.hset(key, f, blob)

    def add_count(self, d: int) -> None:
        self.store._r().incrby(self.store._tag(0) + "live", d)

    def set_id(self, ext: str, iid: int | None) -> None:
        key = self.store._tag(self.store._shard_of(ext, self.store.shards)) + "ids"
        r = self.store._r()
        r.hdel(key, ext) if iid is None else r.hset(key, ext, iid)


BACKENDS = ["lmdb", "redis"]
_detected = {"lmdb": 0, "redis": 0}


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    yield
    if any(_detected.values()):
        record("check-corruptions", kinds=len(CORRUPTIONS), detected_lmdb=_detected["lmdb"],
               detected_redis=_detected["redis"])


@pytest.fixture(params=BACKENDS)
def index(request, tmp_path) -> Iterator[tuple[Index, Corrupter, list[str]]]:
    """A small filled index, a corrupter for its store, and its CLI location options."""
    cfg = IndexConfig(dim=DIM, samples=64)
    if request.param == "lmdb":
        loc, kw, cli = str(tmp_path / "idx"), {}, ["--index", str(tmp_path / "idx")]
    else:
        url = request.getfixturevalue("redis_url")
        prefix = f"chk{uuid.uuid4().hex[:10]}"
        loc, kw = url, {"prefix": prefix, "cache_dir": str(tmp_path / "cache")}
        cli = ["--redis", url, "--prefix", prefix, "--cache-dir", str(tmp_path / "cache")]
    ix = Index.open(loc, cfg, maintain=False, **kw)
    _fill(ix)
    corr = LmdbCorrupter(ix) if request.param == "lmdb" else RedisCorrupter(ix)
    yield ix, corr, cli
    ix.close()


def _flip_first(blob: bytes, at: int = 0) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x5A
    return bytes(b)


def _retired_iid(c: Corrupter) -> int:
    """An iid that was live once and is now retired."""
    iid = c.iid("v52")
    c.ix.delete(["v52"])
    c.ix.view()
    return iid


def _mirror_vector(c: Corrupter) -> None:
    row = c.row("v53")
    offs = c.mirror_column("vectors.off", np.int64)
    data = c.mirror_column("vectors.dat", np.float32)
    data[offs[row] + 2] += 1.0
    data.flush()


def _mirror_alive(c: Corrupter) -> None:
    iid = c.iid("v54")
    row = c.row("v54")
    c.ix.delete(["v54"])
    c.ix.delete(["v56"])  # a later sync: the state no longer names v54's row (views clear those themselves)
    c.ix.view()
    alive = c.mirror_column("alive.u1", np.uint8)
    assert alive[row] == 0 and iid >= 0
    alive[row] = 1
    alive.flush()
    c.ix.delete(["v57"])  # a new state: the view is read again, with the flags as they are on disk


def _mirror_planes(c: Corrupter) -> None:
    row = c.row("v55")
    planes = c.mirror_column("planes.u8", np.uint64)
    width = c.ix.config.bits * (c.ix.config.samples // 64)
    planes[row * width + 3] ^= np.uint64(0xFF)
    planes.flush()


#: (name, corruption, problem kind the check must report)
CORRUPTIONS: list[tuple[str, Callable[[Corrupter], None], str]] = [
    ("sketch deleted", lambda c: c.set(c.iid("v40"), "sketch", None), "partial record (a field without its record)"),
    ("sketch bits flipped", lambda c: c.set(c.iid("v41"), "sketch", _flip_first(c.get(c.iid("v41"), "sketch"))),
     "stored sketch differs from a re-hash of the stored vector"),
    ("vector truncated", lambda c: c.set(c.iid("v42"), "vector", c.get(c.iid("v42"), "vector")[:-4]),
     "undecodable vector"),
    ("norm overwritten", lambda c: c.set(c.iid("v43"), "vector",
                                         struct.pack("<d", 123.5) + c.get(c.iid("v43"), "vector")[8:]),
     "stored L1 norm differs from the vector's"),
    ("count off by one", lambda c: c.add_count(1), "count differs from a full scan"),
    ("id pointing at nothing", lambda c: c.set_id("ghost", 999_999), "id without a record"),
    ("id map entry removed", lambda c: c.set_id("v48", None), "record not named by the id map"),
    ("name removed", lambda c: c.set(c.iid("v49"), "name", None), "partial record (a field without its record)"),
    ("two ids, one record", lambda c: c.set_id("alias", c.iid("v50")), "two ids share one record"),
    ("metadata not JSON", lambda c: c.set(c.iid("v51"), "meta", b"{not json"), "metadata is not a JSON object"),
    ("field of a deleted vector", lambda c: c.set(_retired_iid(c), "meta", b"{}"),
     "partial record (a field without its record)"),
    ("mirror vector changed", _mirror_vector, "mirror: vector differs from the store's"),
    ("mirror row of a deleted vector alive", _mirror_alive, "mirror: live row of a retired or unknown record"),
    ("mirror sketch flipped", _mirror_planes, "mirror: sketch differs from the store's"),
]


def test_clean_indexes_pass_check_and_cli(index):
    ix, _, cli = index
    rep = ix.check()
    assert rep.ok, rep.summary()
    assert (rep.vectors, rep.ids) == (N - 10, N - 10) and rep.mirror_rows >= N - 10
    ix.close()  # one LMDB environment per process: the CLI opens its own
    assert main(["check", *cli]) == 0


@pytest.mark.parametrize("name,corrupt,kind", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_check_detects_corruption(index, name, corrupt, kind, capsys):
    ix, corr, cli = index
    assert ix.check().ok
    corrupt(corr)
    rep = ix.check()
    assert not rep.ok, f"{name}: not detected"
    assert kind in rep.problems, f"{name}: reported {rep.summary()}"
    ix.close()  # one LMDB environment per process: the CLI opens its own
    capsys.readouterr()
    assert main(["check", *cli]) == 1
    out = capsys.readouterr().out
    assert kind in out and "problem" in out
    assert main(["check", *cli, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and kind in data["problems"]
    _detected["redis" if "--redis" in cli else "lmdb"] += 1


def test_a_damaged_mirror_is_repaired_by_deleting_it(tmp_path):
    import shutil

    ix = Index.open(str(tmp_path / "idx"), IndexConfig(dim=DIM, samples=64), maintain=False)
    _fill(ix)
    _mirror_vector(LmdbCorrupter(ix))
    assert not ix.check().ok
    shutil.rmtree(ix.mirror.dir)
    ix.close()
    with Index.open(str(tmp_path / "idx"), maintain=False) as fresh:
        rep = fresh.check()
        assert rep.ok, rep.summary()


# --- snapshots -------------------------------------------------------------------------------


def test_snapshot_is_consistent_restorable_and_answers_identically(tmp_path, capsys):
    loc = tmp_path / "idx"
    with Index.open(str(loc), IndexConfig(dim=DIM, samples=64)) as ix:
        _fill(ix)
    assert main(["snapshot", "--index", str(loc), str(tmp_path / "snap"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "190 vectors" in out and "OK" in out
    # a second snapshot never overwrites
    assert main(["snapshot", "--index", str(loc), str(tmp_path / "snap")]) == 2
    with Index.open(str(loc), None, create=False) as ix:
        # writes after the snapshot are not in it
        ix.upsert(["later"], _data(2)[:1])
        Q = _data(3)[:10]
        want = [[(n.id, n.similarity) for n in ix.query(q, k=5, mode=m).neighbors]
                for q in Q for m in ("auto", "exact")]
        want_get = ix.get("v3")
    snap = tmp_path / "snap"
    # the store is copied; the mirror (derived) is rebuilt on first use
    assert {"data.mdb", "lock.mdb"} <= {p.name for p in snap.iterdir()}
    assert not list(tmp_path.glob(".snap.partial-*"))
    restored = tmp_path / "restored"  # restore = serve the copy in place of the index
    snap.rename(restored)
    assert main(["check", "--index", str(restored)]) == 0
    with Index.open(str(restored), None, create=False) as ix:
        assert ix.count() == 190 and not ix.contains("later")
        got = ix.get("v3")
        np.testing.assert_array_equal(got.values, want_get.values)
        assert got.metadata == want_get.metadata
        ix.upsert(["later"], _data(2)[:1])  # the restored index is writable and whole again
        got = [[(n.id, n.similarity) for n in ix.query(q, k=5, mode=m).neighbors]
               for q in Q for m in ("auto", "exact")]
    assert got == want


def test_snapshot_while_writers_run_holds_whole_batches(tmp_path):
    """A hot copy taken during a stream of batch writes holds a prefix of whole batches."""
    import threading

    loc = tmp_path / "idx"
    X = _data(4)
    batch = 20
    with Index.open(str(loc), IndexConfig(dim=DIM, samples=64)) as ix:
        stop = threading.Event()

        def writer() -> None:
            for b in range(200):
                if stop.is_set():
                    return
                ids = [f"b{b}-{j}" for j in range(batch)]
                ix.upsert(ids, X[(np.arange(batch) + b) % N])

        th = threading.Thread(target=writer)
        th.start()
        try:
            for s in range(3):
                time.sleep(0.05)
                ix.snapshot(tmp_path / f"snap{s}")
        finally:
            stop.set()
            th.join(60)
    for s in range(3):
        with Index.open(str(tmp_path / f"snap{s}"), None, create=False) as copy:
            rep = copy.check()
            assert rep.ok, rep.summary()
            n = copy.count()
            assert n % batch == 0
            assert all(copy.contains(f"b{b}-{j}") for b in range(n // batch) for j in (0, batch - 1))


def test_snapshot_of_redis_points_to_redis_tools(redis_url, tmp_path, capsys):  # noqa: F811
    assert main(["snapshot", "--redis", redis_url, str(Path("/nonexistent/never-written"))]) == 2
    err = capsys.readouterr().err
    assert "BGSAVE" in err and "README" in err
    with Index.open(redis_url, IndexConfig(dim=DIM), prefix=f"s{uuid.uuid4().hex[:8]}",
                    cache_dir=str(tmp_path / "c")) as ix, pytest.raises(NotImplementedError, match="BGSAVE"):
        ix.snapshot("/nonexistent/never-written")
