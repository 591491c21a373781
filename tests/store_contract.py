"""Backend-agnostic contract tests for :class:`index.store.Store`.

Every backend runs the same suite against the real thing (no mocks)::

    from store_contract import StoreContract

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

The tests only use the protocol. Besides the docstrings of ``index/store.py``
(notably: an upsert of an existing id allocates a fresh iid and retires the
old one everywhere), they pin down:

* ``delete`` counts each distinct existing id once (duplicates in the list too);
* ``scan`` of an optional field (``nrff``/``meta``) skips records without it;
* ``fetch``/``external_ids`` answer None for unknown iids, including -1 (what
  ``lookup`` gives for an unknown id);
* ``bucket_members`` lists a bucket twice if its key is asked for twice.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest
from gmmlsh.index.store.base import FIELDS, RecordBatch

N_BANDS = 4
BAND_BYTES = 2
SKETCH_BYTES = N_BANDS * BAND_BYTES
KEY_BYTES = 2 + BAND_BYTES
NRFF_DIM = 3


def band_keys_of(sketches: np.ndarray) -> np.ndarray:
    """Band key = 2-byte big-endian band number + that band's slice of the sketch."""
    sk = np.asarray(sketches, dtype=np.uint8).reshape(-1, N_BANDS, BAND_BYTES)
    band = np.arange(N_BANDS, dtype=">u2").view(np.uint8).reshape(1, N_BANDS, 2)
    return np.concatenate([np.broadcast_to(band, (sk.shape[0], N_BANDS, 2)), sk], axis=2)


def random_sketches(rng: np.random.Generator, n: int) -> np.ndarray:
    """Bytes in {0, 1}: only 4 keys per band, so buckets are shared by many records."""
    return rng.integers(0, 2, size=(n, SKETCH_BYTES), dtype=np.uint8)


def flip(sketches: np.ndarray) -> np.ndarray:
    """A sketch that differs from the given one in every band (so every band key changes)."""
    out = np.array(sketches, dtype=np.uint8, copy=True)
    out[:, ::BAND_BYTES] ^= 1
    return out


@dataclass
class Rec:
    vector: bytes
    sketch: bytes
    nrff: bytes | None
    meta: bytes | None

    def field(self, name: str) -> bytes | None:
        return getattr(self, name)


def make_batch(
    ids: list[str],
    rng: np.random.Generator,
    *,
    sketches: np.ndarray | None = None,
    nrff: bool = True,
    meta: bool | None = None,
    tag: str = "",
) -> tuple[RecordBatch, list[Rec]]:
    """A batch for these ids plus the records each row should leave behind.

    ``meta=None`` alternates JSON metadata and None; True/False: all or none.
    """
    n = len(ids)
    sk = random_sketches(rng, n) if sketches is None else np.asarray(sketches, dtype=np.uint8)
    vectors = [f"{ext}|{tag}|".encode() + rng.bytes(int(rng.integers(1, 40))) for ext in ids]
    nr = rng.standard_normal((n, NRFF_DIM)).astype(np.float32) if nrff else None
    if meta is None:
        metas = [json.dumps({"i": i, "tag": tag}).encode() if i % 2 == 0 else None for i in range(n)]
    elif meta:
        metas = [json.dumps({"i": i, "tag": tag}).encode() for i in range(n)]
    else:
        metas = None
    batch = RecordBatch(ids=list(ids), vectors=vectors, sketches=sk, band_keys=band_keys_of(sk), nrff=nr, meta=metas)
    recs = [
        Rec(
            vectors[i],
            sk[i].tobytes(),
            nr[i].tobytes() if nr is not None else None,
            metas[i] if metas is not None else None,
        )
        for i in range(n)
    ]
    return batch, recs


def empty_batch() -> RecordBatch:
    return RecordBatch(
        ids=[],
        vectors=[],
        sketches=np.empty((0, SKETCH_BYTES), np.uint8),
        band_keys=np.empty((0, N_BANDS, KEY_BYTES), np.uint8),
    )


