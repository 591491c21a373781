"""Writes that wait for Redis replicas (``wait``, Redis' ``WAIT``): against real masters and
replicas — one server with a replica, and a Cluster of 3 masters with a replica each.

A write is acknowledged only once the replica holds it: a replica read right after the write
returns finds it, a replica that cannot acknowledge makes the write fail with a message that
says so, and a failover then loses nothing that was acknowledged. On a Cluster the ``WAIT``
follows the scripts on each master's own connection, also after a slot moved under the store
(``MOVED``) or while it moves (``ASK``)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import redis
from redis_fixtures import REDIS_CLI, RedisCluster3, RedisServer
from store_contract import StoreContract, make_batch

from gmmlsh.index.store.base import StoreUnavailable
from gmmlsh.index.store.redis import RedisStore
from gmmlsh.index.store.redis_layout import shard_keys, shard_of
from gmmlsh.index.store.redis_wait import NotReplicated

_prefixes = itertools.count()
SHARDS = 16


def _prefix(tag: str) -> str:
    return f"w{os.getpid()}{tag}{next(_prefixes)}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """3 masters with a replica each (``nodes[:3]`` the masters), for this module."""
    c = RedisCluster3(tmp_path_factory.mktemp("wait-cluster"), replicas=1).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def master_and_replica(tmp_path):
    master = RedisServer(tmp_path / "master", appendfsync="everysec").start()
    replica = RedisServer(tmp_path / "replica", appendfsync="everysec",
                          extra=["--replicaof", "127.0.0.1", str(master.port)]).start()
    try:
        _until(lambda: _link_up(replica.port), "the replica to sync")
        yield master, replica
    finally:
        for s in (replica, master):
            if s.proc is not None:
                os.kill(s.proc.pid, signal.SIGCONT)
            s.stop()


def _until(ok, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout} s for {what}")


def _link_up(port: int) -> bool:
    info = redis.Redis(port=port).info("replication")
    return info.get("master_link_status") == "up"


def _ids_on(port: int, prefix: str, ids: list[str], cluster: bool = False) -> list[bool]:
    """Whether each id is in its shard's ``ids`` hash on the server at ``port`` (a replica: read
    as it is, no redirection)."""
    r = redis.Redis(port=port)
    if not cluster:
        return [r.hexists(shard_keys(prefix, shard_of(e, SHARDS))[0], e) for e in ids]
    r.execute_command("READONLY")
    out: list[bool] = []
    for e in ids:
        key = shard_keys(prefix, shard_of(e, SHARDS))[0]
        # A replica learns that its master took a slot over by gossip, a moment after the
        # hand-over: until then it redirects (MOVED) rather than read. Its data is not in question.
        _until(lambda key=key: _serves(r, key), f"the replica on {port} to serve {key}'s slot")
        out.append(bool(r.hexists(key, e)))
    return out


def _serves(r: redis.Redis, key: str) -> bool:
    try:
        r.exists(key)
    except redis.exceptions.MovedError:
        return False
    return True


class TestWaitingClusterContract(StoreContract):
    """Every store behaviour holds when every write goes through the per-master ``WAIT`` path."""

    @pytest.fixture
    def store_factory(self, cluster):
        made: list[RedisStore] = []

        def make() -> RedisStore:
            made.append(RedisStore(cluster.url, prefix=_prefix("c"), wait=1, wait_timeout=5.0))
            return made[-1]

        yield make
        for s in made:
            s.close()


def test_an_acknowledged_write_is_on_the_replica(master_and_replica):
    master, replica = master_and_replica
    rng = np.random.default_rng(0)
    prefix = _prefix("r")
    ids = [f"v{i}" for i in range(200)]
    with RedisStore(master.url, prefix=prefix, shards=SHARDS, wait=1, wait_timeout=5.0) as store:
        for lo in range(0, len(ids), 20):  # read the replica the moment each write returns
            store.write(make_batch(ids[lo:lo + 20], rng)[0])
            assert all(_ids_on(replica.port, prefix, ids[lo:lo + 20]))
        assert store.delete(ids[:50]) == 50
        assert not any(_ids_on(replica.port, prefix, ids[:50]))


@pytest.mark.parametrize("wait", [1, 0])
def test_a_write_no_replica_acknowledges_fails_and_a_failover_loses_nothing_acknowledged(master_and_replica, wait):
    """The replica stops and its link is cut: a write reaches the master only. Waiting for a
    replica, the write fails and says why (not acknowledged); the master dies, the replica is
    promoted, and every write that was acknowledged is on it. Not waiting (``wait`` 0), the
    same write is acknowledged, and lost: what the waiting guards against."""
    master, replica = master_and_replica
    rng = np.random.default_rng(1)
    prefix = _prefix("f")
    acked: list[str] = []
    with RedisStore(master.url, prefix=prefix, shards=SHARDS, wait=wait, wait_timeout=0.5) as store:
        store.write(make_batch(["a0", "a1", "a2"], rng)[0])
        acked += ["a0", "a1", "a2"]
        _until(lambda: _caught_up(master.port, replica.port), "the replica to catch up")
        os.kill(replica.proc.pid, signal.SIGSTOP)
        redis.Redis(port=master.port).client_kill_filter(_type="replica")
        late = make_batch(["b0", "b1"], rng)[0]
        if wait:
            t0 = time.monotonic()
            with pytest.raises(NotReplicated, match=r"only 0 of the 1 replica\(s\) asked for .* within 0.5 s") as err:
                store.write(late)
            assert 0.4 < time.monotonic() - t0 < 5.0
            assert isinstance(err.value, StoreUnavailable)  # the service answers 503
        else:
            store.write(late)
            acked += ["b0", "b1"]
        assert store.lookup(["b0", "b1"]).min() >= 0  # on the master either way
    master.kill()
    os.kill(replica.proc.pid, signal.SIGCONT)
    redis.Redis(port=replica.port).replicaof("NO", "ONE")
    with RedisStore(replica.url, prefix=prefix) as promoted:
        found = promoted.lookup(acked) >= 0
        assert promoted.lookup(["b0", "b1"]).max() < 0  # what only the master had is gone
    if wait:
        assert found.all()
    else:
        assert found.tolist() == [True, True, True, False, False]  # acknowledged, and lost


def test_each_master_waits_for_its_own_replica(cluster):
    """Records of every shard (all three masters); each is on its master's replica when the write
    returns. One replica stopped: a write touching its master fails naming that master; one
    touching only the others' shards is acknowledged (the epoch every write bumps lives on one
    of the others: it waits for its replica too)."""
    rng = np.random.default_rng(2)
    prefix = _prefix("m")
    replica_of = _replica_of_master(cluster)
    with RedisStore(cluster.url, prefix=prefix, shards=SHARDS, wait=1, wait_timeout=0.5) as store:
        ids = [f"v{i}" for i in range(300)]
        store.write(make_batch(ids, rng)[0])
        for port, mine in _by_master(store, ids).items():
            assert all(_ids_on(replica_of[port], prefix, mine, cluster=True))
        r = store._r()
        epoch_master = r.nodes_manager.get_node_from_slot(r.keyslot(store._epoch_key)).port
        stopped_master, *others_ = [p for p in replica_of if p != epoch_master] + [epoch_master]
        replica = next(n for n in cluster.nodes if n.port == replica_of[stopped_master])
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            by_master = _by_master(store, [f"x{i}" for i in range(300)])
            with pytest.raises(NotReplicated, match=rf"127\.0\.0\.1:{stopped_master}: 0"):
                store.write(make_batch(by_master[stopped_master][:5] + by_master[others_[0]][:5], rng)[0])
            others = by_master[others_[0]][5:10] + by_master[others_[1]][:5]
            store.write(make_batch(others, rng)[0])
            assert store.lookup(others).min() >= 0
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)


def test_a_write_to_a_slot_that_moved_or_is_moving_waits_on_its_new_master(cluster):
    """A shard's slot moves to another master under a store that still maps it to the old one
    (``MOVED``); another shard's slot is half-way — its keys moved, the slot not yet handed
    over, as in a reshard (``ASK``: the store sends ``ASKING`` to the importing master); a third
    is half-way while some of the keys a script names do not exist yet (the importing master
    says ``TRYAGAIN`` until the slot is handed over, 0.3 s later). Each write lands on the new
    master and on its replica."""
    rng = np.random.default_rng(3)
    prefix = _prefix("s")
    replica_of = _replica_of_master(cluster)
    with RedisStore(cluster.url, prefix=prefix, shards=SHARDS, wait=1, wait_timeout=5.0) as store:
        store.write(make_batch([f"v{i}" for i in range(100)], rng)[0])  # the store learns the slot map
        r = redis.RedisCluster.from_url(cluster.url)
        try:
            moved_id, asked_id, again_id = _ids_in_distinct_shards(r, prefix, 3, of_master=cluster.nodes[0].port)
            moved_slot, asked_slot, again_slot = (r.keyslot(shard_keys(prefix, shard_of(e, SHARDS))[0])
                                                  for e in (moved_id, asked_id, again_id))
            gone = next(e for i in itertools.count() if shard_of(e := f"g{i}", SHARDS) == shard_of(asked_id, SHARDS))
            store.write(make_batch([gone], rng)[0])
            store.delete([gone])  # the shard's feed keys exist: a script names none missing
            src, dst = cluster.nodes[0], cluster.nodes[1]
            _move_slot(src.port, dst.port, moved_slot)
            for slot in (asked_slot, again_slot):
                _start_moving(src.port, dst.port, slot)
                _migrate_keys(src.port, dst.port, slot)
            store.write(make_batch([moved_id], rng)[0])
            assert _ids_on(replica_of[dst.port], prefix, [moved_id], cluster=True) == [True]
            store.write(make_batch([asked_id], rng)[0])  # the replica does not serve the slot yet: by offsets
            assert _caught_up(dst.port, replica_of[dst.port])
            handing = threading.Timer(0.3, _hand_over, (src.port, dst.port, again_slot))
            handing.start()
            t0 = time.monotonic()
            store.write(make_batch([again_id], rng)[0])
            assert time.monotonic() - t0 > 0.25  # it waited for the hand-over
            handing.join()
            assert _ids_on(replica_of[dst.port], prefix, [again_id], cluster=True) == [True]
            _hand_over(src.port, dst.port, asked_slot)
            assert _ids_on(replica_of[dst.port], prefix, [asked_id], cluster=True) == [True]
            assert store.lookup([moved_id, asked_id, again_id]).min() >= 0
        finally:
            r.close()


# --- Cluster helpers ---------------------------------------------------------------------------
def _cli(port: int, *args: str) -> str:
    return subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def _node_id(port: int) -> str:
    return _cli(port, "cluster", "myid")


def _replica_of_master(cluster: RedisCluster3) -> dict[int, int]:
    """Master port → its replica's port."""
    ids = {_node_id(n.port): n.port for n in cluster.nodes}
    out = {}
    for n in cluster.nodes:
        info = redis.Redis(port=n.port).info("replication")
        if info["role"] == "slave":
            out[int(info["master_port"])] = n.port
    assert len(out) == 3, (out, ids)
    return out


