"""Backend-agnostic contract tests for :class:`gmmlsh.index.store.base.Store`.

Every backend runs the same suite against the real thing (no mocks)::

    class TestMyStoreContract(StoreContract):
        @pytest.fixture
        def store_factory(self, tmp_path):
            made = []
            def make():
                made.append(MyStore(...))     # a fresh, EMPTY store each call
                return made[-1]
            yield make
            for s in made:
                s.close()

The tests use only the protocol (its docstrings are the specification).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from gmmlsh.index.store.base import FIELDS, RecordBatch

SKETCH_BYTES = 8
NRFF_DIM = 3


def make_batch(ids: list[str], rng: np.random.Generator, *, nrff: bool = True, meta: bool | None = None,
               tag: str = "") -> tuple[RecordBatch, list[dict]]:
    """A batch for these ids plus the record each row should leave behind (field → bytes or None).

    ``meta=None`` alternates JSON metadata and none; True/False: all or none.
    """
    n = len(ids)
    sk = rng.integers(0, 256, size=(n, SKETCH_BYTES), dtype=np.uint8)
    vectors = [f"{e}|{tag}|".encode() + rng.bytes(int(rng.integers(1, 40))) for e in ids]
    nr = rng.standard_normal((n, NRFF_DIM)).astype(np.float32) if nrff else None
    if meta is None:
        metas = [json.dumps({"i": i, "tag": tag}).encode() if i % 2 == 0 else None for i in range(n)]
    else:
        metas = [json.dumps({"i": i, "tag": tag}).encode() for i in range(n)] if meta else None
    batch = RecordBatch(ids=list(ids), vectors=vectors, sketches=sk, nrff=nr, meta=metas)
    recs = [{"name": ids[i].encode(), "vector": vectors[i], "sketch": sk[i].tobytes(),
             "nrff": nr[i].tobytes() if nr is not None else None,
             "meta": metas[i] if metas is not None else None} for i in range(n)]
    return batch, recs


def read_all(store, iids) -> list[dict]:
    got = store.read(np.asarray(iids, dtype=np.int64), FIELDS)
    return [{f: got[f][p] for f in FIELDS} for p in range(len(iids))]


class StoreContract:
    @pytest.fixture
    def store_factory(self):  # pragma: no cover - every backend overrides it
        raise NotImplementedError

    @pytest.fixture
    def store(self, store_factory):
        return store_factory()

    @pytest.fixture
    def rng(self):
        return np.random.default_rng(3)

    def test_empty_store(self, store):
        assert store.read_config() is None
        assert store.count() == 0
        assert store.lookup(["a", "b"]).tolist() == [-1, -1]
        ch = store.changes(None)
        assert ch.added.shape[0] == 0 and ch.retired.shape[0] == 0
        assert list(store.scan(FIELDS)) == [] and list(store.scan_ids()) == []

    def test_config_is_check_and_set(self, store):
        first = store.init_config({"dim": 4, "k": 8})
        assert first["dim"] == 4
        again = store.init_config({"dim": 99, "k": 8})
        assert again["dim"] == 4 and store.read_config()["dim"] == 4

    def test_round_trip_of_every_field(self, store, rng):
        batch, recs = make_batch(["a", "b", "c", "d"], rng)
        store.write(batch)
        iids = store.lookup(["a", "b", "c", "d"])
        assert (iids >= 0).all() and len(set(iids.tolist())) == 4
        assert read_all(store, iids) == recs
        assert store.count() == 4

    def test_absent_optional_fields_and_unknown_iids_read_as_none(self, store, rng):
        batch, _ = make_batch(["a", "b"], rng, nrff=False, meta=False)
        store.write(batch)
        got = read_all(store, [*store.lookup(["a", "b"]).tolist(), -1, 12345678])
        assert got[0]["nrff"] is None and got[0]["meta"] is None
        assert all(v is None for r in got[2:] for v in r.values())

    def test_a_write_says_under_which_iid_each_row_was_stored(self, store, rng):
        """``Written.iids`` (what lets a process put its own write into its mirror without reading
        it back) agrees with the id map: new ids, replacements, an id given twice (its earlier row
        was not stored: -1); the records stored are the batch's rows as ``stored`` gives them."""
        store.write(make_batch([f"w{i}" for i in range(100)], rng)[0])
        ids = [f"w{i}" for i in range(50, 250)] + ["w60"]
        batch = make_batch(ids, rng)[0]
        written = store.write(batch)
        last = batch.last_rows()
        assert written.iids.shape == (len(ids),) and (np.delete(written.iids, last) == -1).all()
        np.testing.assert_array_equal(written.iids[last], store.lookup([ids[r] for r in last]))
        assert read_all(store, written.iids[last]) == [batch.stored(r) for r in last]

    def test_upsert_retires_the_old_version(self, store, rng):
        b1, _ = make_batch(["a", "b"], rng, tag="one")
        store.write(b1)
        old = int(store.lookup(["a"])[0])
        b2, recs2 = make_batch(["a"], rng, tag="two")
        store.write(b2)
        new = int(store.lookup(["a"])[0])
        assert new != old and store.count() == 2
        assert all(v is None for v in read_all(store, [old])[0].values())
        assert read_all(store, [new])[0] == recs2[0]

    def test_last_occurrence_in_a_batch_wins(self, store, rng):
        batch, recs = make_batch(["a", "b", "a"], rng)
        store.write(batch)
        assert store.count() == 2
        assert read_all(store, store.lookup(["a"]))[0] == recs[2]

    def test_delete_counts_each_existing_id_once(self, store, rng):
        batch, _ = make_batch(["a", "b", "c"], rng)
        store.write(batch)
        old = int(store.lookup(["b"])[0])
        assert store.delete(["b", "b", "nope", "c"]) == 2
        assert store.count() == 1 and store.lookup(["b", "c"]).tolist() == [-1, -1]
        assert all(v is None for v in read_all(store, [old])[0].values())
        assert store.delete([]) == 0 and store.delete(["b"]) == 0

    def test_the_feed_tells_what_changed(self, store, rng):
        t0 = store.token()
        assert store.token() == t0
        b1, _ = make_batch(["a", "b", "c"], rng)
        store.write(b1)
        t1 = store.token()
        assert t1 != t0 and store.token() == t1
        ch = store.changes(t0)
        first = set(store.lookup(["a", "b", "c"]).tolist())
        assert set(ch.added.tolist()) == first and ch.retired.shape[0] == 0 and ch.token == t1
        assert ch.added.tolist() == sorted(ch.added.tolist())
        old_a = int(store.lookup(["a"])[0])
        b2, _ = make_batch(["a", "d"], rng)
        store.write(b2)
        store.delete(["b"])
        ch2 = store.changes(t1)
        assert set(ch2.added.tolist()) == set(store.lookup(["a", "d"]).tolist())
        assert sorted(ch2.retired.tolist()) == sorted([old_a, *(set(first) - {old_a} - set(store.lookup(["c"])
                                                                                             .tolist()))])
        assert store.changes(ch2.token).added.shape[0] == 0
        assert set(store.changes(None).added.tolist()) >= first | set(store.lookup(["a", "d"]).tolist())
        assert store.changes(None).retired.shape[0] == 0

    def test_scan_lists_every_record_in_iid_order(self, store, rng):
        batch, _ = make_batch([f"v{i}" for i in range(50)], rng)
        store.write(batch)
        store.delete([f"v{i}" for i in range(0, 50, 5)])
        seen: list[int] = []
        for iids, cols in store.scan(FIELDS, batch_size=7):
            assert len(iids) <= 7 and set(cols) == set(FIELDS)
            for p, iid in enumerate(iids.tolist()):
                assert cols["name"][p] is not None and cols["vector"][p] is not None
                assert store.lookup([cols["name"][p].decode()])[0] == iid
            seen += iids.tolist()
        assert seen == sorted(seen) and len(seen) == 40 == store.count()
        names = [n for chunk, _ in store.scan_ids(batch_size=9) for n in chunk]
        assert sorted(names) == sorted(f"v{i}" for i in range(50) if i % 5)

    def test_concurrent_writers_lose_nothing(self, store, rng):
        batches = [make_batch([f"t{t}-{i}" for i in range(40)], np.random.default_rng(t))[0] for t in range(4)]
        threads = [threading.Thread(target=store.write, args=(b,)) for b in batches]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert store.count() == 160
        assert (store.lookup([f"t{t}-{i}" for t in range(4) for i in range(40)]) >= 0).all()