class Model:
    """What the store should hold: external id → record."""

    def __init__(self) -> None:
        self.recs: dict[str, Rec] = {}

    def upsert(self, store, batch: RecordBatch, recs: list[Rec]) -> None:
        store.upsert(batch, band_keys_of)
        for ext, rec in zip(batch.ids, recs, strict=True):
            self.recs[ext] = rec  # later rows overwrite earlier ones: last wins

    def delete(self, store, ids: list[str]) -> int:
        expected = len({i for i in ids if i in self.recs})
        got = store.delete(ids, band_keys_of)
        for i in ids:
            self.recs.pop(i, None)
        assert got == expected
        return got


def expected_buckets(model: Model, iid_of: dict[str, int]) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = defaultdict(list)
    for ext, rec in model.recs.items():
        keys = band_keys_of(np.frombuffer(rec.sketch, dtype=np.uint8)[None])[0]
        for key in keys:
            out[key.tobytes()].append(iid_of[ext])
    return {k: sorted(v) for k, v in out.items()}


def assert_matches(store, model: Model, *, scan_batch: int = 7) -> dict[str, int]:
    """Check every read method against the model; returns ext id → iid."""
    ids = sorted(model.recs)
    assert store.count() == len(ids)
    iids = store.lookup(ids)
    assert iids.dtype == np.int64 and iids.shape == (len(ids),)
    assert (iids >= 0).all(), "a live id is missing from lookup"
    assert len(set(iids.tolist())) == len(ids), "two live ids share an internal id"
    bound = store.iid_bound()
    assert all(i < bound for i in iids.tolist())
    iid_of = dict(zip(ids, iids.tolist(), strict=True))
    assert store.external_ids(iids) == ids

    for field in FIELDS:
        got = store.fetch(iids, field)
        assert got == [model.recs[e].field(field) for e in ids], field
        scanned_iids, scanned = [], []
        for chunk_iids, blobs in store.scan(field, batch_size=scan_batch):
            assert chunk_iids.dtype == np.int64
            assert 0 < len(chunk_iids) == len(blobs) <= scan_batch
            scanned_iids += chunk_iids.tolist()
            scanned += blobs
        assert scanned_iids == sorted(scanned_iids), f"scan({field}) not in iid order"
        assert len(set(scanned_iids)) == len(scanned_iids)
        want = {iid_of[e]: model.recs[e].field(field) for e in ids if model.recs[e].field(field) is not None}
        assert dict(zip(scanned_iids, scanned, strict=True)) == want, field

    want_buckets = expected_buckets(model, iid_of)
    got_buckets = {}
    for key, members in store.scan_buckets():
        assert members.dtype == np.uint32
        assert key not in got_buckets, "scan_buckets yielded a key twice"
        got_buckets[bytes(key)] = sorted(members.tolist())
    assert got_buckets == want_buckets
    keys = list(want_buckets)
    members = store.bucket_members(keys)
    assert members.dtype == np.uint32
    assert sorted(members.tolist()) == sorted(i for k in keys for i in want_buckets[k])
    return iid_of


