"""The Redis backend against real servers: the shared store contract (one server and a local
3-master Cluster) plus what only a shared, networked store has to get right — prefixes, other
processes, a server SIGKILLed mid-batch, connection loss and reconnection, memory."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import redis
from gmmlsh.index.store import redis as redis_store
from gmmlsh.index.store.base import FIELDS, RecordBatch, StoreError, StoreUnavailable
from gmmlsh.index.store.redis import RedisStore, mask_url
from redis_fixtures import (  # noqa: F401  (fixtures are found by name)
    RedisServer,
    free_port,
    redis_cluster_url,
    redis_prefix,
    redis_server,
    redis_url,
)
from store_contract import (
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
_prefixes = itertools.count()


def _factory(url: str, tag: str, **kw):
    made: list[RedisStore] = []

    def make() -> RedisStore:
        made.append(RedisStore(url, prefix=f"c{os.getpid()}{tag}{next(_prefixes)}", **kw))
        return made[-1]

    return made, make


class TestRedisContract(StoreContract):
    @pytest.fixture
    def store_factory(self, redis_url):  # noqa: F811
        made, make = _factory(redis_url, "s")
        yield make
        for s in made:
            s.close()


class TestRedisClusterContract(StoreContract):
    @pytest.fixture
    def store_factory(self, redis_cluster_url):  # noqa: F811
        made, make = _factory(redis_cluster_url, "k", cluster=True)
        yield make
        for s in made:
            s.close()


class TestRedisSmallChunksContract(StoreContract):
    """Few shards and tiny write chunks: every code path that splits work gets exercised;
    buckets of more than two iids spill into their own keys."""

    @pytest.fixture
    def store_factory(self, redis_url):  # noqa: F811
        made, make = _factory(redis_url, "t", shards=3, bucket_groups=5, write_chunk=7,
                              spill_bytes=8)
        yield make
        for s in made:
            s.close()


class TestRedisTinyCallsContract(StoreContract):
    """Bucket script calls of a few buckets, groups cut into segments of two: the framing
    of calls that span several groups, and of groups that span several calls. Every
    bucket of two or more iids is spilled."""

    @pytest.fixture
    def store_factory(self, redis_url, monkeypatch):  # noqa: F811
        monkeypatch.setattr(redis_store, "_CALL_BUCKETS", 3)
        monkeypatch.setattr(redis_store, "_GROUP_CALL_KEYS", 2)
        made, make = _factory(redis_url, "y", bucket_groups=7, spill_bytes=4)
        yield make
        for s in made:
            s.close()


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


def raw_client(url: str, cluster: bool = False):
    if cluster:
        return redis.RedisCluster.from_url(url)
    return redis.Redis.from_url(url)


def journal_sizes(store: RedisStore) -> tuple[int, int]:
    """(pending write attempts, dead iids awaiting clean-up) over all shards."""
    lay = store._get_layout(create=False)
    if lay is None:
        return 0, 0
    r = store._r()
    pend = gc = 0
    for s in range(lay["shards"]):
        _, pend_k, gc_k, _, _ = store._shard_keys(s)
        pend += r.hlen(pend_k)
        gc += r.hlen(gc_k)
    return pend, gc


def assert_consistent(store: RedisStore, *, complete: bool = True) -> dict[str, int]:
    """Whatever is visible is whole: each live id has all its blobs and all its bucket entries.

    With ``complete``, also: no bucket entry names anything but a live iid (no stale
    entries), and no journal entries are left.
    """
    n = store.count()
    live: dict[int, bytes] = {}
    for iids, sks in store.scan("sketch", batch_size=1000):
        live.update(zip(iids.tolist(), sks, strict=True))
    assert len(live) == n, "count() disagrees with the records present"
    iids = np.array(sorted(live), dtype=np.int64)
    exts = store.external_ids(iids)
    assert None not in exts
    assert (store.lookup(exts) == iids).all(), "id map and records disagree"
    assert None not in store.fetch(iids, "vector"), "a visible vector lacks its blob"
    want: dict[bytes, set[int]] = defaultdict(set)
    if len(iids):
        keys = band_keys_of(np.stack([np.frombuffer(live[i], np.uint8) for i in iids.tolist()]))
        for i, row in zip(iids.tolist(), keys, strict=True):
            for k in row:
                want[k.tobytes()].add(i)
    got: dict[bytes, list[int]] = {}
    for key, members in store.scan_buckets():
        got[bytes(key)] = members.tolist()
    for key, members in want.items():
        assert members <= set(got.get(key, [])), "a visible vector lacks a bucket entry"
    if complete:
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
        assert journal_sizes(store) == (0, 0)
    return dict(zip(exts, iids.tolist(), strict=True))


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS_DIR)]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


WRITER = """
import sys, numpy as np
from store_contract import make_batch, band_keys_of
from gmmlsh.index.store.redis import RedisStore
url, prefix, tag, lo, hi, step, seed = sys.argv[1:8]
lo, hi, step = int(lo), int(hi), int(step)
st = RedisStore(url, prefix=prefix, write_chunk=int(sys.argv[8]) if len(sys.argv) > 8 else 2048)
rng = np.random.default_rng(int(seed))
for a in range(lo, hi, step):
    batch, _ = make_batch([f"id{i}" for i in range(a, min(hi, a + step))], rng, tag=tag)
    st.upsert(batch, band_keys_of)
