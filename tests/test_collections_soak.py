"""Collections under concurrent load on a 2-worker server (LMDB and Redis): writers fill two
collections of different dimensions, a third is created and deleted over and over, readers
query with filters and scroll; for ``GMMLSH_SOAK_SECONDS`` (default 10) per backend.

What must hold: no 5xx; every answer comes from its own collection (its dimension, its ids)
and passes its filter; a request to the churning collection succeeds or answers 404, never a
stale copy's data; at the end each collection holds exactly what was acknowledged.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
from redis_fixtures import redis_url  # noqa: F401
from test_service import Server

SECONDS = float(os.environ.get("GMMLSH_SOAK_SECONDS", "10"))
DIMS = {"a": 3, "b": 5}


@pytest.fixture(params=["lmdb", "redis"])
def env(request, tmp_path):
    if request.param == "lmdb":
        return {"GMMLSH_INDEX": str(tmp_path / "idx")}
    return {"GMMLSH_REDIS_URL": request.getfixturevalue("redis_url"), "GMMLSH_PREFIX": f"s{uuid.uuid4().hex[:10]}",
            "GMMLSH_CACHE_DIR": str(tmp_path / "cache")}


def test_collections_hold_under_concurrent_writes_churn_and_reads(env, tmp_path):
    server = Server(tmp_path, {**env, "GMMLSH_DIM": "4", "GMMLSH_SAMPLES": "64"}, workers=2).start()
    stop = threading.Event()
    problems: list[str] = []
    acked: dict[str, dict[str, int]] = {"a": {}, "b": {}}  # id → label, as acknowledged
    counts = {"writes": 0, "queries": 0, "churn": 0, "gone": 0}

    def check(r: httpx.Response, what: str, ok=(200,)) -> bool:
        if r.status_code not in ok:
            problems.append(f"{what}: {r.status_code} {r.text[:300]}")
            return False
        return True

    def writer(name: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with server.client() as c:
            n = 0
            while not stop.is_set():
                ids = [f"{name}{(n * 7 + j) % 400}" for j in range(20)]  # re-upserts too
                labels = dict(zip(ids, rng.integers(0, 5, len(ids)).tolist(), strict=True))
                body = {"vectors": [{"id": i, "values": (rng.random(DIMS[name]) + 0.05).tolist(),
                                     "metadata": {"label": lab, "c": name}} for i, lab in labels.items()]}
                if check(c.post(f"/collections/{name}/vectors", json=body), f"write {name}"):
                    acked[name].update(labels)
                    counts["writes"] += 1
                n += 1

    def churn() -> None:
        with server.client() as c:
            while not stop.is_set():
                check(c.post("/collections", json={"name": "tmp", "dim": 2}), "create tmp", (201, 409))
                check(c.post("/collections/tmp/vectors", json={"id": "t", "values": [1, 2]}), "write tmp",
                      (200, 404))
                r = c.get("/collections/tmp/vectors/t")
                if check(r, "read tmp", (200, 404)) and r.status_code == 200:
                    if len(r.json()["values"]) != 2:
                        problems.append(f"tmp answered a vector of {len(r.json()['values'])} values")
                else:
                    counts["gone"] += 1
                check(c.delete("/collections/tmp"), "delete tmp", (200, 404))
                counts["churn"] += 1

    def reader() -> None:
        rng = np.random.default_rng(9)
        with server.client() as c:
            while not stop.is_set():
                name = "ab"[int(rng.integers(2))]
                label = int(rng.integers(5))
                body = {"values": (rng.random(DIMS[name]) + 0.05).tolist(), "k": 5,
                        "filter": {"must": [{"key": "label", "match": {"value": label}}]}}
                r = c.post(f"/collections/{name}/neighbors/search", json=body)
                if check(r, f"query {name}"):
                    for n in r.json()["neighbors"]:
                        if n["metadata"] != {"label": label, "c": name} or not n["id"].startswith(name):
                            problems.append(f"query {name} label {label} answered {n}")
                    counts["queries"] += 1

    with server.client() as c:
        for name, dim in DIMS.items():
            assert c.post("/collections", json={"name": name, "dim": dim}).status_code == 201
    threads = [threading.Thread(target=writer, args=("a", 1)), threading.Thread(target=writer, args=("b", 2)),
               threading.Thread(target=churn), threading.Thread(target=reader), threading.Thread(target=reader)]
    try:
        for t in threads:
            t.start()
        time.sleep(SECONDS)
        stop.set()
        for t in threads:
            t.join(60)
        assert not problems, (problems[:5], server.log())
        with server.client() as c:
            for name in DIMS:
                seen: dict[str, int] = {}
                cursor = None
                while True:
                    page = {"limit": 150, **({"cursor": cursor} if cursor else {})}
                    r = c.post(f"/collections/{name}/scroll", json=page)
                    assert r.status_code == 200, r.text
                    seen.update({x["id"]: x["metadata"]["label"] for x in r.json()["items"]})
                    cursor = r.json()["next_cursor"]
                    if cursor is None:
                        break
                assert seen == acked[name]
                assert c.get(f"/collections/{name}").json()["count"] == len(acked[name])
    finally:
        stop.set()
        server.stop()
    print(f"\ncollections soak {SECONDS:g} s: {counts}")
    assert counts["writes"] and counts["queries"] and counts["churn"]