class StoreContract:
    """Mix into a ``Test*`` class that provides a ``store_factory`` fixture."""

    @pytest.fixture
    def store(self, store_factory):
        return store_factory()

    @pytest.fixture
    def rng(self) -> np.random.Generator:
        return np.random.default_rng(20240611)

    # --- configuration ------------------------------------------------------------
    def test_config_create_read_reinit(self, store):
        assert store.read_config() is None
        cfg = {"dim": 784, "bands": 64, "gamma": 0.5, "center": None, "extra": {"note": "ü", "list": [1, 2.5]}}
        assert store.init_config(cfg) == cfg
        assert store.read_config() == cfg
        other = dict(cfg, dim=10)
        assert store.init_config(other) == cfg, "re-init must return the stored config"
        assert store.read_config() == cfg

    def test_concurrent_init_config_agrees(self, store):
        results = [None] * 8

        def go(i):
            results[i] = store.init_config({"who": i})

        threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r == results[0] for r in results)
        assert store.read_config() == results[0]

    # --- empty inputs ---------------------------------------------------------------
    def test_empty_store_and_empty_inputs(self, store):
        assert store.count() == 0
        assert store.iid_bound() >= 0
        assert store.lookup(["nope"]).tolist() == [-1]
        empty = store.lookup([])
        assert empty.dtype == np.int64 and empty.shape == (0,)
        assert store.external_ids(np.array([], dtype=np.int64)) == []
        for field in FIELDS:
            assert store.fetch(np.array([], dtype=np.int64), field) == []
            assert list(store.scan(field)) == []
        m = store.bucket_members([])
        assert m.dtype == np.uint32 and m.shape == (0,)
        assert list(store.scan_buckets()) == []
        assert store.delete([], band_keys_of) == 0
        assert store.delete(["nope"], band_keys_of) == 0
        store.upsert(empty_batch(), band_keys_of)
        assert store.count() == 0
        store.ping()
        assert isinstance(store.info().get("kind"), str)

    # --- upsert & fetch ---------------------------------------------------------------
    def test_upsert_and_fetch_every_field(self, store, rng):
        model = Model()
        batch, recs = make_batch([f"a{i}" for i in range(20)], rng, meta=None)
        model.upsert(store, batch, recs)
        batch, recs = make_batch([f"b{i}" for i in range(5)], rng, nrff=False, meta=False)
        model.upsert(store, batch, recs)
        assert any(r.meta is None for r in model.recs.values())
        assert any(r.nrff is None for r in model.recs.values())
        assert_matches(store, model)
        iids = store.lookup(["a0", "b0"])
        assert store.fetch(iids, "nrff")[1] is None
        assert store.fetch(iids, "meta") == [model.recs["a0"].meta, None]

    def test_fetch_order_duplicates_and_unknown(self, store, rng):
        batch, recs = make_batch(["x", "y", "z"], rng)
        store.upsert(batch, band_keys_of)
        ix, iy, iz = store.lookup(["x", "y", "z"]).tolist()
        bound = store.iid_bound()
        q = np.array([iz, -1, ix, iz, bound + 1000, iy], dtype=np.int64)
        want = [recs[2].vector, None, recs[0].vector, recs[2].vector, None, recs[1].vector]
        assert store.fetch(q, "vector") == want
        assert store.fetch(q.astype(np.uint32)[[0, 2]], "vector") == [want[0], want[2]]
        assert store.external_ids(q) == ["z", None, "x", "z", None, "y"]
        assert store.ids_and_fetch(q, "vector") == (store.external_ids(q), want)
        assert store.ids_and_fetch(q[:0], "meta") == ([], [])
        _, token = store.allocated_since(None)
        epoch = store.news_and_epoch(token)[1]
        assert store.ids_fetch_and_news(q, "vector", token) == (store.external_ids(q), want, False, epoch)
        assert store.ids_fetch_and_news(q[:0], "meta", token)[:3] == ([], [], False)
        assert store.ids_fetch_and_news(q, "vector", None)[2]  # allocations since the start
        store.upsert(make_batch(["w"], rng)[0], band_keys_of)
        assert store.ids_fetch_and_news(q[:0], "meta", token)[2]

    def test_epoch_grows_with_every_retirement(self, store, rng):
        """What lets a reader trust its cached names: a replacement or a delete moves the
        epoch; a store that cannot count retirements says None everywhere."""
        batch, _ = make_batch(["a", "b", "c"], rng)
        store.upsert(batch, band_keys_of)
        _, token = store.allocated_since(None)
        news, e0 = store.news_and_epoch(token)
        if e0 is None:  # no retirement count (a Redis Cluster, an older layout): never cached
            assert store.ids_fetch_and_news(store.lookup(["a"]), "meta", token)[2:] == (False, None)
            return
        assert not news
        assert store.ids_fetch_and_news(store.lookup(["a"]), "meta", token)[2:] == (False, e0)
        store.upsert(make_batch(["b"], rng)[0], band_keys_of)  # b's old version dies
        news, e1 = store.news_and_epoch(token)
        assert news and e1 > e0
        store.delete(["c"], band_keys_of)
        e2 = store.news_and_epoch(token)[1]
        assert e2 > e1
        assert store.ids_fetch_and_news(store.lookup(["a"]), "meta", token)[2:] == (True, e2)
        store.delete(["no-such-id"], band_keys_of)
        assert store.news_and_epoch(token)[1] >= e2

    def test_lookup_order_duplicates_unicode(self, store, rng):
        ids = ["plain", "with space", "ünïcødé-ß-猫", "a/b:c{d}", "0"]
        batch, recs = make_batch(ids, rng)
        store.upsert(batch, band_keys_of)
        got = store.lookup(["0", "missing", "ünïcødé-ß-猫", "plain", "0"])
        assert got[1] == -1
        assert got[0] == got[4] >= 0
        assert store.external_ids(got[[2, 3]]) == ["ünïcødé-ß-猫", "plain"]
        model = Model()
        model.recs = dict(zip(ids, recs, strict=True))
        assert_matches(store, model)

    # --- buckets ------------------------------------------------------------------------
    def test_bucket_members_one_entry_per_band_hit(self, store, rng):
        model = Model()
        batch, recs = make_batch([f"v{i}" for i in range(60)], rng)
        model.upsert(store, batch, recs)
        iid_of = assert_matches(store, model)
        buckets = expected_buckets(model, iid_of)
        # The query's own L keys: every record hit once per band it shares.
        q = band_keys_of(random_sketches(rng, 1))[0]
        q_keys = [k.tobytes() for k in q]
        got = store.bucket_members(q_keys)
        want = sorted(i for k in q_keys for i in buckets.get(k, []))
        assert sorted(got.tolist()) == want
        # A record's own keys: it appears exactly L times.
        own = band_keys_of(np.frombuffer(recs[0].sketch, dtype=np.uint8)[None])[0]
        got = store.bucket_members([k.tobytes() for k in own]).tolist()
        assert got.count(iid_of["v0"]) == N_BANDS
        # Missing keys contribute nothing; a repeated key counts twice.
        missing = b"\xff\xff" + b"\x07" * BAND_BYTES
        key = q_keys[0]
        got = store.bucket_members([missing, key, key]).tolist()
        assert sorted(got) == sorted(buckets.get(key, []) * 2)
        assert store.bucket_members([missing]).tolist() == []

    def test_upsert_existing_id_replaces_bucket_entries(self, store, rng):
        model = Model()
        batch, recs = make_batch([f"r{i}" for i in range(30)], rng, meta=True)
        model.upsert(store, batch, recs)
        old_sketches = batch.sketches[:10]
        before = store.count()
        # Replace r0..r9 with sketches differing in every band, no nrff, no meta.
        batch2, recs2 = make_batch(
            [f"r{i}" for i in range(10)], rng, sketches=flip(old_sketches), nrff=False, meta=False, tag="v2"
        )
        model.upsert(store, batch2, recs2)
        assert store.count() == before
        iid_of = assert_matches(store, model)
        # None of r0..r9's old band keys still lists them.
        for i in range(10):
            old_keys = [k.tobytes() for k in band_keys_of(old_sketches[i : i + 1])[0]]
            assert iid_of[f"r{i}"] not in store.bucket_members(old_keys).tolist()
        # And replacing with identical content is a no-op for the buckets.
        model.upsert(store, batch2, recs2)
        assert_matches(store, model)

    def test_upsert_existing_id_gets_fresh_iid_and_retires_old(self, store, rng):
        model = Model()
        batch, recs = make_batch(["o1", "o2", "o3"], rng, meta=True)
        model.upsert(store, batch, recs)
        old = store.lookup(["o1", "o2", "o3"])
        batch2, recs2 = make_batch(["o2"], rng, sketches=flip(batch.sketches[1:2]), tag="v2")
        model.upsert(store, batch2, recs2)
        new = store.lookup(["o1", "o2", "o3"])
        assert new[0] == old[0] and new[2] == old[2], "untouched records keep their iid"
        assert new[1] != old[1], "a replaced record gets a fresh iid"
        assert new[1] not in old.tolist(), "iids are never reused"
        assert store.iid_bound() > int(new.max())
        retired = old[1:2]
        for field in FIELDS:
            assert store.fetch(retired, field) == [None], field
        assert store.external_ids(retired) == [None]
        assert all(int(retired[0]) not in m.tolist() for _, m in store.scan_buckets())
        old_keys = [k.tobytes() for k in batch.band_keys[1]]
        assert int(retired[0]) not in store.bucket_members(old_keys).tolist()
        assert store.count() == 3
        assert_matches(store, model)

    def test_duplicate_ids_in_one_batch_last_wins(self, store, rng):
        model = Model()
        batch, recs = make_batch(["keep", "dup"], rng)
        model.upsert(store, batch, recs)
        sk = random_sketches(rng, 4)
        sk[3] = flip(sk[1:2])[0]  # the winner's keys differ from the loser's in every band
        batch2, recs2 = make_batch(["dup", "new", "new2", "new"], rng, sketches=sk, tag="b2")
        # "dup" replaces an existing record; "new" appears twice.
        batch3, recs3 = make_batch(["dup"], rng, sketches=flip(sk[0:1]), tag="b3")
        merged = RecordBatch(
            ids=batch2.ids + batch3.ids,
            vectors=batch2.vectors + batch3.vectors,
            sketches=np.concatenate([batch2.sketches, batch3.sketches]),
            band_keys=np.concatenate([batch2.band_keys, batch3.band_keys]),
            nrff=np.concatenate([batch2.nrff, batch3.nrff]),
            meta=batch2.meta + batch3.meta,
        )
        model.upsert(store, merged, recs2 + recs3)
        assert store.count() == 4
        iid_of = assert_matches(store, model)
        assert store.fetch(np.array([iid_of["new"]]), "vector") == [recs2[3].vector]
        assert store.fetch(np.array([iid_of["dup"]]), "vector") == [recs3[0].vector]
        loser = [k.tobytes() for k in band_keys_of(sk[1:2])[0]]
        assert iid_of["new"] not in store.bucket_members(loser).tolist()

    # --- delete ------------------------------------------------------------------------
    def test_delete_removes_everywhere(self, store, rng):
        model = Model()
        batch, recs = make_batch([f"d{i}" for i in range(25)], rng)
        model.upsert(store, batch, recs)
        iid_of = assert_matches(store, model)
        gone = ["d3", "d7", "d11"]
        gone_iids = np.array([iid_of[g] for g in gone], dtype=np.int64)
        assert model.delete(store, gone + ["unknown", "d3"]) == 3
        assert store.lookup(gone).tolist() == [-1, -1, -1]
        for field in FIELDS:
            assert store.fetch(gone_iids, field) == [None, None, None]
        assert store.external_ids(gone_iids) == [None, None, None]
        keys = [k.tobytes() for k in band_keys_of(batch.sketches[[3, 7, 11]]).reshape(-1, KEY_BYTES)]
        members = set(store.bucket_members(keys).tolist())
        assert members.isdisjoint(gone_iids.tolist())
        assert_matches(store, model)
        assert model.delete(store, gone) == 0
        assert model.delete(store, list(model.recs)) == 22
        assert_matches(store, model)
        assert list(store.scan_buckets()) == []

    def test_delete_then_reinsert(self, store, rng):
        model = Model()
        batch, recs = make_batch(["p", "q"], rng)
        model.upsert(store, batch, recs)
        model.delete(store, ["p"])
        batch, recs = make_batch(["p"], rng, tag="again")
        model.upsert(store, batch, recs)
        assert_matches(store, model)

    # --- scans ---------------------------------------------------------------------------
    @pytest.mark.parametrize("batch_size", [1, 64, 4096])
    def test_scan_order_and_completeness(self, store, rng, batch_size):
        model = Model()
        for start in range(0, 300, 100):
            batch, recs = make_batch([f"s{i:03d}" for i in range(start, start + 100)], rng)
            model.upsert(store, batch, recs)
        model.delete(store, [f"s{i:03d}" for i in range(0, 300, 7)])
        iid_of = assert_matches(store, model, scan_batch=batch_size)
        chunks = list(store.scan("vector", batch_size=batch_size))
        assert all(len(c[0]) == batch_size for c in chunks[:-1])
        assert sum(len(c[0]) for c in chunks) == len(model.recs)
        assert sorted(iid_of.values()) == [i for c in chunks for i in c[0].tolist()]

    def test_scan_buckets_agrees_with_bucket_members(self, store, rng):
        model = Model()
        batch, recs = make_batch([f"k{i}" for i in range(80)], rng)
        model.upsert(store, batch, recs)
        model.delete(store, ["k1", "k2"])
        seen = 0
        for key, members in store.scan_buckets():
            assert len(members) > 0
            assert sorted(store.bucket_members([key]).tolist()) == sorted(members.tolist())
            seen += len(members)
        assert seen == N_BANDS * store.count()

    # --- bookkeeping --------------------------------------------------------------------
    def test_count_exact_after_mixed_ops(self, store, rng):
        model = Model()
        universe = [f"m{i}" for i in range(120)]
        for round_ in range(8):
            ids = list(rng.choice(universe, size=int(rng.integers(1, 40)), replace=True))
            batch, recs = make_batch(ids, rng, nrff=bool(round_ % 2), meta=None, tag=str(round_))
            model.upsert(store, batch, recs)
            assert store.count() == len(model.recs)
            victims = list(rng.choice(universe, size=int(rng.integers(0, 15)), replace=True))
            model.delete(store, victims)
            assert store.count() == len(model.recs)
        assert_matches(store, model)

    def test_iid_bound_exceeds_every_iid(self, store, rng):
        batch, _ = make_batch([f"i{i}" for i in range(50)], rng)
        store.upsert(batch, band_keys_of)
        store.delete([f"i{i}" for i in range(0, 50, 2)], band_keys_of)
        batch, _ = make_batch([f"i{i}" for i in range(40, 60)], rng)
        store.upsert(batch, band_keys_of)
        iids = store.lookup([f"i{i}" for i in range(1, 60, 2)])
        assert (iids >= 0).all()
        assert int(iids.max()) < store.iid_bound()
        scanned = [i for c, _ in store.scan("sketch") for i in c.tolist()]
        assert max(scanned) < store.iid_bound()

    def test_allocated_since_reports_every_new_iid(self, store, rng):
        """A reader following the feed sees every live iid exactly once, whatever the order."""
        seen: set[int] = set()
        token = None
        for round_ in range(4):
            ids = [f"a{round_}-{i}" for i in range(37)] + [f"a0-{i}" for i in range(0, 37, 5)]  # new + replaced
            batch, _ = make_batch(ids, rng)
            store.upsert(batch, band_keys_of)
            new, token = store.allocated_since(token)
            assert len(set(new.tolist())) == len(new), "an iid was reported twice"
            assert seen.isdisjoint(new.tolist()), "an old iid was reported again"
            seen |= set(new.tolist())
            live = store.lookup(ids)
            assert set(live.tolist()) <= seen
        again, token2 = store.allocated_since(token)
        assert again.shape[0] == 0

    def test_external_ids_round_trip(self, store, rng):
        ids = [f"e{i}" for i in range(40)]
        batch, _ = make_batch(ids, rng)
        store.upsert(batch, band_keys_of)
        iids = store.lookup(ids)
        perm = rng.permutation(len(ids))
        assert store.external_ids(iids[perm]) == [ids[p] for p in perm]
        assert store.external_ids(iids.astype(np.uint32)) == ids

    def test_concurrent_readers_and_writer(self, store, rng):
        """Reads from several threads while one thread writes: no errors, no torn blobs."""
        model = Model()
        batch, recs = make_batch([f"c{i}" for i in range(50)], rng)
        model.upsert(store, batch, recs)
        batches = [make_batch([f"c{i}" for i in range(j, j + 50)], rng, tag=f"w{j}") for j in range(0, 100, 10)]
        errors: list[BaseException] = []
        stop = threading.Event()
        written = {f"c{i}": set() for i in range(150)}
        for b, _ in [(batch, recs)] + batches:
            for ext, vec in zip(b.ids, b.vectors, strict=True):
                written[ext].add(vec)

        def reader():
            try:
                while not stop.is_set():
                    ids = [f"c{i}" for i in range(0, 150, 3)]
                    iids = store.lookup(ids)
                    live = iids >= 0
                    vecs = store.fetch(iids[live], "vector")
                    for ext, vec in zip(np.array(ids)[live].tolist(), vecs, strict=True):
                        assert vec is None or vec in written[ext], "torn or foreign blob"
                    store.bucket_members([k.tobytes() for k in batch.band_keys[0]])
                    store.count()
            except BaseException as e:  # reported to the main thread
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for b, r in batches:
                model.upsert(store, b, r)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[0]
        assert_matches(store, model)
