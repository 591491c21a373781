"""A bad day: the disk or Redis fills up under a real ``gmmlsh serve`` (issue #35, items 14-16).

LMDB: the index directory and its search mirror are each on a small tmpfs of their own, so that each
can be filled on its own: first the mirror's (the store still takes writes, which the mirror
then cannot take), then the store's (writes are refused, 507). Reads must go on from what the
mirror holds, ``/health`` must say that answers miss the latest writes, and ``gmmlsh check``
must run (it writes nothing) — a query used to answer 507 and the check to fail with
``DiskFull`` as soon as the mirror could not grow. Once space is freed, everything catches up.

Redis at ``maxmemory`` (noeviction): a refused batch must have stored nothing — it had stored
some of its id shards' parts — or, where Redis cannot write it as one (a Cluster, one node
full), the 507 must list exactly the ids it stored.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import redis
from conftest import fill
from redis_fixtures import redis_cluster_url, redis_server  # noqa: F401
from test_service import REPO, Server


def _post(c, ids: list[str], X: np.ndarray):
    return c.post("/vectors", json={"vectors": [{"id": i, "values": x.tolist()} for i, x in zip(ids, X, strict=True)]})


def test_reads_go_on_and_check_runs_while_the_disks_are_full(tmp_path, tmpfs, fmnist):
    X = fmnist[0][:1200].astype(np.float64)
    idx = tmpfs(tmp_path / "store", "24m") / "idx"
    mirror = tmpfs(idx / "mirror", "8m")
    server = Server(tmp_path, {"GMMLSH_INDEX": str(idx), "GMMLSH_DIM": "784", "GMMLSH_SAMPLES": "64"}).start()
    try:
        with server.client() as c:
            assert _post(c, [str(i) for i in range(200)], X[:200]).status_code == 200
            before = c.get("/neighbors", params={"id": "5", "k": 5})
            assert before.status_code == 200, before.text

            mirror_ballast = fill(mirror)  # the mirror cannot grow; the store still takes writes
            for lo in range(200, 1200, 250):
                r = _post(c, [f"new{i}" for i in range(lo, lo + 250)], X[lo:lo + 250])
                assert r.status_code == 200, r.text
            store_ballast = fill(idx.parent)  # now the store is full too
            r = _post(c, ["refused"], X[:1] + 1)
            assert r.status_code == 507, r.text

            r = c.get("/neighbors", params={"id": "5", "k": 5})
            assert r.status_code == 200, r.text  # from what the mirror holds
            assert r.json()["neighbors"] == before.json()["neighbors"]
            r = c.post("/neighbors/search", json={"values": X[7].tolist(), "k": 1, "mode": "exact"})
            assert r.status_code == 200 and r.json()["neighbors"][0]["id"] == "7", r.text
            health = c.get("/health").json()
            assert health["writable"] is False and health["search_current"] is False, health
            assert "behind" in health["search_problem"] and str(tmp_path) not in health["search_problem"]
            r = c.get("/neighbors", params={"id": "new700", "k": 5})  # written after the mirror filled up
            assert r.status_code == 507 and r.json()["error"]["field"] == "id", r.text
            assert str(tmp_path) not in r.text

            check = subprocess.run([sys.executable, "-m", "gmmlsh.service.cli", "check", "--index", str(idx),
                                    "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
            assert check.returncode == 0, check.stdout + check.stderr
            report = json.loads(check.stdout)
            assert report["ok"] and report["vectors"] == 1200 and report["mirror_behind"] == 1000, report

            store_ballast.unlink()
            mirror_ballast.unlink()
            r = c.get("/neighbors", params={"id": "new700", "k": 5})
            assert r.status_code == 200, r.text
            assert c.get("/health").json() == {"status": "ok", "backend": "lmdb", "writable": True,
                                               "search_current": True}
            assert _post(c, ["after"], X[:1] + 1).status_code == 200
            assert c.get("/neighbors", params={"id": "after", "k": 1}).status_code == 200
        check = subprocess.run([sys.executable, "-m", "gmmlsh.service.cli", "check", "--index", str(idx), "--json"],
                               cwd=REPO, capture_output=True, text=True, timeout=300)
        assert check.returncode == 0 and json.loads(check.stdout)["mirror_behind"] == 0, check.stdout + check.stderr
    finally:
        server.stop()


def _redis_env(url: str, tmp_path) -> dict:
    return {"GMMLSH_REDIS_URL": url, "GMMLSH_PREFIX": f"full{tmp_path.name[-12:]}", "GMMLSH_DIM": "784",
            "GMMLSH_SAMPLES": "64", "GMMLSH_CACHE_DIR": str(tmp_path / "cache")}


def test_a_batch_a_full_redis_refuses_stores_nothing(tmp_path, redis_server, fmnist):  # noqa: F811
    X = fmnist[0][:3000].astype(np.float64)
    server = Server(tmp_path, _redis_env(redis_server.url, tmp_path)).start()
    r = redis.Redis.from_url(redis_server.url)
    try:
        with server.client() as c:
            assert _post(c, [str(i) for i in range(100)], X[:100]).status_code == 200
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", r.info("memory")["used_memory"] + 2_000_000)
            acknowledged = 100
            for lo in range(100, 3000, 100):
                resp = _post(c, [str(i) for i in range(lo, lo + 100)], X[lo:lo + 100])
                if resp.status_code != 200:
                    break
                acknowledged += 100
            assert resp.status_code == 507 and "nothing was written" in resp.json()["error"]["message"], resp.text
            assert c.get("/stats").json()["count"] == acknowledged
            assert c.get(f"/vectors/{lo}").status_code == 404 and c.get(f"/vectors/{lo + 99}").status_code == 404
            assert c.get("/health").json()["writable"] is False
            assert c.get("/neighbors", params={"id": "5", "k": 3}).status_code == 200
    finally:
        r.config_set("maxmemory", 0)
        r.close()
        server.stop()


def test_a_cluster_batch_a_full_node_refuses_lists_the_ids_it_stored(tmp_path, redis_cluster_url,  # noqa: F811
                                                                     fmnist):
    X = fmnist[0][:100].astype(np.float64)
    server = Server(tmp_path, _redis_env(redis_cluster_url, tmp_path)).start()
    r = redis.RedisCluster.from_url(redis_cluster_url)
    full = r.get_primaries()[0]
    try:
        with server.client() as c:
            r.config_set("maxmemory-policy", "noeviction", target_nodes=full)
            r.config_set("maxmemory", 1, target_nodes=full)
            resp = _post(c, [f"c{i}" for i in range(100)], X)
            assert resp.status_code == 507, resp.text
            err = resp.json()["error"]
            stored = [d["message"] for d in err["details"] if d["type"] == "stored"]
            assert 0 < len(stored) < 100 and f"{len(stored)} of its vectors were stored" in err["message"]
            r.config_set("maxmemory", 0, target_nodes=full)
            found = [f"c{i}" for i in range(100) if c.get(f"/vectors/c{i}").status_code == 200]
            assert sorted(found) == sorted(stored)
            assert c.get("/stats").json()["count"] == len(stored)
    finally:
        r.config_set("maxmemory", 0, target_nodes=full)
        r.close()
        server.stop()
