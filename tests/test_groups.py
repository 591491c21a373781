"""Search groups (issue 32, step 1): a node follows the id-shards ``s ≡ g (mod G)`` only.

Real Redis Cluster (3 masters), real mirrors on disk: the groups of one layout hold every
stored vector exactly once between them, each mirror in a directory named by its group, and
G = 1 is the whole index.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from redis_fixtures import redis_cluster_url, redis_prefix  # noqa: F401

from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index


def _data(n: int, dim: int = 24, seed: int = 0) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.random((n, dim)).astype(np.float32) * (rng.random((n, dim)) < 0.7)
    X[:, 0] += 0.01  # no all-zero row
    return [f"v{i}" for i in range(n)], X


def _names(index: Index) -> set[str]:
    view = index.view()
    live = np.flatnonzero(view.alive[:view.rows])
    return set(view.names_of(live.tolist()))


def test_groups_partition_the_index(redis_cluster_url, redis_prefix, tmp_path):  # noqa: F811
    ids, X = _data(1200)
    cfg = IndexConfig(dim=X.shape[1], samples=64, bits=4)
    opts = {"prefix": redis_prefix, "cache_dir": str(tmp_path / "cache"), "maintain": False, "shards": 8}
    with Index.open(redis_cluster_url, cfg, **opts) as writer:
        writer.upsert(ids, X)
        writer.delete(ids[:100])
        S = writer.store.shards
    seen: set[str] = set()
    for G in (2, 4):
        layout: list[set[str]] = []
        for g in range(G):
            with Index.open(redis_cluster_url, None, group=(g, G), **opts) as node:
                assert node.mirror.dir.name.endswith(f"-g{g}of{G}")
                assert len(node.store.token()) == 2 * len(range(g, S, G))
                names = _names(node)
                assert all(zlib.crc32(n.encode()) % S % G == g for n in names)
                assert node.count() == len(names)
                layout.append(names)
        assert sum(len(part) for part in layout) == len(set().union(*layout)) == 1100
        seen = set().union(*layout)
    with Index.open(redis_cluster_url, None, group=(0, 1), **opts) as whole:
        assert _names(whole) == seen == set(ids[100:])


def test_grouped_node_follows_writes_by_the_epoch(redis_cluster_url, redis_prefix, tmp_path):  # noqa: F811
    """A grouped store reads the epoch key per query, its counters only once the epoch moved;
    every write bumps it before it returns, so a query after an acknowledged write sees it."""
    ids, X = _data(400, seed=1)
    cfg = IndexConfig(dim=X.shape[1], samples=64, bits=4)
    opts = {"prefix": redis_prefix, "cache_dir": str(tmp_path / "cache"), "maintain": False, "shards": 4}
    with Index.open(redis_cluster_url, cfg, **opts) as writer, \
            Index.open(redis_cluster_url, None, group=(0, 1), **opts) as node:
        node.query(X[0], k=1, mode="exact")
        before = node.store.epoch()
        t = node.store.token()
        assert node.store.token() == t  # the epoch unchanged: the counters are not read again
        for i in range(0, 400, 50):
            writer.upsert(ids[i:i + 50], X[i:i + 50])
            assert writer.store.last_epoch() == node.store.epoch()
            hit = node.query(X[i + 49], k=1, mode="exact")
            assert hit.neighbors[0].id == ids[i + 49]
        assert node.store.epoch() == before + 8
        writer.delete([ids[399]])
        assert all(n.id != ids[399] for n in node.query(X[399], k=3, mode="exact").neighbors)


def test_group_is_for_redis_only(tmp_path):
    with pytest.raises(ValueError, match="group"):
        Index.open(str(tmp_path / "idx"), IndexConfig(dim=4), group=(0, 2))


def test_a_shard_that_went_back_is_resynced_alone(redis_cluster_url, redis_prefix, tmp_path):  # noqa: F811
    """A failover that lost a shard's last writes (its seq goes back; those iids are handed out
    again): the mirror retires and copies again that shard's rows only; the others keep theirs."""
    ids, X = _data(600, seed=2)
    cfg = IndexConfig(dim=X.shape[1], samples=64, bits=4)
    opts = {"prefix": redis_prefix, "cache_dir": str(tmp_path / "cache"), "maintain": False, "shards": 4}
    with Index.open(redis_cluster_url, cfg, **opts) as writer, \
            Index.open(redis_cluster_url, None, group=(0, 2), **opts) as node:
        writer.upsert(ids, X)
        view = node.view()
        rows_before = {n: r for r, n in enumerate(view.names_of(list(range(view.rows))))}
        store, S = writer.store, writer.store.shards
        # What the promoted replica lacks: shard 2's last 5 records (fields, id map, seq).
        seq = int(store.guarded(lambda r: r.get(store._tag(2) + "seq")))
        lost = []
        for q in range(seq - 5, seq):
            iid = q * S + 2
            name = store.read(np.array([iid]), ["name"])["name"][0].decode()
            lost.append(name)
            store.guarded(lambda r, q=q: [r.hdel(f"{store._tag(2)}{fam}:{q // c}", str(q % c))
                                          for fam, c in (("n", 128), ("v", 1024), ("k", 1024), ("m", 128))])
            store.guarded(lambda r, name=name: r.hdel(store._tag(2) + "ids", name))
        store.guarded(lambda r: (r.set(store._tag(2) + "seq", seq - 5), r.decrby(store._tag(2) + "live", 5),
                                 r.incr(store._epoch_key)))
        view = node.view()
        names = _names(node)
        assert not set(lost) & names
        kept = {n: r for r, n in enumerate(view.names_of(list(range(view.rows)))) if view.alive[r]}
        for name, row in kept.items():  # shard 0's rows never moved; shard 2's were copied again
            shard = zlib.crc32(name.encode()) % S
            assert (row == rows_before[name]) == (shard == 0), name
        assert len(names) == node.count()
        # The lost iids are handed out again, to new records: the mirror takes them.
        again = [f"again{i}" for i in range(40)]
        writer.upsert(again, X[:40] + 1)
        mine = {a for a in again if zlib.crc32(a.encode()) % S % 2 == 0}
        assert mine and mine <= _names(node)
        assert _names(node) == (names | mine)


