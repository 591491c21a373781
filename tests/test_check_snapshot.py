"""`gmmlsh check` finds every kind of corruption, and `gmmlsh snapshot` makes a restorable copy.

Each corruption is written straight into the real store (LMDB named databases,
Redis hashes) behind the index's back, the way a bug, a bad restore or a hand
edit would leave it; the check must name it, and the CLI must exit 1 with a
readable report. Clean indexes of both backends, and a Redis index whose
writer died mid-batch (journaled, invisible leftovers), must pass.
"""

from __future__ import annotations

import itertools
import json
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest
import redis
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.store.base import StoreUnavailable
from gmmlsh.index.store.lmdb import LmdbStore
from gmmlsh.index.store.redis import RedisStore, _groups_of
from gmmlsh.service.cli import main
from redis_fixtures import redis_url  # noqa: F401  (session fixture)
from test_crash import record

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


class Corrupter:
    """Writes into a store behind the index's back (one backend's key layout)."""

    def __init__(self, ix: Index):
        self.ix = ix
        self.store = ix.store

    def iid(self, ext: str) -> int:
        return int(self.store.lookup([ext])[0])

    def keys_of(self, iid: int) -> list[bytes]:
        sk = np.frombuffer(self.store.fetch(np.array([iid]), "sketch")[0], np.uint8)[None, :]
        return [bytes(k) for k in self.ix.banding.keys_from_sketches(sk)[0]]


class LmdbCorrupter(Corrupter):
    def _txn(self) -> lmdb.Transaction:
        return self.store._env.begin(write=True)

    @staticmethod
    def _be(iid: int) -> bytes:
        return struct.pack(">I", iid)

    def set_blob(self, iid: int, field: str, blob: bytes | None) -> None:
        with self._txn() as txn:
            db = self.store._fields[field]
            if blob is None:
                txn.delete(self._be(iid), db=db)
            else:
                txn.put(self._be(iid), blob, db=db)

    def get_blob(self, iid: int, field: str) -> bytes:
        return self.store.fetch(np.array([iid]), field)[0]

    def bucket(self, key: bytes, iid: int, add: bool) -> bool:
        with self._txn() as txn:
            val = struct.pack("=I", iid)
            if add:
                return txn.put(key, val, db=self.store._buckets, dupdata=True)
            return txn.delete(key, val, db=self.store._buckets)

    def add_count(self, d: int) -> None:
        with self._txn() as txn:
            live = struct.unpack("<Q", txn.get(b"live", db=self.store._counters))[0]
            txn.put(b"live", struct.pack("<Q", live + d), db=self.store._counters)

    def set_id(self, ext: str, iid: int | None) -> None:
        with self._txn() as txn:
            if iid is None:
                txn.delete(ext.encode(), db=self.store._ext2iid)
            else:
                txn.put(ext.encode(), self._be(iid), db=self.store._ext2iid)

    def drop_name(self, iid: int) -> None:
        with self._txn() as txn:
            txn.delete(self._be(iid), db=self.store._iid2ext)

    def duplicate_bucket_entry(self, key: bytes, iid: int) -> bool:
        """LMDB's dupsort keeps one copy of a (key, value) pair: the put succeeds, stores nothing."""
        return self.bucket(key, iid, add=True)


class RedisCorrupter(Corrupter):
    _FAM = {"vector": "v", "sketch": "k", "nrff": "f", "meta": "m"}

    def __init__(self, ix: Index):
        super().__init__(ix)
        self.r = redis.Redis.from_url(self.store.url)
        self.lay = self.store._get_layout(create=False)

    def _loc(self, iid: int, fam: str) -> tuple[str, int]:
        s, c, f = (int(x[0]) for x in self.store._locs(np.array([iid]), fam, self.lay))
        return f"{self.store._tag(s)}{fam}:{c}", f

    def set_blob(self, iid: int, field: str, blob: bytes | None) -> None:
        key, f = self._loc(iid, self._FAM[field])
        if blob is None:
            self.r.hdel(key, f)
        else:
            self.r.hset(key, f, blob)

    def get_blob(self, iid: int, field: str) -> bytes:
        key, f = self._loc(iid, self._FAM[field])
        return self.r.hget(key, f)

    def _group(self, key: bytes) -> bytes:
        t = int(_groups_of(np.frombuffer(key, np.uint8)[None, :], self.lay["groups"])[0])
        return self.store._group_key(t)

    def bucket(self, key: bytes, iid: int, add: bool) -> bool:
        g = self._group(key)
        raw = self.r.hget(g, key)
        spilled = self.store._spill_key(g, key) if raw == b"" else None  # its own key
        if spilled is not None:
            raw = self.r.get(spilled)
        cur = np.frombuffer(raw or b"", "<u4")
        new = np.append(cur, np.uint32(iid)) if add else cur[cur != iid]
        if new.size:
            if spilled is not None:
                self.r.set(spilled, new.astype("<u4").tobytes())
            else:
                self.r.hset(g, key, new.astype("<u4").tobytes())
        else:
            self.r.hdel(g, key)
            if spilled is not None:
                self.r.delete(spilled)
        return True

    def add_count(self, d: int) -> None:
        self.r.incrby(self.store._shard_keys(0)[3], d)

    def set_id(self, ext: str, iid: int | None) -> None:
        from gmmlsh.index.store.redis import _shard_of

        key = self.store._shard_keys(_shard_of(ext, self.lay["shards"]))[0]
        if iid is None:
            self.r.hdel(key, ext)
        else:
            self.r.hset(key, ext, iid)

    def drop_name(self, iid: int) -> None:
        key, f = self._loc(iid, "x")
        self.r.hdel(key, f)

    def duplicate_bucket_entry(self, key: bytes, iid: int) -> bool:
        return self.bucket(key, iid, add=True)