print("done", st.count())
"""


# --- prefixes, layout, URLs ------------------------------------------------------------------


def test_prefixes_isolate_indexes_on_one_server(redis_url, redis_prefix, rng):  # noqa: F811
    a = RedisStore(redis_url, prefix=redis_prefix + "A")
    b = RedisStore(redis_url, prefix=redis_prefix + "B")
    ma, mb = Model(), Model()
    ba, ra = make_batch([f"x{i}" for i in range(30)], rng, tag="A")
    bb, rb = make_batch([f"x{i}" for i in range(20)], rng, tag="B")
    ma.upsert(a, ba, ra)
    mb.upsert(b, bb, rb)
    a.init_config({"which": "A"})
    assert b.read_config() is None
    mb.delete(b, ["x1", "x2"])
    assert_matches(a, ma)
    assert_matches(b, mb)
    assert a.count() == 30 and b.count() == 18
    a.close()
    b.close()


def test_bad_prefix_and_url_rejected():
    for bad in ["", "a:b", "a{b}", "sp ace", "x" * 65]:
        with pytest.raises(ValueError, match="prefix"):
            RedisStore("redis://127.0.0.1:1", prefix=bad)
    with pytest.raises(ValueError, match="url"):
        RedisStore("http://127.0.0.1:1")


def test_mask_url():
    assert mask_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert mask_url("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert mask_url("redis://h:6379") == "redis://h:6379"


def test_layout_is_fixed_by_the_first_writer(redis_url, redis_prefix, rng):  # noqa: F811
    first = RedisStore(redis_url, prefix=redis_prefix, shards=5, bucket_groups=7)
    batch, recs = make_batch([f"l{i}" for i in range(40)], rng)
    model = Model()
    model.upsert(first, batch, recs)
    later = RedisStore(redis_url, prefix=redis_prefix)  # other defaults: the stored layout wins
    assert later.info()["shards"] == 5 and later.info()["bucket_groups"] == 7
    assert_matches(later, model)
    first.close()
    later.close()


def test_reads_are_one_round_trip(redis_url, redis_prefix, rng, monkeypatch):  # noqa: F811
    st = RedisStore(redis_url, prefix=redis_prefix)
    batch, _ = make_batch([f"q{i}" for i in range(500)], rng)
    st.upsert(batch, band_keys_of)
    iids = st.lookup([f"q{i}" for i in range(500)])
    calls = []
    real = st._pipeline
    monkeypatch.setattr(st, "_pipeline", lambda cmds: calls.append(len(cmds)) or real(cmds))
    keys = [k.tobytes() for k in batch.band_keys[:8].reshape(-1, batch.band_keys.shape[2])]
    assert len(st.bucket_members(keys)) >= 8 * N_BANDS
    assert len(calls) == 1
    for field in ("vector", "sketch"):
        assert None not in st.fetch(iids, field)
    assert None not in st.external_ids(iids)
    assert len(calls) == 4, "fetch/external_ids of 500 records: one round trip each"
    names, metas = st.ids_and_fetch(iids, "meta")
    assert names == [f"q{i}" for i in range(500)] and len(metas) == 500
    assert len(calls) == 5, "ids_and_fetch (a query's answer): one round trip for both"
    st.close()


# --- processes --------------------------------------------------------------------------------


def test_two_processes_share_one_index(redis_url, redis_prefix, rng):  # noqa: F811
    st = RedisStore(redis_url, prefix=redis_prefix)
    res = run_py(WRITER, redis_url, redis_prefix, "p", "0", "300", "100", "1")
    assert res.returncode == 0, res.stderr
    assert st.count() == 300
    # ... and the other way round: what this process writes, a new process reads.
    batch, _ = make_batch(["mine"], rng)
    st.upsert(batch, band_keys_of)
    res = run_py("""
        import sys
        from gmmlsh.index.store.redis import RedisStore
        st = RedisStore(sys.argv[1], prefix=sys.argv[2])
        print(st.count(), st.fetch(st.lookup(["mine"]), "vector")[0][:4])
    """, redis_url, redis_prefix)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["301", repr(b"mine")]
    assert_consistent(st)
    st.close()


def test_concurrent_writer_processes_lose_nothing(redis_url, redis_prefix):  # noqa: F811
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), redis_url,
                               redis_prefix, f"w{w}", str(w * 1500), str((w + 1) * 1500), "50",
                               str(w)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{TESTS_DIR}"))
             for w in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
    st = RedisStore(redis_url, prefix=redis_prefix)
    assert st.count() == 3000
    assert (st.lookup([f"id{i}" for i in range(3000)]) >= 0).all()
    assert_consistent(st)
    st.close()


def test_concurrent_writers_of_the_same_ids_stay_consistent(redis_url, redis_prefix):  # noqa: F811
    """Two processes replace the same 400 ids at once: one version of each survives, cleanly."""
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), redis_url,
                               redis_prefix, f"w{w}", "0", "400", "40", str(w), "13"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{TESTS_DIR}"))
             for w in range(2) for _round in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
    st = RedisStore(redis_url, prefix=redis_prefix)
    assert st.count() == 400
    iid_of = assert_consistent(st)
    tags = {v.split(b"|")[1] for v in st.fetch(np.array(list(iid_of.values())), "vector")}
    assert tags <= {b"w0", b"w1"}
    st.close()


# --- crashes ------------------------------------------------------------------------------------


def test_server_sigkilled_mid_batch_then_retry_completes(redis_server, redis_prefix):  # noqa: F811
    """SIGKILL redis-server during a big upsert; restart from its AOF (appendfsync always)."""
    n = 12000
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    # A first version of some ids, so the crashed batch also replaces records.
    res = run_py(WRITER, redis_server.url, redis_prefix, "old", "0", "3000", "3000", "5")
    assert res.returncode == 0, res.stderr
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), redis_server.url,
                               redis_prefix, "new", "0", str(n), str(n), "6", "200"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{TESTS_DIR}"))
    try:
        probe = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 60
        # Kill once the batch is well under way (some chunks committed, most not).
        while time.monotonic() < deadline:
            seqs = sum(int(probe.get(f"{{{redis_prefix}:{s}}}:seq") or 0) for s in range(64))
            if seqs >= 3000 + 2000:
                break
            assert writer.poll() is None, writer.communicate()
            time.sleep(0.005)
        redis_server.kill()
        out, err = writer.communicate(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(10)
    assert writer.returncode != 0, "the writer finished before the kill: nothing was tested"
    assert "StoreUnavailable" in err, err[-2000:]

    redis_server.start()
    visible = assert_consistent(store, complete=False)  # whole vectors only, maybe leftovers
    assert 3000 <= len(visible) < n
    versions = store.fetch(np.array(list(visible.values())), "vector")
    assert 0 < sum(v.split(b"|")[1] == b"new" for v in versions) < n

    # Retry the same batch: completes, exact count, no stale entries, journals empty.
    rng = np.random.default_rng(6)
    batch, recs = make_batch([f"id{i}" for i in range(n)], rng, tag="new")
    store.upsert(batch, band_keys_of)
    assert store.count() == n
    assert_consistent(store)
    model = Model()
    model.recs = dict(zip(batch.ids, recs, strict=True))
    assert_matches(store, model, scan_batch=4096)
    store.close()


@contextlib.contextmanager
def _connection_lost_at(monkeypatch, store: RedisStore, round_trip: int):
    """The store's connection drops on the block's ``round_trip``-th round trip (a writer
    crashing there): the block must raise StoreUnavailable; the connection is back after."""
    real = store._pipeline
    calls = itertools.count(1)

    def dying(cmds):
        if next(calls) == round_trip:
            raise redis.exceptions.ConnectionError("simulated connection loss")
        return real(cmds)

    monkeypatch.setattr(store, "_pipeline", dying)
    try:
        with pytest.raises(StoreUnavailable):
            yield
    finally:
        monkeypatch.setattr(store, "_pipeline", real)


def _round_trips(monkeypatch, store: RedisStore, after=None) -> list[list[str]]:
    """Record the store's round trips, each as its commands' names (a script's by its
    name); ``after(names)`` runs once each round trip has returned."""
    trips: list[list[str]] = []
    real = store._pipeline
    names = {sha: name for name, sha in store._shas.items()}

    def recording(cmds):
        trips.append([names.get(c[1], c[0]) for c in cmds])
        out = real(cmds)
        if after is not None:
            after(trips[-1])
        return out

    monkeypatch.setattr(store, "_pipeline", recording)
    return trips


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4, 5])
def test_interrupted_upsert_at_every_step_recovers(redis_url, redis_prefix, rng, monkeypatch,  # noqa: F811
                                                   fail_at):
    """The connection dies before round trip ``fail_at`` of an upsert that replaces records."""
    store = RedisStore(redis_url, prefix=redis_prefix, shards=4)
    model = Model()
    batch, recs = make_batch([f"u{i}" for i in range(60)], rng, tag="v1")
    model.upsert(store, batch, recs)
    batch2, recs2 = make_batch([f"u{i}" for i in range(30, 90)], rng, tag="v2",
                               sketches=None)
    with _connection_lost_at(monkeypatch, store, fail_at):
        store.upsert(batch2, band_keys_of)
    visible = assert_consistent(store, complete=False)
    assert {f"u{i}" for i in range(60)} <= set(visible)
    store.upsert(batch2, band_keys_of)
    model.upsert(store, batch2, recs2)  # idempotent second upsert, as a retry would be
    assert_matches(store, model)
    assert_consistent(store)
    store.close()


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_interrupted_single_replacement_recovers(redis_url, redis_prefix, rng, monkeypatch,  # noqa: F811
                                                 fail_at):
    """The same for one record, which takes the one-script write (then the old version's
    bucket clean-up and the clearing of its journal entry: three round trips)."""
    store = RedisStore(redis_url, prefix=redis_prefix)
    model = Model()
    batch, recs = make_batch(["one"], rng, tag="v1")
    model.upsert(store, batch, recs)
    batch2, recs2 = make_batch(["one"], rng, tag="v2")
    with _connection_lost_at(monkeypatch, store, fail_at):
        store.upsert(batch2, band_keys_of)
    assert set(assert_consistent(store, complete=False)) == {"one"}
    model.upsert(store, batch2, recs2)  # the retry
    assert_matches(store, model)
    assert_consistent(store)
    store.close()


def test_a_single_delete_is_two_round_trips(redis_url, redis_prefix, rng, monkeypatch):  # noqa: F811
    """Iid and sketch, then record, bucket entries and journal entry in one script; an id
    replaced by another writer in between, or absent, takes the general path."""
    st = RedisStore(redis_url, prefix=redis_prefix, shards=3, spill_bytes=8)
    other = RedisStore(redis_url, prefix=redis_prefix)
    model = Model()
    batch, recs = make_batch([f"d{i}" for i in range(30)], rng)
    model.upsert(st, batch, recs)
    meddle: list[str] = []

    def meddling(names):
        if names == ["look1"] and meddle:  # another writer replaces the id right now
            b, r = make_batch([meddle.pop()], rng, tag="theirs")
            model.upsert(other, b, r)

    calls = _round_trips(monkeypatch, st, after=meddling)
    assert model.delete(st, ["d0"]) == 1
    assert calls == [["look1"], ["del1"]]
    assert_consistent(st, complete=True)
    calls.clear()
    meddle.append("d1")
    assert model.delete(st, ["d1"]) == 1  # the replacement is what got deleted
    assert calls[:2] == [["look1"], ["del1"]] and ["delete"] in calls[2:]
    assert model.delete(st, ["nope"]) == 0
    assert_matches(st, model)
    assert_consistent(st, complete=True)
    st.close()
    other.close()


@pytest.mark.parametrize("fail_at", [1, 2])
def test_interrupted_single_delete_recovers(redis_url, redis_prefix, rng, monkeypatch,  # noqa: F811
                                            fail_at):
    store = RedisStore(redis_url, prefix=redis_prefix, spill_bytes=8)
    model = Model()
    batch, recs = make_batch([f"d{i}" for i in range(20)], rng)
    model.upsert(store, batch, recs)
    with _connection_lost_at(monkeypatch, store, fail_at):
        store.delete(["d3"], band_keys_of)
    assert_consistent(store, complete=True)
    assert model.delete(store, ["d3"]) == 1
    assert_matches(store, model)
    assert_consistent(store, complete=True)
    store.close()


@pytest.mark.parametrize("fail_at", [2, 3])
def test_interrupted_delete_recovers(redis_url, redis_prefix, rng, monkeypatch, fail_at):  # noqa: F811
    store = RedisStore(redis_url, prefix=redis_prefix, shards=4)
    model = Model()
    batch, recs = make_batch([f"d{i}" for i in range(40)], rng)
    model.upsert(store, batch, recs)
    with _connection_lost_at(monkeypatch, store, fail_at):
        store.delete([f"d{i}" for i in range(10)], band_keys_of)
    assert_consistent(store, complete=False)
    store.delete([f"d{i}" for i in range(10)], band_keys_of)
    for i in range(10):
        model.recs.pop(f"d{i}")
    assert store.count() == 30
    # Clean-up of the interrupted delete's dead iids happens at the next write to the
    # shard, or explicitly:
    store.collect_garbage(band_keys_of)
    assert_matches(store, model)
    assert_consistent(store)
    store.close()


def test_abandoned_attempts_are_collected(redis_url, redis_prefix, rng, monkeypatch):  # noqa: F811
    """A writer that crashed and never retried: collect_garbage cancels its stale attempts."""
    store = RedisStore(redis_url, prefix=redis_prefix, shards=4)
    batch, _ = make_batch([f"g{i}" for i in range(20)], rng)
    with _connection_lost_at(monkeypatch, store, 3):
        store.upsert(batch, band_keys_of)
    assert store.count() == 0
    assert journal_sizes(store)[0] == 20
    assert sum(len(m) for _, m in store.scan_buckets()) == 20 * N_BANDS  # invisible leftovers
    assert store.collect_garbage(band_keys_of, pending_older_than=3600)["expired_attempts"] == 0
    time.sleep(1.1)
    got = store.collect_garbage(band_keys_of, pending_older_than=0)
    assert got["expired_attempts"] == 20
    assert list(store.scan_buckets()) == []
    assert journal_sizes(store) == (0, 0)
    store.close()


# --- connection loss ----------------------------------------------------------------------------


def test_connection_refused_is_quick_and_recovers(tmp_path, rng):
    port = free_port()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="down", socket_timeout=2)
    for call in (store.ping, store.count, lambda: store.lookup(["a"]),
                 lambda: store.bucket_members([b"\0\0ab"]), store.read_config):
        t = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
            call()
        assert time.monotonic() - t < 2.0
    with RedisServer(tmp_path / "r", port=port):
        store.ping()
        batch, _ = make_batch(["a", "b"], rng)
        store.upsert(batch, band_keys_of)
        assert store.count() == 2
    store.close()


def test_server_restart_same_store_reconnects(redis_server, redis_prefix, rng):  # noqa: F811
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    batch, _ = make_batch([f"r{i}" for i in range(50)], rng)
    store.upsert(batch, band_keys_of)
    redis_server.kill()
    with pytest.raises(StoreUnavailable):
        store.count()
    with pytest.raises(StoreUnavailable):
        store.upsert(batch, band_keys_of)
    redis_server.start()
    assert store.count() == 50  # acknowledged writes survived (appendfsync always)
    store.upsert(batch, band_keys_of)  # scripts are reloaded after the restart
    assert store.count() == 50
    assert_consistent(store)
    store.close()


def test_out_of_memory_is_unavailable_and_retry_completes(redis_server, redis_prefix, rng):  # noqa: F811
    """maxmemory reached mid-batch: a 503-class error, nothing half visible, retry completes."""
    store = RedisStore(redis_server.url, prefix=redis_prefix, write_chunk=500)
    model = Model()
    batch, recs = make_batch([f"m{i}" for i in range(200)], rng)
    model.upsert(store, batch, recs)
    r = redis.Redis.from_url(redis_server.url)
    r.config_set("maxmemory", r.info("memory")["used_memory"] + 300_000)
    big, big_recs = make_batch([f"m{i}" for i in range(100, 6000)], rng, tag="big")
    try:
        with pytest.raises(StoreUnavailable, match="OutOfMemoryError"):
            store.upsert(big, band_keys_of)
        assert_consistent(store, complete=False)
    finally:
        r.config_set("maxmemory", 0)
    model.upsert(store, big, big_recs)
    assert store.count() == 6000
    assert_matches(store, model)
    assert_consistent(store)
    r.close()
    store.close()


def test_errors_never_show_the_password(tmp_path, rng):
    secret = "s3cr3t-Pw"
    with RedisServer(tmp_path / "r", extra=["--requirepass", secret]) as srv:
        good = RedisStore(f"redis://:{secret}@127.0.0.1:{srv.port}/0", prefix="pw")
        good.ping()
        assert secret not in str(good.info()) and secret not in repr(good)
        wrong = RedisStore(f"redis://:{secret}x@127.0.0.1:{srv.port}/0", prefix="pw")
        with pytest.raises(StoreUnavailable) as e:
            wrong.ping()
        assert secret not in str(e.value)
        good.close()
        wrong.close()
    down = RedisStore(f"redis://:{secret}@127.0.0.1:{srv.port}/0", prefix="pw")
    with pytest.raises(StoreUnavailable) as e:
        down.count()
    assert secret not in str(e.value) and "***" in str(e.value)


def test_closed_store_raises(redis_url):  # noqa: F811
    store = RedisStore(redis_url, prefix="closed")
    store.ping()
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.count()


@pytest.mark.parametrize("spill_bytes", [8, 512])
def test_replayed_bucket_calls_add_and_remove_nothing_twice(redis_url, redis_prefix, rng,  # noqa: F811
                                                              monkeypatch, spill_bytes):
    """redis-py may resend a pipeline after a dropped connection: every bucket script
    (several groups per call here; also the one-script single-record write) runs twice,
    and no bucket holds an iid twice — spilled buckets (8 bytes: past two iids) included."""
    monkeypatch.setattr(redis_store, "_CALL_BUCKETS", 5)
    store = RedisStore(redis_url, prefix=redis_prefix, shards=3, bucket_groups=9,
                       spill_bytes=spill_bytes)
    real = store._pipeline
    bucket_shas = {store._shas[name] for name in ("badd", "brem", "badd+commit", "put1", "del1")}
    replayed = []

    def twice(cmds):
        if cmds and cmds[0][0] == "EVALSHA" and cmds[0][1] in bucket_shas:
            replayed.append(len(cmds))
            real(cmds)
        return real(cmds)

    monkeypatch.setattr(store, "_pipeline", twice)
    model = Model()
    batch, recs = make_batch([f"r{i}" for i in range(50)], rng, tag="v1")
    model.upsert(store, batch, recs)
    batch2, recs2 = make_batch([f"r{i}" for i in range(25, 75)], rng, tag="v2")
    model.upsert(store, batch2, recs2)  # replaces 25: their old entries are removed
    for i in range(3):  # single new ids: the bucket additions run inside the commit script
        one, one_recs = make_batch([f"one{i}"], rng)
        model.upsert(store, one, one_recs)
    assert model.delete(store, ["r0", "r30", "nope"]) == 2
    store.delete(["one1"], band_keys_of)  # alone: one script, whose replay finds it gone
    model.recs.pop("one1")
    assert len(replayed) >= 7 and max(replayed) < 50 * N_BANDS / 5  # calls span groups
    assert_matches(store, model)
    assert_consistent(store)
    if spill_bytes == 8:
        assert _spilled_keys(store), "nothing spilled: the spilled path went untested"
    store.close()


def _spilled_keys(store: RedisStore) -> list[bytes]:
    return list(store._r().scan_iter(match=b"{" + store._bucket_prefix + b"*", count=1000))


def test_receipts_one_per_bucket_call_and_they_expire(redis_url, redis_prefix, rng,  # noqa: F811
                                                      monkeypatch):
    """A receipt is what makes a replayed APPEND harmless; it must not outlive its use."""
    monkeypatch.setattr(redis_store, "_CALL_BUCKETS", 7)
    store = RedisStore(redis_url, prefix=redis_prefix, shards=3, bucket_groups=11,
                       socket_timeout=3.0)
    trips = _round_trips(monkeypatch, store)
    batch, _ = make_batch([f"r{i}" for i in range(40)], rng)
    store.upsert(batch, band_keys_of)
    one, _ = make_batch(["one"], rng)
    store.upsert(one, band_keys_of)
    calls = [n for trip in trips for n in trip if n in ("badd", "badd+commit")]
    r = store._r()
    receipts = list(r.scan_iter(match=store._receipt_prefix + b"*", count=1000))
    assert len(receipts) == len(calls) > 2
    ttls = [r.ttl(k) for k in receipts]
    assert all(0 < t <= 120 for t in ttls), ttls  # max(120 s, 10 × 3 s)
    store.close()


def test_spilled_buckets_empty_away_without_leftover_keys(redis_url, redis_prefix, rng):  # noqa: F811
    """Deleting every member of a spilled bucket drops its key and its marker."""
    store = RedisStore(redis_url, prefix=redis_prefix, shards=2, bucket_groups=3, spill_bytes=4)
    model = Model()
    batch, recs = make_batch([f"r{i}" for i in range(30)], rng)
    model.upsert(store, batch, recs)
    assert _spilled_keys(store)
    assert model.delete(store, [f"r{i}" for i in range(0, 30, 2)]) == 15
    assert_matches(store, model)
    assert_consistent(store, complete=True)
    assert model.delete(store, [f"r{i}" for i in range(1, 30, 2)]) == 15
    assert list(store.scan_buckets()) == [] and _spilled_keys(store) == []
    assert store._r().keys(store._bucket_prefix + b"*") == []
    store.close()


def test_a_version_3_layout_keeps_its_buckets_in_the_group_hashes(redis_url, redis_prefix,  # noqa: F811
                                                                 rng, monkeypatch):
    """An index written by the previous release is still written its way: no spilled keys
    (which its readers would not follow), no receipts, and replays still add nothing twice."""
    st = RedisStore(redis_url, prefix=redis_prefix, shards=3, bucket_groups=5, spill_bytes=4)
    r = st._r()
    r.set(st._layout_key, json.dumps({"version": 3, "shards": 3, "groups": 5, "chunk_big": 1024,
                                      "chunk_small": 128, "allocs": True, "retires": True}))
    real = st._pipeline
    monkeypatch.setattr(st, "_pipeline", lambda cmds: (real(cmds), real(cmds))[1]
                        if cmds and cmds[0][1] == st._shas["badd"] else real(cmds))
    model = Model()
    batch, recs = make_batch([f"v{i}" for i in range(40)], rng)
    model.upsert(st, batch, recs)
    assert model.delete(st, ["v3", "v4"]) == 2
    assert _spilled_keys(st) == [] and list(r.scan_iter(match=st._receipt_prefix + b"*")) == []
    assert_matches(st, model)
    assert_consistent(st)
    st.close()


def test_bad_batch_writes_nothing(redis_url, redis_prefix, rng):  # noqa: F811
    store = RedisStore(redis_url, prefix=redis_prefix)
    batch, _ = make_batch(["a", "b"], rng)
    bad = RecordBatch(batch.ids, batch.vectors[:1], batch.sketches, batch.band_keys)
    with pytest.raises(ValueError, match="vectors"):
        store.upsert(bad, band_keys_of)
    assert store.count() == 0 and list(store.scan_buckets()) == []
    with pytest.raises(ValueError, match="field"):
        store.fetch(np.array([0]), "nope")
    with pytest.raises(StoreError):
        raise StoreError("StoreError is the base of the store's failures")
    store.close()


# --- Cluster --------------------------------------------------------------------------------------


def test_cluster_autodetected_and_spread(redis_cluster_url, redis_prefix, rng):  # noqa: F811
    store = RedisStore(redis_cluster_url, prefix=redis_prefix)  # cluster=None: ask the server
    batch, recs = make_batch([f"k{i}" for i in range(300)], rng)
    model = Model()
    model.upsert(store, batch, recs)
    info = store.info()
    assert info["cluster"] is True and info["vectors"] == 300
    store.ping()
    r = raw_client(redis_cluster_url, cluster=True)
    per_node = [n.redis_connection.dbsize() for n in r.get_primaries()]
    assert len(per_node) == 3 and all(c > 0 for c in per_node), per_node
    assert_matches(store, model)
    assert_consistent(store)
    layout = json.loads(r.get(store._layout_key))
    assert layout["allocs"] is False and layout["retires"] is False  # no counters on a Cluster
    r.close()
    store.close()


def test_a_single_server_index_is_refused_by_a_cluster(redis_cluster_url, redis_prefix):  # noqa: F811
    """Its allocation counter cannot be kept by per-slot scripts: a Cluster writer would let
    single-server readers miss new vectors, so the layout is refused, not half-served."""
    store = RedisStore(redis_cluster_url, prefix=redis_prefix)
    store._r().set(store._layout_key, json.dumps({"version": 2, "shards": 64, "groups": 4096,
                                                  "chunk_big": 1024, "chunk_small": 128,
                                                  "allocs": True}))
    with pytest.raises(StoreError, match="created on a single server"):
        store.count()
    store.close()


# --- memory -----------------------------------------------------------------------------------------


def test_memory_per_vector_within_twice_the_raw_bytes(redis_server):  # noqa: F811
    """784-d float32 vectors with real 64×4×8-bit GCWS sketches: ≤ 2 × (vector + sketch) bytes."""
    from gmmlsh.core.gcws import bbit_codes, pack_codes, sketch
    from gmmlsh.index.banding import Banding
    from gmmlsh.index.codec import encode_dense

    n, dim = 3000, 784
    X = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    codes = bbit_codes(sketch(X.astype(np.float64), 256, 0), 8, 0)
    banding = Banding(64, 4, 8)
    batch = RecordBatch([f"vec-{i}" for i in range(n)], encode_dense(X, np.abs(X).sum(1)),
                        pack_codes(codes, 8), banding.keys_from_codes(codes))
    r = redis.Redis.from_url(redis_server.url)
    before = r.info("memory")["used_memory"]
    store = RedisStore(redis_server.url, prefix="mem")
    store.upsert(batch, banding.keys_from_sketches)
    per_vector = (r.info("memory")["used_memory"] - before) / n
    raw = dim * 4 + 256
    assert per_vector <= 2 * raw, f"{per_vector:.0f} B per vector; raw is {raw} B"
    store.close()
    r.close()


def test_fields_constant_matches_protocol():
    assert set(FIELDS) == {"vector", "sketch", "nrff", "meta"}
    assert flip is not None


# --- the server-wide allocation counter and the one-script small write ---------------------


def _seq_sum(store: RedisStore) -> int:
    return sum(store._shard_seqs(store._get_layout(create=False)["shards"]))


def test_allocation_counter_is_the_sum_of_the_shard_sequences(redis_url, redis_prefix, rng,  # noqa: F811
                                                              monkeypatch):
    """What a query's news check reads (one key) must move exactly when some shard's
    sequence does: after new ids, replacements, deletes and a crashed writer's attempt."""
    st = RedisStore(redis_url, prefix=redis_prefix, shards=7)
    model = Model()
    for round_ in range(3):
        batch, recs = make_batch([f"a{round_}-{i}" for i in range(60)] + [f"a0-{i}" for i in range(0, 60, 7)], rng)
        model.upsert(st, batch, recs)
        one, one_recs = make_batch([f"single{round_}"], rng)
        model.upsert(st, one, one_recs)
        model.delete(st, [f"a{round_}-{i}" for i in range(0, 60, 11)])
    # a writer that dies after begin: its iids are allocated, never committed
    ghost, _ = make_batch(["ghost", "ghost2"], rng)  # two: one record is one script
    with _connection_lost_at(monkeypatch, st, 2):
        st.upsert(ghost, band_keys_of)
    allocs = int(st._r().get(st._allocs_key))
    assert allocs == _seq_sum(st) > 0
    _, token = st.allocated_since(None)
    assert not st.ids_fetch_and_news(st.lookup(["single0"]), "meta", token)[2]
    other = RedisStore(redis_url, prefix=redis_prefix)  # another process's writer
    batch, recs = make_batch(["late"], rng)
    model.upsert(other, batch, recs)
    names, _, news, _ = st.ids_fetch_and_news(st.lookup(["single0"]), "meta", token)
    assert names == ["single0"] and news, "a vector added by another writer went unnoticed"
    assert int(st._r().get(st._allocs_key)) == _seq_sum(st)
    assert_matches(st, model)
    st.close()
    other.close()


