"""The router over search nodes (issue 32): real redis-server Cluster, real ``gmmlsh serve
--group`` and ``gmmlsh route`` processes over HTTP on loopback.

One index of Fashion-MNIST rows; layouts of 2 groups (group 0 with two replicas) and of 4
groups; a router fixed on each layout and one that picks the layout itself.
"""

from __future__ import annotations

import signal
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from redis_fixtures import redis_cluster_url  # noqa: F401
from shard_fixtures import Proc, node, router

from gmmlsh.client import ARROW, arrow_body
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.search import query_codes
from gmmlsh.service.wire import MEDIA, NodeQuery, decode_answers, encode_queries

#: Small enough that no group is tuned or listed (the nodes start in seconds): this checks the
#: routing and the merge; bench/bench_shards.py measures recall and cost at size.
ROWS = 480
QUERIES = 200
PREFIX = "router_t"


@pytest.fixture(scope="module")
def fleet(redis_cluster_url, fmnist, tmp_path_factory):  # noqa: F811
    base = tmp_path_factory.mktemp("fleet")
    train, _, test, _ = fmnist
    X = train[:ROWS].astype(np.float32)
    ids = [f"f{i}" for i in range(ROWS)]
    meta = [{"row": i} if i % 3 == 0 else None for i in range(ROWS)]
    opts = {"prefix": PREFIX, "cache_dir": str(base / "one"), "maintain": False, "shards": 16}
    one = Index.open(redis_cluster_url, IndexConfig(dim=784), **opts)
    one.upsert(ids, X, meta)
    procs: dict[str, Proc] = {}
    logs = base / "logs"
    try:
        for G in (2, 4):
            for g in range(G):
                procs[f"{g}/{G}"] = node(redis_cluster_url, PREFIX, f"{g}/{G}", base / f"n{g}of{G}", logs).start()
        procs["0/2b"] = node(redis_cluster_url, PREFIX, "0/2", base / "n0of2b", logs).start()
        procs["r2"] = router(redis_cluster_url, PREFIX, logs, groups=2).start()
        procs["r4"] = router(redis_cluster_url, PREFIX, logs, groups=4).start()
        procs["auto"] = router(redis_cluster_url, PREFIX, logs).start()
        procs["r2"].wait_healthy(want={"groups": 2, "replicas": {"0": 2, "1": 1}})
        procs["r4"].wait_healthy(want={"groups": 4})
        procs["auto"].wait_healthy(want={"groups": 4})
        yield {"one": one, "X": X, "ids": ids, "Q": test[:QUERIES].astype(np.float32), "procs": procs,
               "url": redis_cluster_url, "base": base, "logs": logs}
    finally:
        for p in procs.values():
            p.stop()
        one.store.drop()
        one.close()


def _search(url: str, Q: np.ndarray, headers: dict | None = None, **knobs) -> httpx.Response:
    return httpx.post(url + "/neighbors/search", content=Q.astype("<f4").tobytes(), params=knobs,
                      headers={"content-type": "application/octet-stream", **(headers or {})}, timeout=60)


def _same_answer(mine: list[dict], theirs, k: int) -> None:
    """Bit-identical similarities, the same ids (where similarities tie, the same set of ids)."""
    sims = [n["similarity"] for n in mine]
    assert sims == [n.similarity for n in theirs.neighbors]
    for s in set(sims):
        assert {n["id"] for n in mine if n["similarity"] == s} == {n.id for n in theirs.neighbors
                                                                    if n.similarity == s}


@pytest.mark.parametrize("router_name", ["r2", "r4"])
def test_exact_merge_is_one_node_bit_for_bit(fleet, router_name):
    """200 exact queries through the router: the same ids and bit-identical similarities as
    one node over the whole index."""
    Q, one = fleet["Q"], fleet["one"]
    truth = one.query_batch(Q, k=10, mode="exact")
    r = _search(fleet["procs"][router_name].url, Q, k=10, mode="exact")
    assert r.status_code == 200, r.text
    got = r.json()["results"]
    assert len(got) == QUERIES
    for mine, theirs in zip(got, truth, strict=True):
        assert mine["mode"] == "exact"
        _same_answer(mine["neighbors"], theirs, 10)
    # JSON single queries and metadata, as one server answers them.
    url = fleet["procs"][router_name].url
    for i in range(3):
        r = httpx.post(url + "/neighbors/search", json={"values": Q[i].tolist(), "k": 5, "mode": "exact"}, timeout=30)
        assert r.status_code == 200, r.text
        body, five = r.json(), one.query(Q[i], k=5, mode="exact")
        _same_answer(body["neighbors"], five, 5)
        assert {n["id"]: n["metadata"] for n in body["neighbors"]} == {n.id: n.metadata for n in five.neighbors}