def test_a_cached_token_older_than_the_mirror_is_not_a_regression(redis_cluster_url, redis_prefix,  # noqa: F811
                                                                  tmp_path):
    """Two processes share a node's mirror (a server and its upkeep worker): one's cached token
    can be older than the mirror the other synced. That is no store going back: nothing is
    copied again, no row doubled."""
    ids, X = _data(300, seed=4)
    cfg = IndexConfig(dim=X.shape[1], samples=64, bits=4)
    opts = {"prefix": redis_prefix, "cache_dir": str(tmp_path / "cache"), "maintain": False, "shards": 4}
    with Index.open(redis_cluster_url, cfg, **opts) as writer, \
            Index.open(redis_cluster_url, None, group=(0, 1), **opts) as one, \
            Index.open(redis_cluster_url, None, group=(0, 1), **opts) as two:
        writer.upsert(ids[:200], X[:200])
        old_epoch = two.store.epoch()
        two.query(X[0], k=1, mode="exact")  # two caches the token at this epoch
        writer.upsert(ids[200:], X[200:])
        one.query(X[0], k=1, mode="exact")  # one syncs the shared mirror past it
        rows = one.mirror.refresh().rows
        two.store.assume_epoch(old_epoch)  # e.g. a router's session token from before the write
        try:
            hits = two.query(X[250], k=2, mode="exact").neighbors
        finally:
            two.store.assume_epoch(None)
        assert hits[0].id == ids[250] and hits[1].id != ids[250]
        assert two.mirror.refresh().rows == rows == 300


def test_lost_writes_written_over_before_the_node_looked(redis_cluster_url, redis_prefix, tmp_path):  # noqa: F811
    """The failover lost a shard's last records and new writes took the shard's sequence past
    where it was before any node looked: its counters only grew, yet the mirror's newest rows
    of it are gone. The node sees that its last record of the shard is gone unretired, and
    copies that shard again (only that one)."""
    ids, X = _data(600, seed=6)
    cfg = IndexConfig(dim=X.shape[1], samples=64, bits=4)
    opts = {"prefix": redis_prefix, "cache_dir": str(tmp_path / "cache"), "maintain": False, "shards": 4}
    with Index.open(redis_cluster_url, cfg, **opts) as writer, \
            Index.open(redis_cluster_url, None, group=(0, 2), **opts) as node:
        writer.upsert(ids, X)
        node.view()
        store, S = writer.store, writer.store.shards
        seq = int(store.guarded(lambda r: r.get(store._tag(2) + "seq")))
        lost = []
        for q in range(seq - 3, seq):
            name = store.read(np.array([q * S + 2]), ["name"])["name"][0].decode()
            lost.append(name)
            store.guarded(lambda r, q=q: [r.hdel(f"{store._tag(2)}{fam}:{q // c}", str(q % c))
                                          for fam, c in (("n", 128), ("v", 1024), ("k", 1024), ("m", 128))])
            store.guarded(lambda r, name=name: r.hdel(store._tag(2) + "ids", name))
        store.guarded(lambda r: (r.set(store._tag(2) + "seq", seq - 3), r.decrby(store._tag(2) + "live", 3)))
        new = [n for n in (f"new{i}" for i in range(400)) if zlib.crc32(n.encode()) % S == 2][:6]
        writer.upsert(new, X[:6] * 2)  # shard 2's sequence ends past where it was
        assert int(store.guarded(lambda r: r.get(store._tag(2) + "seq"))) > seq
        names = _names(node)
        assert not set(lost) & names and set(new) <= names
        assert len(names) == node.count()