def _caught_up(master: int, replica: int) -> bool:
    """Whether the replica holds everything its master has written (replication offsets)."""
    return (redis.Redis(port=replica).info("replication")["slave_repl_offset"]
            >= redis.Redis(port=master).info("replication")["master_repl_offset"])


def _by_master(store: RedisStore, ids: list[str]) -> dict[int, list[str]]:
    r = store._r()
    out: dict[int, list[str]] = {}
    for e in ids:
        slot = r.keyslot(shard_keys(store.prefix, shard_of(e, SHARDS))[0])
        out.setdefault(r.nodes_manager.get_node_from_slot(slot).port, []).append(e)
    return out


def _ids_in_distinct_shards(r: redis.RedisCluster, prefix: str, n: int, of_master: int) -> list[str]:
    """``n`` new ids, each in a shard of its own that the master at ``of_master`` serves."""
    out, shards = [], set()
    for i in itertools.count():
        e = f"n{i}"
        s = shard_of(e, SHARDS)
        slot = r.keyslot(shard_keys(prefix, s)[0])
        if s not in shards and r.nodes_manager.get_node_from_slot(slot).port == of_master:
            out.append(e)
            shards.add(s)
            if len(out) == n:
                return out
    raise AssertionError


def _start_moving(src: int, dst: int, slot: int) -> None:
    _cli(dst, "cluster", "setslot", str(slot), "importing", _node_id(src))
    _cli(src, "cluster", "setslot", str(slot), "migrating", _node_id(dst))