def test_sparse_queries_and_filters_through_the_router(fleet):
    """A sparse query, and one with a metadata filter, as one node answers them."""
    one, url, Q = fleet["one"], fleet["procs"]["r4"].url, fleet["Q"]
    for i in range(3):
        idx = np.flatnonzero(Q[i])[::3]
        theirs = one.query((idx, Q[i][idx]), k=5, mode="exact")
        r = httpx.post(url + "/neighbors/search", json={"indices": idx.tolist(), "values": Q[i][idx].tolist(),
                                                         "k": 5, "mode": "exact"}, timeout=30)
        assert r.status_code == 200, r.text
        _same_answer(r.json()["neighbors"], theirs, 5)
    flt = {"must": [{"key": "row", "range": {"lt": 200}}]}
    theirs = one.query(Q[0], k=5, mode="exact", filter=flt)
    r = httpx.post(url + "/neighbors/search", json={"values": Q[0].tolist(), "k": 5, "mode": "exact", "filter": flt},
                   timeout=30)
    assert r.status_code == 200, r.text
    _same_answer(r.json()["neighbors"], theirs, 5)
    assert all(n["metadata"]["row"] < 200 for n in r.json()["neighbors"])


def test_query_by_id_leaves_it_out(fleet):
    one, url = fleet["one"], fleet["procs"]["r4"].url
    for ext in ("f0", "f7", "f333"):
        theirs = one.query(id=ext, k=8, mode="exact")
        r = httpx.get(url + "/neighbors", params={"id": ext, "k": 8, "mode": "exact"}, timeout=30)
        assert r.status_code == 200, r.text
        got = r.json()["neighbors"]
        assert ext not in {n["id"] for n in got}
        assert [n["id"] for n in got] == [n.id for n in theirs.neighbors]
        np.testing.assert_allclose([n["similarity"] for n in got], [n.similarity for n in theirs.neighbors],
                                   rtol=1e-12)