BACKENDS = ["lmdb", "redis"]
_detected: dict[str, int] = {"lmdb": 0, "redis": 0}


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    yield
    if any(_detected.values()):
        record("check-corruptions", kinds=len(CORRUPTIONS), detected_lmdb=_detected["lmdb"],
               detected_redis=_detected["redis"])


@pytest.fixture(params=BACKENDS)
def index(request, tmp_path) -> Iterator[tuple[Index, Corrupter, list[str]]]:
    """A small filled index, a corrupter for its store, and its CLI location options."""
    cfg = IndexConfig(dim=DIM, bands=8, rows=2)
    if request.param == "lmdb":
        loc, kw, cli = str(tmp_path / "idx"), {}, ["--index", str(tmp_path / "idx")]
    else:
        url = request.getfixturevalue("redis_url")
        prefix = f"chk{uuid.uuid4().hex[:10]}"
        # buckets past four iids live in their own keys: corruptions reach both forms
        loc, kw = url, {"prefix": prefix, "shards": 4, "spill_bytes": 16}
        cli = ["--redis", url, "--prefix", prefix]
    ix = Index.open(loc, cfg, **kw)
    _fill(ix)
    corr = LmdbCorrupter(ix) if request.param == "lmdb" else RedisCorrupter(ix)
    yield ix, corr, cli
    ix.close()


def _flip_first(blob: bytes, at: int = 0) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x5A
    return bytes(b)


#: (name, corruption, problem kind the check must report)
CORRUPTIONS: list[tuple[str, Callable[[Corrupter], None], str]] = [
    ("sketch deleted", lambda c: c.set_blob(c.iid("v40"), "sketch", None), "vector without a sketch"),
    ("sketch bits flipped", lambda c: c.set_blob(c.iid("v41"), "sketch", _flip_first(c.get_blob(c.iid("v41"),
                                                                                               "sketch"))),
     "stored sketch differs from a re-hash of the stored vector"),
    ("vector truncated", lambda c: c.set_blob(c.iid("v42"), "vector", c.get_blob(c.iid("v42"), "vector")[:-4]),
     "undecodable vector blob"),
    ("norm overwritten", lambda c: c.set_blob(c.iid("v43"), "vector",
                                              struct.pack("<d", 123.5) + c.get_blob(c.iid("v43"), "vector")[8:]),
     "stored L1 norm differs from the vector's"),
    ("bucket entry removed", lambda c: c.bucket(c.keys_of(c.iid("v44"))[3], c.iid("v44"), add=False),
     "missing bucket entry"),
    ("bucket entry for an unknown iid", lambda c: c.bucket(c.keys_of(c.iid("v45"))[0], 999_999, add=True),
     "bucket entry for an unknown or retired vector"),
    ("bucket entry in a wrong bucket", lambda c: c.bucket(_foreign_key(c, "v46", "v47"), c.iid("v47"), add=True),
     "bucket entry for an unknown or retired vector"),
    ("count off by one", lambda c: c.add_count(1), "count differs from a full scan"),
    ("id pointing at nothing", lambda c: c.set_id("ghost", 999_999), "id without a vector"),
    ("id map entry removed", lambda c: c.set_id("v48", None), "id does not map back to its vector"),
    ("reverse id removed", lambda c: c.drop_name(c.iid("v49")), "vector without an id"),
    ("two ids, one vector", lambda c: c.set_id("alias", c.iid("v50")), "two ids share one vector"),
    ("metadata not JSON", lambda c: c.set_blob(c.iid("v51"), "meta", b"{not json"), "metadata is not a JSON object"),
    ("blob of a deleted vector", lambda c: c.set_blob(_retired_iid(c), "meta", b"{}"), "meta blob without a vector"),
]


def _foreign_key(c: Corrupter, owner: str, other: str) -> bytes:
    """A band key of ``owner`` that ``other`` does not have (so ``other`` must not be in it)."""
    theirs = set(c.keys_of(c.iid(other)))
    return next(k for k in c.keys_of(c.iid(owner)) if k not in theirs)


def _retired_iid(c: Corrupter) -> int:
    """An iid that was live once (below the store's bound) and is now retired."""
    iid = c.iid("v52")
    c.ix.delete(["v52"])
    return iid


