"""Snapshots (issue 32, step 4): a group's mirror built once, published, and taken by a node
whose disk is empty, which then reads only the feed after the snapshot's token (real Redis
Cluster; ``INFO commandstats`` counts what Redis served)."""

from __future__ import annotations

import json

import numpy as np
import redis
from redis_fixtures import redis_cluster_url, redis_prefix  # noqa: F401

from gmmlsh.index import segments
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.snapshots import Lease, open_snapshots, publish, restore


def _hmget_calls(url: str) -> int:
    r = redis.RedisCluster.from_url(url)
    try:
        stats = r.info("commandstats", target_nodes=redis.RedisCluster.PRIMARIES)
        return sum(int(v.get("cmdstat_hmget", {}).get("calls", 0)) for v in stats.values())
    finally:
        r.close()


def _count_reads(index: Index) -> list[int]:
    """Records the index reads from its store from now on (a wrapper around ``store.read``)."""
    read, seen = index.store.read, [0]

    def counted(iids, fields):
        seen[0] += len(iids)
        return read(iids, fields)

    index.store.read = counted  # type: ignore[method-assign]
    return seen


def test_a_wiped_node_starts_from_the_snapshot(redis_cluster_url, redis_prefix, tmp_path):  # noqa: F811
    rng = np.random.default_rng(3)
    n, dim = 4400, 32  # each of the 2 groups holds over 2,048 rows: it gets lists
    X = (rng.random((n, dim)) * (rng.random((n, dim)) < 0.6)).astype(np.float32) + np.float32(0.01)
    ids = [f"s{i}" for i in range(n)]
    cfg = IndexConfig(dim=dim, samples=64, bits=4)
    common = {"prefix": redis_prefix, "maintain": False, "shards": 8}
    group = (0, 2)
    snaps_dir = tmp_path / "snapshots"
    with Index.open(redis_cluster_url, cfg, cache_dir=str(tmp_path / "w"), **common) as writer:
        writer.upsert(ids, X)
        with Index.open(redis_cluster_url, None, group=group, cache_dir=str(tmp_path / "a"), **common) as a:
            assert Lease(a.store, group, "node-a").hold() and not Lease(a.store, group, "node-b").hold()
            done = a.maintain()  # the builder: lists and tuning, once
            assert "fit" in done and "tune" in done
            snaps = open_snapshots(str(snaps_dir), redis_prefix, a.config.uid)
            made = publish(a.mirror, snaps, group)
            assert made is not None and made.rows == a.view().rows
            assert publish(a.mirror, snaps, group) is None  # nothing new: nothing published
            # After the snapshot: new rows and deletions, which the feed carries.
            writer.upsert([f"late{i}" for i in range(300)], X[:300] + 1)
            writer.delete(ids[:200])
            truth = a.query_batch(X[1000:1020], k=10, mode="exact")
            a_view = a.view()

            calls0 = _hmget_calls(redis_cluster_url)
            with Index.open(redis_cluster_url, None, group=group, cache_dir=str(tmp_path / "b"), **common) as b:
                with b.mirror.locked():
                    assert restore(b.mirror.dir, snaps, group, b.config.uid) is not None
            with Index.open(redis_cluster_url, None, group=group, cache_dir=str(tmp_path / "b"), **common) as b:
                reads = _count_reads(b)
                view = b.view()
                b_calls = _hmget_calls(redis_cluster_url) - calls0
                assert view.fit is not None and view.fit.name == a_view.fit.name
                assert view.tuned_rows == a_view.tuned_rows > 0  # B tuned nothing itself
                assert view.live == a_view.live == b.count()
                assert reads[0] < 400 < made.rows  # only what came after the snapshot
                got = b.query_batch(X[1000:1020], k=10, mode="exact")
                assert [[n.id for n in r.neighbors] for r in got] == [[n.id for n in r.neighbors] for r in truth]
                assert b.query(X[5], k=1).neighbors[0].id  # the tuned search answers at once

            calls1 = _hmget_calls(redis_cluster_url)
            with Index.open(redis_cluster_url, None, group=group, cache_dir=str(tmp_path / "c"), **common) as c:
                reads = _count_reads(c)
                c.view()  # no snapshot: every record of the group out of Redis
                c_calls = _hmget_calls(redis_cluster_url) - calls1
                assert reads[0] >= a_view.live
            assert b_calls < c_calls
            print(json.dumps({"hmget_calls": {"restored": b_calls, "replayed": c_calls}, "rows": made.rows}))


def test_a_snapshot_leaves_out_a_fit_set_aside(tmp_path, fmnist):
    """A replaced fit stays in the mirror's directory for a while, renamed aside (see
    :func:`gmmlsh.index.segments.retire_fit`): a snapshot copies only the fit its state names."""
    X = fmnist[0]
    with Index.open(tmp_path / "ix", IndexConfig(dim=784, samples=64), maintain=False) as ix:
        ix.upsert([f"v{i}" for i in range(3000)], X[:3000])
        ix.maintain()
        ix.upsert([f"v{i}" for i in range(3000, 6000)], X[3000:6000])
        assert ix.maintain()["fit"][0]["fit"] == 2  # the index doubled: a new fit, the first set aside
        assert (ix.mirror.dir / (segments.RETIRED + segments.fit_name(1))).is_dir()
        made = publish(ix.mirror, open_snapshots(str(tmp_path / "snaps"), "p", ix.config.uid), None)
        assert made is not None
        copied = {name.split("/")[0] for name in made.files}
        assert {d for d in copied if segments.is_fit_dir(d)} == {segments.fit_name(2)}