def test_bad_input_is_refused_before_any_fanout(fleet):
    url = fleet["procs"]["auto"].url
    calls = httpx.get(url + "/stats").json()["calls"]
    cases = [
        ({"values": [1.0, 2.0]}, "values", 422),
        ({"values": [0.0] * 784}, "values", 422),
        ({"values": [1.0] * 784, "k": 0}, "k", 422),
        ({"values": [1.0] * 784, "mode": "nope"}, "mode", 422),
        ({"id": "no-such-id"}, "id", 404),
        ({"queries": [{"values": [1.0] * 784}, {"values": [0.0] * 784}]}, "queries[1].values", 422),
    ]
    for body, field, status in cases:
        r = httpx.post(url + "/neighbors/search", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["field"] == field, r.text
    r = httpx.get(url + "/neighbors", params={"vector": "1,2", "k": 3})
    assert r.status_code == 422 and r.json()["error"]["field"] == "vector"
    assert httpx.get(url + "/stats").json()["calls"] == calls  # nothing reached a node


def test_dense_queries_are_hashed_once_by_the_router(fleet):
    """The router hashes the dense queries the sketch search may answer and sends their codes; a
    node answers with the codes it is sent exactly as when it hashes the query itself (and with
    another query's codes, otherwise: it uses them). Exact and sparse queries are not hashed."""
    one, Q, procs = fleet["one"], fleet["Q"], fleet["procs"]
    url = procs["r2"].url
    hashed = httpx.get(url + "/stats").json()["hashed"]
    assert _search(url, Q[:20], k=5, mode="sketch").status_code == 200
    assert _search(url, Q[:20], k=5, mode="exact").status_code == 200
    idx = np.flatnonzero(Q[0])[::3]
    assert httpx.post(url + "/neighbors/search", json={"indices": idx.tolist(), "values": Q[0][idx].tolist(),
                                                       "mode": "sketch"}, timeout=30).status_code == 200
    assert httpx.get(url + "/stats").json()["hashed"] == hashed + 20

    codes = query_codes(Q[:20], one.config)

    def node_answers(with_codes) -> list:
        queries = [NodeQuery(Q[i], 10, "sketch", 0.0, 20, None, None, None,  # 20 reranked of a group's ~240
                             with_codes[i] if with_codes is not None else None) for i in range(20)]
        r = httpx.post(procs["1/2"].url + "/internal/search", content=encode_queries(queries, None),
                       headers={"content-type": MEDIA}, timeout=60)
        assert r.status_code == 200, r.text
        return [(a.names, a.similarities.tolist()) for a in decode_answers(r.content)[0]]

    hashed_here = node_answers(None)
    assert node_answers(codes) == hashed_here
    assert node_answers(codes[::-1]) != hashed_here


def test_read_your_writes_across_groups(fleet):
    """Every write acknowledged by the router is found by the next query, whichever group holds
    it; every acknowledged delete is gone; a session token asks for exactly that write."""
    url, X = fleet["procs"]["auto"].url, fleet["X"]
    rng = np.random.default_rng(5)
    groups = set()
    for i in range(24):
        ext = f"ryw{i}"
        groups.add(zlib.crc32(ext.encode()) % 16 % 4)
        v = (X[i] + rng.integers(1, 50, 784)).astype(np.float32)
        sent = {"content": arrow_body([ext], v[None, :]), "headers": {"content-type": ARROW}} if i % 3 == 0 else \
            {"json": {"id": ext, "values": v.tolist()}}  # the Arrow body and JSON: one write path
        w = httpx.post(url + "/vectors", timeout=30, **sent)
        assert w.status_code == 200, w.text
        session = w.headers["x-gmmlsh-session"]
        assert int(session) == w.json()["session"]
        headers = {"x-gmmlsh-consistency": "session", "x-gmmlsh-session": session} if i % 2 else {}
        r = _search(url, v[None, :], headers, k=1, mode="exact")
        assert r.json()["results"][0]["neighbors"][0]["id"] == ext, (i, r.text)
        d = httpx.delete(url + f"/vectors/{ext}", timeout=30)
        assert d.status_code == 200
        r = _search(url, v[None, :], k=3, mode="exact")
        assert ext not in {n["id"] for n in r.json()["results"][0]["neighbors"]}
    assert groups == {0, 1, 2, 3}
    r = _search(url, X[:1], {"x-gmmlsh-consistency": "session", "x-gmmlsh-session": str(10**12)}, k=1)
    assert r.status_code == 409 and r.json()["error"]["field"] == "session"


def test_hedged_replica_hides_a_stopped_one(fleet):
    """SIGSTOP one of group 0's two replicas: queries keep coming back fast (the router asks the
    other one after the group's p95, and then leaves the stopped one alone)."""
    procs, Q = fleet["procs"], fleet["Q"]
    url = procs["r2"].url
    for i in range(30):  # latencies known
        assert _search(url, Q[i:i + 1], k=5).status_code == 200
    stopped = procs["0/2"]
    stopped.signal(signal.SIGSTOP)
    try:
        took = []
        for i in range(40):
            t0 = time.perf_counter()
            r = _search(url, Q[i:i + 1], k=5)
            took.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        assert max(took) < 2.0, took
    finally:
        stopped.signal(signal.SIGCONT)
    procs["r2"].wait_healthy(want={"groups": 2, "replicas": {"0": 2, "1": 1}})


def test_layouts_switch_when_a_group_is_lost_and_back(fleet):
    """The auto router answers through 4 groups; losing one (SIGKILL) it falls back to the
    complete layout of 2, answers unchanged; the node restarted on its disk catches up and the
    router goes back to 4. The fixed router names the missing group (503), or answers from the
    others when asked to."""
    procs, Q, one = fleet["procs"], fleet["Q"][:20], fleet["one"]
    truth = one.query_batch(Q, k=10, mode="exact")
    victim = procs["3/4"]
    victim.kill()
    procs["auto"].wait_healthy(want={"groups": 2}, timeout=30)
    r = _search(procs["auto"].url, Q, k=10, mode="exact")
    for mine, theirs in zip(r.json()["results"], truth, strict=True):
        _same_answer(mine["neighbors"], theirs, 10)
    r = _search(procs["r4"].url, Q, k=10, mode="exact")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "group_unavailable" and "group 3 of 4" in r.json()["error"]["message"]
    r = _search(procs["r4"].url, Q, {"x-gmmlsh-partial": "true"}, k=10, mode="exact")
    assert r.status_code == 200 and r.json()["missing_groups"] == [3] and r.headers["x-gmmlsh-missing-groups"] == "3"
    # a write while it is down: the restarted node catches up from its disk and the feed
    v = (fleet["X"][5] * 0 + 7).astype(np.float32)
    w = httpx.post(procs["auto"].url + "/vectors", json={"id": "while-down", "values": v.tolist()})
    assert w.status_code == 200
    victim.start()
    procs["auto"].wait_healthy(want={"groups": 4})
    r = _search(procs["auto"].url, v[None, :], k=1, mode="exact")
    assert r.json()["results"][0]["neighbors"][0]["id"] == "while-down"
    assert Path(fleet["base"] / "n3of4").exists()