def test_clean_indexes_pass_check_and_cli(index):
    ix, _, cli = index
    rep = ix.check()
    assert rep.ok, rep.summary()
    assert (rep.vectors, rep.ids, rep.bucket_entries) == (N - 10, N - 10, (N - 10) * 8)
    assert rep.leftovers == 0 and not any(rep.journal.values())
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


def test_duplicate_bucket_entry(index):
    """Redis packs a bucket into one string, so a repeated iid is possible and must be found;
    LMDB's dupsort database cannot hold the same (key, iid) twice."""
    ix, corr, _ = index
    key = corr.keys_of(corr.iid("v60"))[2]
    corr.duplicate_bucket_entry(key, corr.iid("v60"))
    rep = ix.check()
    if isinstance(ix.store, LmdbStore):
        assert rep.ok and rep.bucket_entries == (N - 10) * 8, rep.summary()
    else:
        assert "duplicate bucket entry" in rep.problems, rep.summary()


def test_redis_interrupted_writer_leaves_only_invisible_leftovers(redis_url, monkeypatch, capsys):  # noqa: F811
    """A writer dying between its bucket writes and its commit: the check passes (leftovers are
    journaled and never visible), notes them, and --collect-garbage removes them."""
    prefix = f"gc{uuid.uuid4().hex[:10]}"
    ix = Index.open(redis_url, IndexConfig(dim=DIM, bands=8, rows=2), prefix=prefix, shards=4,
                    spill_bytes=16)  # buckets past four iids in their own keys: both forms
    try:
        _fill(ix)
        real = ix.store._pipeline
        calls = itertools.count(1)

        def dying(cmds):
            if next(calls) == 3:  # begin, bucket adds, then the commit never happens
                raise redis.exceptions.ConnectionError("writer died")
            return real(cmds)

        monkeypatch.setattr(ix.store, "_pipeline", dying)
        with pytest.raises(StoreUnavailable):
            ix.upsert([f"new{i}" for i in range(10)] + ["v1"], _data(1)[:11])
        monkeypatch.setattr(ix.store, "_pipeline", real)
        for i in range(10):
            assert not ix.contains(f"new{i}")
        assert ix.get("v1") is not None
        rep = ix.check()
        assert rep.ok, rep.summary()
        assert rep.leftovers == 11 * 8 and rep.journal["pending_attempts"] == 11
        assert "invisible to queries" in rep.summary()
        time.sleep(1.1)  # attempts are timed in whole seconds
        cli = ["--redis", redis_url, "--prefix", prefix]
        assert main(["check", *cli, "--collect-garbage", "--older-than", "0"]) == 0
        out = capsys.readouterr().out
        assert "expired_attempts 11" in out
        rep = ix.check()
        assert rep.ok and rep.leftovers == 0 and rep.journal == {"pending_attempts": 0, "dead_iids": 0}
    finally:
        ix.close()


# --- snapshots -------------------------------------------------------------------------------


def test_snapshot_is_consistent_restorable_and_answers_identically(tmp_path, capsys):
    loc = tmp_path / "idx"
    with Index.open(str(loc), IndexConfig(dim=DIM, bands=8, rows=2)) as ix:
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
                for q in Q for m in ("lsh", "exact")]
        want_get = ix.get("v3")
    snap = tmp_path / "snap"
    assert sorted(p.name for p in snap.iterdir() if not p.name.startswith(".")) == ["data.mdb", "lock.mdb"]
    assert not list(tmp_path.glob(".snap.partial-*"))
    # restore = serve the copy in place of the index
    restored = tmp_path / "restored"
    snap.rename(restored)
    assert main(["check", "--index", str(restored)]) == 0
    with Index.open(str(restored), None, create=False) as ix:
        assert ix.count() == 190 and not ix.contains("later")
        got = ix.get("v3")
        np.testing.assert_array_equal(got.values, want_get.values)
        assert got.metadata == want_get.metadata
        ix.upsert(["later"], _data(2)[:1])  # the restored index is writable and whole again
        got = [[(n.id, n.similarity) for n in ix.query(q, k=5, mode=m).neighbors]
               for q in Q for m in ("lsh", "exact")]
    assert got == want


def test_snapshot_while_writers_run_holds_whole_batches(tmp_path):
    """A hot copy taken during a stream of batch writes holds a prefix of whole batches."""
    import threading

    loc = tmp_path / "idx"
    X = _data(4)
    batch = 20
    with Index.open(str(loc), IndexConfig(dim=DIM, bands=8, rows=2)) as ix:
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


def test_snapshot_of_redis_points_to_redis_tools(redis_url, capsys):  # noqa: F811
    assert main(["snapshot", "--redis", redis_url, str(Path("/nonexistent/never-written"))]) == 2
    err = capsys.readouterr().err
    assert "BGSAVE" in err and "README" in err
    with Index.open(redis_url, IndexConfig(dim=DIM), prefix=f"s{uuid.uuid4().hex[:8]}") as ix, \
            pytest.raises(NotImplementedError, match="BGSAVE"):
        ix.snapshot("/nonexistent/never-written")


def test_redis_store_has_no_snapshot():
    assert not hasattr(RedisStore, "snapshot")