def _migrate_keys(src: int, dst: int, slot: int) -> None:
    while True:
        keys = _cli(src, "cluster", "getkeysinslot", str(slot), "100").split()
        if not keys:
            return
        _cli(src, "migrate", "127.0.0.1", str(dst), "", "0", "5000", "keys", *keys)


def _hand_over(src: int, dst: int, slot: int) -> None:
    for port in (dst, src):
        _cli(port, "cluster", "setslot", str(slot), "node", _node_id(dst))


def _move_slot(src: int, dst: int, slot: int) -> None:
    _start_moving(src, dst, slot)
    _migrate_keys(src, dst, slot)
    _hand_over(src, dst, slot)


def test_the_server_answers_503_while_no_replica_acknowledges(master_and_replica, tmp_path):
    """``GMMLSH_REDIS_WAIT`` reaches the server's store: a write its replica cannot acknowledge
    is a 503 (retry), and once the replica is back the same write is acknowledged."""
    from test_service import Server

    master, replica = master_and_replica
    env = {"GMMLSH_REDIS_URL": master.url, "GMMLSH_PREFIX": _prefix("h"), "GMMLSH_DIM": "4",
           "GMMLSH_CACHE_DIR": str(tmp_path / "cache"), "GMMLSH_REDIS_WAIT": "1", "GMMLSH_REDIS_WAIT_TIMEOUT": "0.5"}
    srv = Server(tmp_path, env).start()
    try:
        with srv.client() as c:
            assert c.post("/vectors", json={"id": "a", "values": [1, 2, 3, 4]}).status_code == 200
            os.kill(replica.proc.pid, signal.SIGSTOP)
            redis.Redis(port=master.port).client_kill_filter(_type="replica")
            r = c.post("/vectors", json={"id": "b", "values": [1, 2, 3, 5]})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "replica" in srv.log()
            os.kill(replica.proc.pid, signal.SIGCONT)
            _until(lambda: _link_up(replica.port), "the replica to sync again")
            assert c.post("/vectors", json={"id": "b", "values": [1, 2, 3, 5]}).status_code == 200
    finally:
        srv.stop()
