"""The Redis backend against real servers: the shared store contract (one server and a local
3-master Cluster) plus what only a shared, networked store has to get right — prefixes, other
processes, a server SIGKILLed mid-batch, connection loss and reconnection, memory, eviction."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import time
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import redis
from redis_fixtures import (  # noqa: F401  (fixtures are found by name)
    RedisServer,
    free_port,
    redis_cluster_url,
    redis_prefix,
    redis_server,
    redis_url,
)
from store_contract import StoreContract, make_batch, read_all

from gmmlsh.index.store.base import DiskFull, RecordBatch, StoreUnavailable
from gmmlsh.index.store.location import mask_url, scrub
from gmmlsh.index.store.redis import RedisStore
from gmmlsh.index.store.redis_layout import CHUNK_BIG as _CHUNK_BIG
from gmmlsh.index.store.redis_layout import CHUNK_SMALL as _CHUNK_SMALL
from gmmlsh.index.store.redis_layout import FAMILY as _FAMILY

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


class TestRedisOneShardContract(StoreContract):
    """One shard: every record in one script call."""

    @pytest.fixture
    def store_factory(self, redis_url):  # noqa: F811
        made, make = _factory(redis_url, "o", shards=1)
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


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


def assert_consistent(store: RedisStore) -> dict[str, int]:
    """Whatever is visible is whole: each id of the id map names a whole record that names it
    back, no field outlives its record, and the count is exact. Returns id → iid."""
    iid_of = {n: int(i) for names, iids in store.scan_ids() for n, i in zip(names, iids, strict=True)}
    records = {}
    for iids, cols in store.scan(["name", "vector", "sketch"]):
        for p, iid in enumerate(iids.tolist()):
            records[iid] = (cols["name"][p], cols["vector"][p], cols["sketch"][p])
    assert all(v is not None for rec in records.values() for v in rec), "a partial record"
    assert {n.encode(): i for n, i in iid_of.items()} == {rec[0]: iid for iid, rec in records.items()}
    assert store.count() == len(iid_of)
    return iid_of


WRITER = """
import sys, numpy as np
from store_contract import make_batch
from gmmlsh.index.store.redis import RedisStore
url, prefix, tag, lo, hi, step, seed = sys.argv[1:8]
lo, hi, step = int(lo), int(hi), int(step)
st = RedisStore(url, prefix=prefix)
rng = np.random.default_rng(int(seed))
for a in range(lo, hi, step):
    st.write(make_batch([f"id{i}" for i in range(a, min(hi, a + step))], rng, tag=tag)[0])
print("done", st.count())
"""


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS_DIR)]))


def _writer(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), *args], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _count_round_trips(monkeypatch, store: RedisStore) -> list[int]:
    calls: list[int] = []
    real = store._pipeline
    monkeypatch.setattr(store, "_pipeline", lambda cmds, *a, **kw: calls.append(len(cmds)) or real(cmds, *a, **kw))
    r = store._r()
    real_mget = r.mget
    monkeypatch.setattr(r, "mget", lambda *a, **kw: calls.append(1) or real_mget(*a, **kw))
    return calls


# --- prefixes, shards, URLs ------------------------------------------------------------------


def test_prefixes_isolate_indexes_on_one_server(redis_url, redis_prefix, rng):  # noqa: F811
    a = RedisStore(redis_url, prefix=redis_prefix + "A")
    b = RedisStore(redis_url, prefix=redis_prefix + "B")
    a.write(make_batch([f"x{i}" for i in range(30)], rng, tag="A")[0])
    b.write(make_batch([f"x{i}" for i in range(20)], rng, tag="B")[0])
    a.init_config({"which": "A"})
    assert b.read_config() is None
    b.delete(["x1", "x2"])
    assert a.count() == 30 and b.count() == 18
    assert all(r["vector"].split(b"|")[1] == b"A" for r in read_all(a, a.lookup([f"x{i}" for i in range(30)])))
    assert_consistent(a)
    assert_consistent(b)
    a.close()
    b.close()


def test_bad_prefix_and_url_rejected():
    for bad in ["", "a:b", "a{b}", "sp ace", "x" * 129]:
        with pytest.raises(ValueError, match="prefix"):
            RedisStore("redis://127.0.0.1:1", prefix=bad)
    with pytest.raises(ValueError, match="url"):
        RedisStore("http://127.0.0.1:1")


def test_mask_url():
    assert mask_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert mask_url("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert mask_url("redis://h:6379") == "redis://h:6379"
    assert scrub("auth s3cret and s3%cret failed", "redis://:s3%25cret@h/0") == "auth s3cret and *** failed"
    assert scrub("auth s3cret failed", "redis://:s3cret@h/0") == "auth *** failed"
    assert scrub("auth s3cret failed", None) == "auth s3cret failed"


def test_the_key_location_rule_of_the_lua_scripts_is_the_python_one(redis_url, redis_prefix):  # noqa: F811
    """lua/shard.lua's ``loc``, run in Redis, puts every field of every record where
    RedisStore._loc does (the scripts write and delete there, the reads look there)."""
    store = RedisStore(redis_url, prefix=redis_prefix, shards=5)
    S, s = 5, 3
    iids = [seq * S + s for seq in (0, 1, 127, 128, 129, 1023, 1024, 1025, 70_000)]
    families = list("nvkfm")
    shard_lua = resources.files("gmmlsh.index.store").joinpath("lua", "shard.lua").read_text()
    probe = shard_lua + """