def test_a_version_1_layout_checks_news_by_the_shard_sequences(redis_url, redis_prefix, rng):  # noqa: F811
    """An index written by a release without the counter: no ``allocs`` key is kept or read."""
    st = RedisStore(redis_url, prefix=redis_prefix, shards=5)
    r = st._r()
    r.set(st._layout_key, json.dumps({"version": 1, "shards": 5, "groups": 64,
                                      "chunk_big": 1024, "chunk_small": 128}))
    batch, recs = make_batch([f"v{i}" for i in range(30)], rng)
    model = Model()
    model.upsert(st, batch, recs)
    assert r.get(st._allocs_key) is None
    _, token = st.allocated_since(None)
    iids = st.lookup(["v1"])
    assert not st.ids_fetch_and_news(iids, "meta", token)[2]
    batch, recs = make_batch(["v-late"], rng)
    model.upsert(RedisStore(redis_url, prefix=redis_prefix), batch, recs)
    assert st.ids_fetch_and_news(iids, "meta", token)[2:] == (True, None)
    assert st.news_and_epoch(token) == (True, None)  # no retirement count: readers never cache names
    assert_matches(st, model)
    st.close()


def test_a_layout_from_a_newer_release_is_refused(redis_url, redis_prefix):  # noqa: F811
    st = RedisStore(redis_url, prefix=redis_prefix)
    st._r().set(st._layout_key, json.dumps({"version": 99, "shards": 5}))
    with pytest.raises(StoreError, match="layout version 99"):
        st.count()
    st.close()


def test_a_single_new_upsert_is_one_round_trip(redis_url, redis_prefix, rng, monkeypatch):  # noqa: F811
    """A single record on a single server is one script (iid, buckets, blobs, id); a batch
    over several shards keeps begin / buckets / commit. Both leave the same records and
    buckets, and a replacement's old buckets go too."""
    st = RedisStore(redis_url, prefix=redis_prefix)
    model = Model()
    warm, recs = make_batch(["w"], rng)
    model.upsert(st, warm, recs)
    calls = _round_trips(monkeypatch, st)
    one, recs = make_batch(["s1"], rng)
    model.upsert(st, one, recs)
    assert calls == [["put1"]]
    calls.clear()
    again, recs = make_batch(["s1"], rng)  # a replacement: the old iid's buckets go too
    model.upsert(st, again, recs)
    assert calls[0] == ["put1"] and len(calls) == 3
    assert_consistent(st)
    calls.clear()
    many, recs = make_batch([f"m{i}" for i in range(40)], rng)
    model.upsert(st, many, recs)
    assert calls[1][0] == "badd" and all(c == "commit" for c in calls[2])
    assert_matches(st, model)
    st.close()