local out = {}
for _, fam in ipairs(FAMILIES) do out[#out + 1] = fam end
for j = 5, #ARGV do
  local seq = math.floor(tonumber(ARGV[j]) / S)
  for _, fam in ipairs(FAMILIES) do
    local k, f = loc(ARGV[4], seq, fam)
    out[#out + 1] = k; out[#out + 1] = f
  end
end
return out"""
    got = [x.decode() for x in store._r().eval(probe, 0, S, _CHUNK_BIG, _CHUNK_SMALL, store._tag(s), *iids)]
    assert got[:5] == families == list(_FAMILY.values())
    want = [part for iid in iids for fam in families for part in store._loc(iid, fam, S)]
    assert got[5:] == want
    store.close()


def test_the_shard_count_is_fixed_at_creation(redis_url, redis_prefix, rng):  # noqa: F811
    first = RedisStore(redis_url, prefix=redis_prefix, shards=5)
    first.init_config({"dim": 3})
    first.write(make_batch([f"l{i}" for i in range(40)], rng)[0])
    later = RedisStore(redis_url, prefix=redis_prefix)  # another default: the stored count wins
    assert later.info()["shards"] == 5 and len(later.token()) == 10
    assert read_all(later, later.lookup(["l3"])) == read_all(first, first.lookup(["l3"]))
    first.close()
    later.close()


def test_a_write_a_read_and_a_token_are_one_round_trip_each(redis_url, redis_prefix, rng,  # noqa: F811
                                                            monkeypatch):
    st = RedisStore(redis_url, prefix=redis_prefix)
    st.write(make_batch([f"q{i}" for i in range(50)], rng)[0])
    iids = st.lookup([f"q{i}" for i in range(500)])
    calls = _count_round_trips(monkeypatch, st)
    st.write(make_batch([f"q{i}" for i in range(300)], rng)[0])
    assert len(calls) == 1, "a batch over every shard: one pipeline"
    st.read(iids, ["name", "vector", "meta"])
    assert len(calls) == 2
    st.token()
    assert len(calls) == 3
    st.close()


def test_a_redis_write_is_in_its_own_mirror_when_it_returns_without_being_read_back(  # noqa: F811
        redis_url, redis_prefix, tmp_path, monkeypatch):  # noqa: F811
    """A process whose search mirror is in use applies its own Redis write before it returns,
    from the batch it holds, with the writes of other machines it finds (those read back): the
    next query here finds nothing to apply (issue 30). A process that only writes keeps no mirror."""
    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.index import Index

    X = np.random.default_rng(5).random((210, 8)).astype(np.float32)
    with (Index.open(redis_url, IndexConfig(dim=8), prefix=redis_prefix, cache_dir=tmp_path / "a",
                     maintain=False) as a,
          Index.open(redis_url, prefix=redis_prefix, cache_dir=tmp_path / "b", maintain=False) as b):
        a.upsert([f"v{i}" for i in range(200)], X[:200], [{"n": i} for i in range(200)])
        b.upsert(["v5", "w0"], X[200:202])  # another machine's writes, and b only writes
        b.delete(["v6"])
        assert a.mirror.refresh().token is None and b.mirror.refresh().token is None
        a.view()  # a's mirror in use from now on
        read: list[int] = []
        real = a.store.read
        monkeypatch.setattr(a.store, "read", lambda iids, fields: read.extend(np.asarray(iids).tolist())
                            or real(iids, fields))
        written = a.upsert(["v7", "w1", "w2", "w1", "v5"], X[202:207], [None, {"m": 1}, None, {"m": 2}, None])
        assert tuple(a.mirror.refresh().token) == a.store.token()
        assert read == []  # nothing to read back: b's writes were applied by a.view()
        b.upsert(["w3", "v8"], X[207:209])
        b.delete(["w2"])
        written = a.upsert(["v9", "w4"], X[[209, 0]])
        assert tuple(a.mirror.refresh().token) == a.store.token()
        assert sorted(read) == sorted(a.store.lookup(["w3", "v8"]).tolist())  # b's rows only
        assert not set(read) & set(written.iids.tolist())
        report = a.check()
        assert report.ok and report.mirror_behind == 0, report
        assert a.query(X[1], k=3, mode="exact").neighbors[0].id == "v1" and a.get("w1").metadata == {"m": 2}
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").rglob("state.json"))


# --- processes --------------------------------------------------------------------------------


def test_two_processes_share_one_index(redis_url, redis_prefix, rng):  # noqa: F811
    st = RedisStore(redis_url, prefix=redis_prefix)
    res = run_py(WRITER, redis_url, redis_prefix, "p", "0", "300", "100", "1")
    assert res.returncode == 0, res.stderr
    assert st.count() == 300
    st.write(make_batch(["mine"], rng)[0])
    res = run_py("""
        import sys
        from gmmlsh.index.store.redis import RedisStore
        st = RedisStore(sys.argv[1], prefix=sys.argv[2])
        print(st.count(), st.read(st.lookup(["mine"]), ["vector"])["vector"][0][:4])
    """, redis_url, redis_prefix)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["301", repr(b"mine")]
    assert_consistent(st)
    st.close()


def test_concurrent_writer_processes_lose_nothing(redis_url, redis_prefix):  # noqa: F811
    procs = [_writer(redis_url, redis_prefix, f"w{w}", str(w * 1500), str((w + 1) * 1500), "50", str(w))
             for w in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
    st = RedisStore(redis_url, prefix=redis_prefix)
    assert st.count() == 3000
    assert (st.lookup([f"id{i}" for i in range(3000)]) >= 0).all()
    assert_consistent(st)
    st.close()


def test_concurrent_writers_of_the_same_ids_stay_consistent(redis_url, redis_prefix):  # noqa: F811
    """Four processes replace the same 400 ids at once: one whole version of each survives."""
    procs = [_writer(redis_url, redis_prefix, f"w{w}", "0", "400", "40", str(w)) for w in range(2) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
    st = RedisStore(redis_url, prefix=redis_prefix)
    assert st.count() == 400
    iid_of = assert_consistent(st)
    tags = {r["vector"].split(b"|")[1] for r in read_all(st, list(iid_of.values()))}
    assert tags <= {b"w0", b"w1"}
    # every retired version is on the feed, and gone
    retired = st.changes(tuple(0 for _ in st.token())).retired
    assert retired.shape[0] == 4 * 400 - 400
    assert all(v is None for r in read_all(st, retired) for v in r.values())
    st.close()


# --- crashes ------------------------------------------------------------------------------------


def test_server_sigkilled_mid_batch_then_retry_completes(redis_server, redis_prefix):  # noqa: F811
    """SIGKILL redis-server during a stream of batches; restart it from its AOF (appendfsync
    always): whatever is visible is whole, and writing the same data again completes it."""
    n = 12000
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    res = run_py(WRITER, redis_server.url, redis_prefix, "old", "0", "3000", "3000", "5")
    assert res.returncode == 0, res.stderr
    writer = _writer(redis_server.url, redis_prefix, "new", "0", str(n), "200", "6")
    try:
        probe = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once the stream is well under way
            if sum(int(probe.get(f"{{{redis_prefix}:{s}}}:seq") or 0) for s in range(16)) >= 3000 + 2000:
                break
            assert writer.poll() is None, writer.communicate()
            time.sleep(0.005)
        redis_server.kill()
        _, err = writer.communicate(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(10)
    assert writer.returncode != 0, "the writer finished before the kill: nothing was tested"
    assert "StoreUnavailable" in err, err[-2000:]
    redis_server.start()
    visible = assert_consistent(store)
    assert 3000 <= len(visible) < n
    res = run_py(WRITER, redis_server.url, redis_prefix, "new", "0", str(n), "200", "6")  # the retry
    assert res.returncode == 0, res.stderr
    assert store.count() == n
    assert_consistent(store)
    store.close()


# --- connection loss, memory ----------------------------------------------------------------


def test_connection_refused_is_quick_and_recovers(tmp_path, rng):
    port = free_port()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="down", socket_timeout=2)
    for call in (store.ping, store.count, lambda: store.lookup(["a"]), store.token, store.read_config):
        t = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
            call()
        assert time.monotonic() - t < 2.0
    with RedisServer(tmp_path / "r", port=port):
        store.ping()
        store.write(make_batch(["a", "b"], rng)[0])
        assert store.count() == 2
    store.close()


def test_server_restart_same_store_reconnects(redis_server, redis_prefix, rng):  # noqa: F811
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    batch, _ = make_batch([f"r{i}" for i in range(50)], rng)
    store.write(batch)
    redis_server.kill()
    with pytest.raises(StoreUnavailable):
        store.count()
    with pytest.raises(StoreUnavailable):
        store.write(batch)
    redis_server.start()
    assert store.count() == 50  # acknowledged writes survived (appendfsync always)
    store.write(batch)  # scripts are loaded again after the restart
    assert store.count() == 50
    assert_consistent(store)
    store.close()


def test_out_of_memory_is_disk_full_and_a_retry_completes(redis_server, redis_prefix, rng):  # noqa: F811
    """maxmemory reached mid-stream (noeviction): 'Redis is out of memory', nothing half
    visible; once memory is raised the same write completes."""
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    store.write(make_batch([f"m{i}" for i in range(200)], rng)[0])
    r = redis.Redis.from_url(redis_server.url)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", r.info("memory")["used_memory"] + 300_000)
    big, _ = make_batch([f"m{i}" for i in range(100, 6000)], rng, tag="big")
    try:
        with pytest.raises(DiskFull, match="Redis is out of memory"):
            for lo in range(0, 5900, 500):
                store.write(RecordBatch(big.ids[lo:lo + 500], big.vectors[lo:lo + 500], big.sketches[lo:lo + 500],
                                        big.nrff[lo:lo + 500], big.meta[lo:lo + 500]))
        assert_consistent(store)
        assert "out of memory" in store.write_problem()  # what /health reports meanwhile
    finally:
        r.config_set("maxmemory", 0)
    assert store.write_problem() is None
    store.write(big)
    assert store.count() == 6000
    assert_consistent(store)
    r.close()
    store.close()


def test_a_batch_refused_for_memory_stores_nothing_of_it(redis_server, redis_prefix, rng):  # noqa: F811
    """Under maxmemory (noeviction) a batch is all or nothing: one script writes it, and Redis
    refuses a script's first write that needs memory. Its shards' parts used to be scripts of
    their own, and a refused batch had stored some of them (issue #35, item 16)."""
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    r = redis.Redis.from_url(redis_server.url)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", r.info("memory")["used_memory"] + 2_000_000)
    acknowledged, refused = 0, None
    try:
        for b in range(100):
            batch, _ = make_batch([f"b{b}-{i}" for i in range(200)], rng)
            try:
                store.write(batch)
                acknowledged += len(batch)
            except DiskFull:
                refused = batch
                break
        assert refused is not None, "maxmemory was never reached"
        assert store.count() == acknowledged
        assert (store.lookup(refused.ids) == -1).all()
        assert "out of memory" in store.write_problem()
        assert_consistent(store)
    finally:
        r.config_set("maxmemory", 0)
    assert store.write_problem() is None
    r.close()
    store.close()


def test_a_cluster_batch_refused_by_a_full_node_says_which_ids_it_stored(redis_cluster_url, redis_prefix,  # noqa: F811
                                                                          rng):
    """A Cluster writes a batch one id shard at a time (a script's keys share a slot): when one
    node is full, the other nodes' parts are stored, and the error names exactly those ids."""
    store = RedisStore(redis_cluster_url, prefix=redis_prefix, cluster=True)
    store.write(make_batch(["warm"], rng)[0])
    r = redis.RedisCluster.from_url(redis_cluster_url)
    full = r.get_primaries()[0]
    r.config_set("maxmemory-policy", "noeviction", target_nodes=full)
    r.config_set("maxmemory", 1, target_nodes=full)
    try:
        batch, _ = make_batch([f"x{i}" for i in range(300)], rng)
        with pytest.raises(DiskFull, match="were stored") as ei:
            store.write(batch)
    finally:
        r.config_set("maxmemory", 0, target_nodes=full)
    stored = set(ei.value.stored)
    assert 0 < len(stored) < 300
    found = store.lookup(batch.ids)
    assert {i for i, iid in zip(batch.ids, found.tolist(), strict=True) if iid >= 0} == stored
    assert store.count() == 1 + len(stored)
    assert_consistent(store)
    r.close()
    store.close()


def test_a_redis_that_may_evict_keys_is_refused_for_writes(redis_server, redis_prefix, rng):  # noqa: F811
    """An allkeys-* policy would drop acknowledged vectors (or the config) in silence."""
    r = redis.Redis.from_url(redis_server.url)
    r.config_set("maxmemory-policy", "allkeys-lru")
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    with pytest.raises(StoreUnavailable, match="maxmemory-policy allkeys-lru"):
        store.write(make_batch(["a"], rng)[0])
    assert "allkeys-lru" in store.eviction_problem() and "allkeys-lru" in store.write_problem()
    assert store.count() == 0
    r.config_set("maxmemory-policy", "noeviction")
    fresh = RedisStore(redis_server.url, prefix=redis_prefix)
    fresh.write(make_batch(["a"], rng)[0])
    assert fresh.count() == 1 and fresh.eviction_problem() is None and fresh.write_problem() is None
    r.close()
    store.close()
    fresh.close()


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


def test_cluster_autodetected_and_spread(redis_cluster_url, redis_prefix, rng):  # noqa: F811
    store = RedisStore(redis_cluster_url, prefix=redis_prefix)  # cluster=None: ask the server
    store.write(make_batch([f"k{i}" for i in range(300)], rng)[0])
    info = store.info()
    assert info["cluster"] is True and info["vectors"] == 300
    r = redis.RedisCluster.from_url(redis_cluster_url)
    per_node = [n.redis_connection.dbsize() for n in r.get_primaries()]
    assert len(per_node) == 3 and all(c > 0 for c in per_node), per_node
    assert_consistent(store)
    r.close()
    store.close()


def test_memory_per_vector_within_twice_the_raw_bytes(redis_server):  # noqa: F811
    """784-d float32 vectors with 512 8-bit GCWS codes: ≤ 2 × (vector + sketch) bytes in Redis."""
    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.records import prepare

    n, dim = 3000, 784
    X = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    batch = prepare(IndexConfig(dim=dim), [f"vec-{i}" for i in range(n)], X)
    r = redis.Redis.from_url(redis_server.url)
    before = r.info("memory")["used_memory"]
    store = RedisStore(redis_server.url, prefix="mem")
    store.write(batch)
    per_vector = (r.info("memory")["used_memory"] - before) / n
    raw = dim * 4 + batch.sketches.shape[1]
    assert per_vector <= 2 * raw, f"{per_vector:.0f} B per vector; raw is {raw} B"
    store.close()
    r.close()
