"""The REST API against a real uvicorn server over HTTP, on LMDB and on Redis.

Each server is a subprocess started the way ``gmmlsh serve`` starts it
(``python -m gmmlsh.service.server`` → :func:`gmmlsh.service.server.serve`, settings from
``GMMLSH_*`` variables) on a free loopback port; answers are compared with an
:class:`gmmlsh.index.index.Index` opened on the same store in this process.

``GMMLSH_TEST_SOAK_SECONDS`` (default 30) sets how long the multi-worker
concurrency test runs on each backend.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from redis_fixtures import RedisServer, redis_url  # noqa: F401  (redis_url: session fixture)

from gmmlsh.index.index import Index
from gmmlsh.index.tuner import MIN_QUERIES

REPO = Path(__file__).resolve().parents[1]
SOAK_SECONDS = float(os.environ.get("GMMLSH_TEST_SOAK_SECONDS", "30"))
START_TIMEOUT = 180.0  # first start may compile numba kernels on a busy machine
DIM = 784
MAX_BODY = 1 << 20
MAX_BATCH = 200
MAX_K = 100

# --- helpers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``gmmlsh serve`` as a subprocess on a free port; stopped with SIGTERM like in production."""

    def __init__(self, tmp: Path, env: dict[str, str], workers: int = 1):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("GMMLSH_")},
            "GMMLSH_HOST": "127.0.0.1",
            "GMMLSH_PORT": str(self.port),
            "GMMLSH_WORKERS": str(workers),
            "GMMLSH_THREADS": "8",
            "GMMLSH_LOG_LEVEL": "warning",
            **env,
        }
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.server"], cwd=REPO,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"server did not become healthy in {START_TIMEOUT:g} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=60, **kw)


class Backend:
    """Where an index lives: the server's env and an in-process Index on the same store."""

    def __init__(self, kind: str, tmp: Path, redis: str | None):
        self.kind = kind
        self.tmp = tmp
        if kind == "lmdb":
            self.location = str(tmp / "index")
            self.prefix = "gmmlsh"
            self.env = {"GMMLSH_INDEX": self.location}
        else:
            assert redis is not None
            self.location = redis
            self.prefix = f"t{uuid.uuid4().hex[:12]}"
            self.env = {"GMMLSH_REDIS_URL": redis, "GMMLSH_PREFIX": self.prefix}
        self.cache_dir = str(tmp / "cache")  # Redis: this machine's search mirror, shared with the server
        self.env.update({"GMMLSH_DIM": str(DIM), "GMMLSH_SAMPLES": "128", "GMMLSH_CACHE_DIR": self.cache_dir,
                         "GMMLSH_MAX_BODY_BYTES": str(MAX_BODY),
                         "GMMLSH_MAX_BATCH": str(MAX_BATCH), "GMMLSH_MAX_K": str(MAX_K)})

    def open_index(self) -> Index:
        """The comparison index: no upkeep of its own (the test decides when it runs)."""
        return Index.open(self.location, prefix=self.prefix, create=False, maintain=False, cache_dir=self.cache_dir)


BACKENDS = ["lmdb", "redis"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tmp_path_factory) -> Backend:
    redis = request.getfixturevalue("redis_url") if request.param == "redis" else None
    return Backend(request.param, tmp_path_factory.mktemp(request.param), redis)


@pytest.fixture(scope="module")
def server(backend: Backend) -> Iterator[Server]:
    srv = Server(backend.tmp, backend.env).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def data(fmnist):
    train, train_labels, test, _ = fmnist
    return train[:300].astype(np.float64), train_labels[:300], test[:20].astype(np.float64)


@pytest.fixture(scope="module")
def loaded(server: Server, backend: Backend, data) -> Iterator[Index]:
    """300 Fashion-MNIST vectors inserted over HTTP (batches of 100), plus two sparse ones."""
    X, labels, _ = data
    with server.client() as c:
        for lo in range(0, len(X), 100):
            body = {"vectors": [
                {"id": f"v{i}", "values": X[i].tolist(), "metadata": {"label": int(labels[i]), "i": i}}
                for i in range(lo, lo + 100)
            ]}
            r = c.post("/vectors", json=body)
            assert r.status_code == 200, r.text
        nz = np.flatnonzero(X[0])
        r = c.post("/vectors", json={"id": "sparse-0", "indices": nz.tolist(),
                                     "values": X[0][nz].tolist(), "metadata": {"sparse": True}})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == len(X) + 1
    index = backend.open_index()
    settle(index, X)
    yield index
    index.close()


def settle(index: Index, X: np.ndarray) -> None:
    """Build the lists and tune the search now, on served queries, so that no process of the
    machine re-tunes while the module compares the server's answers with this process's
    (both read the machine's one search mirror, so they agree once it holds still)."""
    for q in X[:MIN_QUERIES]:
        index.query(q, k=1)  # what the tuner samples as served queries
    deadline = time.monotonic() + 120
    while True:
        index.maintain()  # returns at once while another process holds the mirror's upkeep lock
        view = index.view()
        if view.tuned_on_queries and view.tuned_rows == view.rows:
            return
        assert time.monotonic() < deadline, "the search was not tuned in time"
        time.sleep(0.1)


def count(c: httpx.Client) -> int:
    r = c.get("/stats")
    assert r.status_code == 200, r.text
    return r.json()["count"]


def as_pairs(result) -> list[tuple[str, float]]:
    return [(n.id, n.similarity) for n in result.neighbors]


def http_pairs(body: dict) -> list[tuple[str, float]]:
    return [(n["id"], n["similarity"]) for n in body["neighbors"]]


def assert_same(http: dict, local, k: int, mode: str) -> None:
    """The HTTP answer is the in-process one; ``mode``: the mode asked for (``auto`` and its alias
    ``lsh`` answer with the search the index tuned, named in the answer)."""
    assert http["mode"] == local.mode and http["k"] == k
    assert local.mode in (("sketch", "exact") if mode in ("auto", "lsh") else (mode,))
    assert http["candidates"] == local.candidates
    got, want = http_pairs(http), as_pairs(local)
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=0, atol=1e-12)


# --- 1. answers match the in-process index ------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "lsh", "exact"])
def test_neighbors_by_id_match_index(server, loaded, mode):
    with server.client() as c:
        for i in range(0, 300, 15):
            r = c.get("/neighbors", params={"id": f"v{i}", "k": 10, "mode": mode})
            assert r.status_code == 200, r.text
            body = r.json()
            assert_same(body, loaded.query(id=f"v{i}", k=10, mode=mode), 10, mode)
            assert f"v{i}" not in [n["id"] for n in body["neighbors"]]  # itself excluded
            assert all(n["metadata"] is not None for n in body["neighbors"])


@pytest.mark.parametrize("mode", ["auto", "exact"])
def test_neighbors_by_vector_match_index(server, loaded, data, mode):
    _, _, Q = data
    with server.client() as c:
        for q in Q:
            text = ",".join(str(int(x)) for x in q)
            r = c.get("/neighbors", params={"vector": text, "k": 7, "mode": mode})
            assert r.status_code == 200, r.text
            assert_same(r.json(), loaded.query(q, k=7, mode=mode), 7, mode)


def test_search_body_single_and_batch(server, loaded, data):
    X, _, Q = data
    nz = np.flatnonzero(Q[0])
    with server.client() as c:
        r = c.post("/neighbors/search", json={"values": Q[1].tolist(), "k": 5})
        assert r.status_code == 200, r.text
        assert_same(r.json(), loaded.query(Q[1], k=5), 5, "auto")

        r = c.post("/neighbors/search", json={"indices": nz.tolist(), "values": Q[0][nz].tolist(),
                                              "k": 4, "mode": "exact"})
        assert r.status_code == 200, r.text
        assert_same(r.json(), loaded.query(Q[0], k=4, mode="exact"), 4, "exact")

        # a batch of dense vectors with shared knobs (one query_batch call on the server)
        r = c.post("/neighbors/search", json={"k": 6, "queries": [{"values": q.tolist()} for q in Q]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == len(Q)
        for got, q in zip(results, Q, strict=True):
            assert_same(got, loaded.query(q, k=6), 6, "auto")

        # a mixed batch: per-query knobs override the batch's
        r = c.post("/neighbors/search", json={"k": 3, "queries": [
            {"id": "v5"},
            {"values": Q[2].tolist(), "k": 8, "mode": "exact"},
            {"indices": nz.tolist(), "values": Q[0][nz].tolist(), "candidates": 50},
        ]})
        assert r.status_code == 200, r.text
        a, b, s = r.json()["results"]
        assert_same(a, loaded.query(id="v5", k=3), 3, "auto")
        assert_same(b, loaded.query(Q[2], k=8, mode="exact"), 8, "exact")
        assert_same(s, loaded.query(Q[0], k=3, candidates=50), 3, "auto")


def test_binary_body_matches_json(server, loaded, data):
    """Dense queries as raw little-endian float32 (one or many rows), the knobs in the query string:
    the same answers as the index; a body that is not whole rows, or holds a bad row, is a 422
    naming it, and more rows than max_batch a 413; knobs in the query string beside a JSON body a 422."""
    _, _, Q = data
    raw = Q.astype("<f4")
    octets = {"Content-Type": "application/octet-stream"}
    with server.client() as c:
        r = c.post("/neighbors/search", params={"k": 5}, content=raw[3].tobytes(), headers=octets)
        assert r.status_code == 200, r.text
        (one,) = r.json()["results"]
        assert_same(one, loaded.query(Q[3], k=5), 5, "auto")
        r = c.post("/neighbors/search", params={"k": 4, "mode": "exact"}, content=raw.tobytes(), headers=octets)
        assert r.status_code == 200, r.text
        for got, q in zip(r.json()["results"], Q, strict=True):
            assert_same(got, loaded.query(q, k=4, mode="exact"), 4, "exact")
        bad = raw[:3].copy()
        bad[1, 7] = np.nan
        for body, params, status, field in [
            (raw[0].tobytes()[:-4], {}, 422, "body"),
            (b"", {}, 422, "body"),
            (bad.tobytes(), {}, 422, "body[1]"),
            (bad[1:2].tobytes(), {}, 422, "body[0]"),
            (np.zeros(DIM, "<f4").tobytes(), {}, 422, "body[0]"),
            (raw[0].tobytes(), {"k": "ten"}, 422, "k"),
            (raw[0].tobytes(), {"mode": "cosine"}, 422, "mode"),
            (np.tile(raw[:1], (MAX_BATCH + 1, 1)).tobytes(), {}, 413, "body"),
        ]:
            r = c.post("/neighbors/search", params=params, content=body, headers=octets)
            assert r.status_code == status, r.text
            assert r.json()["error"]["field"] == field, r.text
        # the query string's knobs are the binary body's: beside a JSON body they are refused, not ignored
        for params, field in [({"probes": "AAA"}, "probes"), ({"k": 5}, "k")]:
            r = c.post("/neighbors/search", params=params, json={"values": Q[0].tolist()})
            assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text


def test_concurrent_single_queries_answered_alone_or_together(server, loaded, data):
    """Single queries arriving together are answered as one batch call inside the worker: each
    answer is still exactly the index's, and a bad vector among them fails its request alone."""
    _, _, Q = data
    jobs = [("json", q) for q in Q] + [("binary", q) for q in Q] + [("bad", None)] * 4 + [("id", None)] * 8
    random.Random(1).shuffle(jobs)

    def one(job: tuple[str, np.ndarray | None], c: httpx.Client) -> str | None:
        kind, q = job
        if kind == "json":
            r = c.post("/neighbors/search", json={"values": q.tolist(), "k": 6})
            assert_same(r.json(), loaded.query(q, k=6), 6, "auto")
        elif kind == "binary":
            r = c.post("/neighbors/search", params={"k": 6}, content=q.astype("<f4").tobytes(),
                       headers={"Content-Type": "application/octet-stream"})
            assert_same(r.json()["results"][0], loaded.query(q, k=6), 6, "auto")
        elif kind == "bad":
            r = c.post("/neighbors/search", json={"values": [1.0] * (DIM - 1), "k": 6})
            assert r.status_code == 422 and r.json()["error"]["field"] == "values", r.text
        else:
            r = c.get("/neighbors", params={"id": "v9", "k": 6})
            assert_same(r.json(), loaded.query(id="v9", k=6), 6, "auto")
        return None

    errors: list[BaseException] = []

    def worker(part: list) -> None:
        try:
            with server.client() as c:
                for job in part:
                    one(job, c)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(jobs[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_ping_and_request_head_limits(server):
    """``/ping`` answers a constant; a request line or header block over 16 KiB is refused in the
    API's error shape (the C parser holds no more than h11 did)."""
    with server.client() as c:
        assert c.get("/ping").json() == {"status": "ok"}
        r = c.get("/neighbors", params={"vector": "1," * 9000 + "1"})
        assert r.status_code == 414 and r.json()["error"]["code"] == "uri_too_long"
    with server.client() as c:
        r = c.get("/ping", headers={f"x-pad-{i}": "p" * 1000 for i in range(20)})
        assert r.status_code == 431 and r.json()["error"]["status"] == 431
    with server.client() as c:
        assert c.get("/ping", headers={"x-pad": "p" * 8000}).status_code == 200


def test_min_similarity_and_candidates(server, loaded):
    with server.client() as c:
        r = c.get("/neighbors", params={"id": "v3", "k": 50, "mode": "exact", "min_similarity": 0.6})
        assert r.status_code == 200
        sims = [n["similarity"] for n in r.json()["neighbors"]]
        assert all(s >= 0.6 for s in sims)
        assert_same(r.json(), loaded.query(id="v3", k=50, mode="exact", min_similarity=0.6), 50, "exact")
        r = c.get("/neighbors", params={"id": "v3", "k": 5, "candidates": 20})
        assert r.status_code == 200
        assert r.json()["candidates"] <= 20


def test_get_vector_round_trip(server, loaded, data):
    X, labels, _ = data
    with server.client() as c:
        r = c.get("/vectors/v7")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "v7"
        np.testing.assert_array_equal(np.asarray(body["values"], np.float32), X[7].astype(np.float32))
        assert body["metadata"] == {"label": int(labels[7]), "i": 7}
        r = c.get("/vectors/sparse-0")
        assert r.status_code == 200
        sv = loaded.get("sparse-0")
        assert r.json()["metadata"] == {"sparse": True}
        np.testing.assert_array_equal(np.asarray(r.json()["values"], np.float32), sv.values)


def test_a_mixed_batch_reads_back_in_the_shapes_sent(server, loaded):
    """Dense and sparse vectors of one request each come back in the shape they were sent in
    (both have few nonzeros: the index stores both sparse), and the batch is all or nothing."""
    dense = np.zeros(DIM)
    dense[[3, 70, 500]] = [1.5, 2.0, 0.25]
    idx, val = [5, 80, 600], [1.0, 3.0, 0.5]
    with server.client() as c:
        n0 = count(c)
        bad = {"id": "mix-bad", "indices": [9, 2], "values": [1.0, 1.0]}
        good = [{"id": "mix-d", "values": dense.tolist()}, {"id": "mix-s", "indices": idx, "values": val},
                {"id": 42, "values": dense.tolist(), "metadata": {"n": 42}}]
        for i, v in enumerate(good):
            r = c.post("/vectors", json={"vectors": [*([bad] if i == 1 else []), v, bad]})
            assert r.status_code == 422 and r.json()["error"]["field"] == f"vectors[{0 if i == 1 else 1}].indices"
        assert count(c) == n0  # nothing of a refused batch
        r = c.post("/vectors", json={"vectors": [
            {"id": "mix-d", "values": dense.tolist()}, {"id": "mix-s", "indices": idx, "values": val},
            {"id": 42, "values": (2 * dense).tolist(), "metadata": {"n": 42}}]})
        assert r.status_code == 200, r.text
        d, sparse, by_int = (c.get(f"/vectors/{i}").json() for i in ("mix-d", "mix-s", "42"))
    assert d.get("indices") is None and d["values"] == dense.tolist()
    assert (sparse["indices"], sparse["values"]) == (idx, val)
    assert by_int["id"] == "42" and by_int["metadata"] == {"n": 42} and by_int["values"] == (2 * dense).tolist()
    assert loaded.get("mix-s").indices.tolist() == idx


def test_upsert_replaces_and_float_values_round_trip(server, loaded):
    rng = np.random.default_rng(1)
    v = rng.normal(size=DIM)  # negative entries and non-integers
    with server.client() as c:
        n0 = count(c)
        for meta in ({"version": 1}, {"version": 2}):
            r = c.post("/vectors", json={"id": "odd/id é", "values": v.tolist(), "metadata": meta})
            assert r.status_code == 200, r.text
        assert count(c) == n0 + 1
        r = c.get("/vectors/odd%2Fid%20%C3%A9")
        assert r.status_code == 200, r.text
        assert r.json()["metadata"] == {"version": 2}
        np.testing.assert_array_equal(np.asarray(r.json()["values"], np.float32), v.astype(np.float32))
        text = ",".join(str(x) for x in v.astype(np.float32))  # fits the ~16 KiB request line
        r = c.get("/neighbors", params={"vector": text, "k": 1, "mode": "exact"})
        assert r.status_code == 200, r.text
        assert r.json()["neighbors"][0]["id"] == "odd/id é"
        assert r.json()["neighbors"][0]["similarity"] == pytest.approx(1.0, abs=1e-6)
        assert c.delete("/vectors/odd%2Fid%20%C3%A9").status_code == 200
        assert count(c) == n0


def test_an_id_repeated_in_a_batch_is_stored_once_and_counted_once(server, loaded):
    """The last vector of a repeated id is the one stored, and ``upserted`` counts ids written,
    not mentions; ``replaced`` counts ids that held a vector before (issue #35, item 9)."""
    v = np.zeros(DIM)
    v[:10] = 1.0
    with server.client() as c:
        n0 = count(c)
        assert c.post("/vectors", json={"id": "before", "values": v.tolist()}).json()["upserted"] == 1
        r = c.post("/vectors", json={"vectors": [{"id": "twice", "values": v.tolist()},
                                                 {"id": "twice", "values": (2 * v).tolist()},
                                                 {"id": "before", "values": (3 * v).tolist()}]})
        assert r.status_code == 200, r.text
        assert r.json()["upserted"] == 2  # "twice" once, "before" once
        assert r.json() == {"upserted": 2, "replaced": 1, "count": n0 + 2}
        assert c.get("/vectors/twice").json()["values"][0] == 2.0
        for name in ("twice", "before"):
            assert c.delete(f"/vectors/{name}").status_code == 200


def test_delete_then_404(server, loaded, data):
    X, _, _ = data
    with server.client() as c:
        r = c.post("/vectors", json={"id": "doomed", "values": X[3].tolist()})
        assert r.status_code == 200
        n = count(c)
        r = c.delete("/vectors/doomed")
        assert r.status_code == 200 and r.json() == {"deleted": 1, "count": n - 1}
        for method, path, params in [("GET", "/vectors/doomed", None), ("DELETE", "/vectors/doomed", None),
                                     ("GET", "/neighbors", {"id": "doomed"})]:
            r = c.request(method, path, params=params)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "not_found"
        # gone from every neighbour list too
        r = c.get("/neighbors", params={"vector": ",".join(str(int(x)) for x in X[3]), "k": 20, "mode": "exact"})
        assert "doomed" not in [n["id"] for n in r.json()["neighbors"]]
        assert count(c) == n - 1


# --- 2. the bad-input table ---------------------------------------------------------------

GOOD = [1.0] * DIM


def _vec(**kw) -> dict:
    return {"id": "bad-new", "values": GOOD, **kw}


def _sparse(indices, values) -> dict:
    return {"id": "bad-new", "indices": indices, "values": values}


# (name, method, path, kwargs for httpx, status, error.field)
BAD_INPUT = [
    ("wrong dimension", "POST", "/vectors", {"json": {"vectors": [_vec(values=[1.0, 2.0])]}},
     422, "vectors[0].values"),
    ("wrong dimension, 2nd of a batch", "POST", "/vectors",
     {"json": {"vectors": [_vec(id="ok-1"), _vec(values=GOOD + [1.0])]}}, 422, "vectors[1].values"),
    ("NaN", "POST", "/vectors",
     {"content": '{"vectors": [{"id": "x", "values": [NaN' + ", 1" * (DIM - 1) + "]}]}"},
     422, "vectors[0].values"),
    ("inf", "POST", "/vectors", {"content": '{"id": "x", "values": [1' + ", 1e999" * (DIM - 1) + "]}"},
     422, "values"),
    ("-Infinity in a query", "POST", "/neighbors/search",
     {"content": '{"values": [-Infinity' + ", 1" * (DIM - 1) + "]}"}, 422, "values"),
    ("all-zero dense", "POST", "/vectors", {"json": {"vectors": [_vec(id="ok-2"), _vec(values=[0.0] * DIM)]}},
     422, "vectors[1].values"),
    ("all-zero sparse", "POST", "/vectors", {"json": _sparse([1, 2], [0.0, 0.0])}, 422, "values"),
    ("empty sparse", "POST", "/vectors", {"json": _sparse([], [])}, 422, "values"),
    ("all-zero query", "GET", "/neighbors", {"params": {"vector": ",".join(["0"] * DIM)}}, 422, "vector"),
    ("unsorted indices", "POST", "/vectors", {"json": _sparse([5, 3], [1.0, 2.0])}, 422, "indices"),
    ("duplicate indices", "POST", "/vectors", {"json": _sparse([3, 3], [1.0, 2.0])}, 422, "indices"),
    ("index out of range", "POST", "/vectors", {"json": _sparse([3, DIM], [1.0, 2.0])}, 422, "indices"),
    ("negative index", "POST", "/vectors", {"json": _sparse([-1, 3], [1.0, 2.0])}, 422, "indices"),
    ("indices/values mismatch", "POST", "/vectors", {"json": _sparse([1, 2, 3], [1.0, 2.0])}, 422, "indices"),
    ("fractional index", "POST", "/vectors", {"json": _sparse([1.5], [1.0])}, 422, "indices[0]"),
    ("a query value that is not a number", "POST", "/neighbors/search", {"json": {"values": [1.0, True] + GOOD[2:]}},
     422, "values[1]"),
    ("a query value that is null, in a batch", "POST", "/neighbors/search",
     {"json": {"queries": [{"id": "v1"}, {"values": GOOD[:5] + [None] + GOOD[6:]}]}}, 422, "queries[1].values[5]"),
    ("non-number value", "POST", "/vectors", {"json": {"vectors": [_vec(values=["a"] * DIM)]}},
     422, "vectors[0].values[0]"),
    ("missing id", "POST", "/vectors", {"json": {"vectors": [{"values": GOOD}]}}, 422, "vectors[0].id"),
    ("empty id", "POST", "/vectors", {"json": _vec(id="")}, 422, "id"),
    ("overlong id", "POST", "/vectors", {"json": _vec(id="x" * 513)}, 422, "id"),
    ("unknown field", "POST", "/vectors", {"json": _vec(indicies=[1])}, 422, "indicies"),
    ("metadata not an object", "POST", "/vectors", {"json": _vec(metadata=[1, 2])}, 422, "metadata"),
    ("empty batch", "POST", "/vectors", {"json": {"vectors": []}}, 422, "vectors"),
    ("malformed JSON", "POST", "/vectors", {"content": '{"vectors": [{"id": "x", "values": [1, 2'},
     422, "body"),
    ("not JSON at all", "POST", "/neighbors/search", {"content": "hello"}, 422, "body"),
    ("empty body", "POST", "/vectors", {"content": b""}, 422, "body"),
    ("k = 0", "GET", "/neighbors", {"params": {"id": "v1", "k": 0}}, 422, "k"),
    ("k < 0", "POST", "/neighbors/search", {"json": {"id": "v1", "k": -3}}, 422, "k"),
    ("k over the cap", "GET", "/neighbors", {"params": {"id": "v1", "k": MAX_K + 1}}, 422, "k"),
    ("k over the cap in a batch", "POST", "/neighbors/search",
     {"json": {"queries": [{"id": "v1"}, {"id": "v2", "k": 10**6}]}}, 422, "queries[1].k"),
    ("k not a number", "GET", "/neighbors", {"params": {"id": "v1", "k": "ten"}}, 422, "k"),
    ("unknown mode", "GET", "/neighbors", {"params": {"id": "v1", "mode": "cosine"}}, 422, "mode"),
    ("unknown mode in body", "POST", "/neighbors/search", {"json": {"id": "v1", "mode": "fast"}}, 422, "mode"),
    ("nrff on an index without it", "GET", "/neighbors", {"params": {"id": "v1", "mode": "nrff"}}, 422, "mode"),
    ("min_similarity > 1", "GET", "/neighbors", {"params": {"id": "v1", "min_similarity": 2}}, 422,
     "min_similarity"),
    ("candidates = 0", "GET", "/neighbors", {"params": {"id": "v1", "candidates": 0}}, 422, "candidates"),
    ("probes < 0", "GET", "/neighbors", {"params": {"id": "v1", "probes": -1}}, 422, "probes"),
    ("neither id nor vector", "GET", "/neighbors", {"params": {"k": 3}}, 422, "vector"),
    ("both id and vector in the URL", "GET", "/neighbors", {"params": {"id": "v1", "vector": "1,2"}}, 422,
     "vector"),
    ("both id and vector", "POST", "/neighbors/search", {"json": {"id": "v1", "values": GOOD}}, 422, "id"),
    ("query vector not numbers", "GET", "/neighbors", {"params": {"vector": "1,2,x"}}, 422, "vector"),
    ("query wrong dimension", "GET", "/neighbors", {"params": {"vector": "1,2,3"}}, 422, "vector"),
    ("bad query in a batch", "POST", "/neighbors/search",
     {"json": {"queries": [{"id": "v1"}, {"indices": [2, 1], "values": [1, 1]}]}}, 422, "queries[1].indices"),
    ("unknown id: GET vector", "GET", "/vectors/no-such-id", {}, 404, "id"),
    ("unknown id: DELETE", "DELETE", "/vectors/no-such-id", {}, 404, "id"),
    ("unknown id: neighbors", "GET", "/neighbors", {"params": {"id": "no-such-id"}}, 404, "id"),
    ("unknown id in a batch", "POST", "/neighbors/search",
     {"json": {"queries": [{"id": "v1"}, {"id": "no-such-id"}]}}, 404, "queries[1].id"),
    ("body over the cap", "POST", "/vectors", {"content": b'{"id": "x", "values": [' + b"1," * MAX_BODY + b"1]}"},
     413, None),
    ("body over the cap, chunked", "POST", "/vectors",
     {"content": "CHUNKED"}, 413, None),
    ("too many vectors", "POST", "/vectors",
     {"json": {"vectors": [_sparse([i % DIM], [1.0]) | {"id": f"m{i}"} for i in range(MAX_BATCH + 1)]}},
     413, "vectors"),
    ("too many queries", "POST", "/neighbors/search",
     {"json": {"queries": [{"id": "v1"}] * (MAX_BATCH + 1)}}, 413, "queries"),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,field", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input(server, loaded, name, method, path, kwargs, status, field):
    if kwargs.get("content") == "CHUNKED":  # a generator body: sent without Content-Length
        kwargs = {"content": iter([b'{"id": "x", "values": ['] + [b"1," * 65536] * 20 + [b"1]}"])}
    with server.client() as c:
        before = count(c)
        r = c.request(method, path, **kwargs)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["status"] == status and err["message"]
        if field is not None:
            assert err["field"] == field, err
        assert "Traceback" not in r.text
        assert len(r.content) < 4096, "an error must not echo the submitted input back"
    with server.client() as c:  # a fresh connection: a 413 may close the old one
        assert count(c) == before
        for ext_id in ("bad-new", "ok-1", "ok-2", "x", "m0"):
            assert c.get(f"/vectors/{ext_id}").status_code == 404


def test_unknown_route_and_method_and_no_cors_by_default(server):
    with server.client() as c:
        r = c.get("/health", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers
        r = c.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = c.put("/vectors")
        assert r.status_code == 405 and "error" in r.json()


# --- OpenAPI, health, stats, metrics --------------------------------------------------------


def test_openapi_lists_every_error_code(server):
    with server.client() as c:
        spec = c.get("/openapi.json").json()
        page = c.get("/docs")
        assert page.status_code == 200 and "cdn" not in page.text.lower()  # works on an offline host
        for asset in re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', page.text):
            assert c.get(asset).status_code == 200, asset
        assert len(re.findall(r"/docs/assets/", page.text)) >= 2  # the script and the stylesheet
    paths = spec["paths"]
    expected = {
        ("post", "/vectors"): {"200", "401", "413", "422", "500", "503"},
        ("get", "/vectors/{id}"): {"200", "401", "404", "422", "500", "503"},
        ("delete", "/vectors/{id}"): {"200", "401", "404", "422", "500", "503"},
        ("get", "/neighbors"): {"200", "401", "404", "422", "500", "503"},
        ("post", "/neighbors/search"): {"200", "401", "404", "413", "422", "500", "503"},
        ("get", "/health"): {"200", "500", "503"},
        ("get", "/stats"): {"200", "401", "500", "503"},
        ("get", "/metrics"): {"200", "401", "500"},
    }
    for (method, path), codes in expected.items():
        assert set(paths[path][method]["responses"]) >= codes, (method, path)
        for code in codes - {"200"}:
            ref = paths[path][method]["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    schemas = spec["components"]["schemas"]
    for name in ("UpsertRequest", "SearchRequest", "VectorIn", "SearchQuery", "ErrorResponse",
                 "NeighborsResponse"):
        assert name in schemas
    assert paths["/vectors"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"] \
        == "#/components/schemas/UpsertRequest"
    assert "16 KiB" in paths["/neighbors"]["get"]["description"]


def test_health_stats_metrics(server, loaded, backend):
    with server.client() as c:
        assert c.get("/health").json() == {"status": "ok", "backend": backend.kind, "writable": True,
                                           "search_current": True}
        stats = c.get("/stats").json()
        assert stats["config"]["dim"] == DIM and stats["config"]["samples"] == 128
        assert stats["count"] == loaded.count()
        assert stats["service"]["max_k"] == MAX_K
        assert stats["search"]["tuned_on"] == "queries" and stats["search"]["candidates"] >= 1
        assert stats["mirror"]["rows"] >= stats["count"] and stats["pid"] > 0
        assert "path" not in stats["store"] and backend.tmp.name not in str(stats)  # no server paths
        c.get("/neighbors", params={"id": "v1", "k": 3})
        text = c.get("/metrics").text
    assert f"gmmlsh_index_vectors {float(loaded.count())}" in text
    assert "gmmlsh_store_up 1.0" in text
    assert 'gmmlsh_http_requests_total{collection="default",method="GET",route="/neighbors",status="200"}' in text
    assert 'route="/vectors/v' not in text  # route templates, never ids, as labels
    assert 'gmmlsh_query_candidates_count{mode="sketch"}' in text
    assert "gmmlsh_http_request_duration_seconds_bucket" in text


# --- 3. two workers, eight clients, inserts and queries mixed --------------------------------


def test_two_workers_under_concurrent_load(backend_kind, tmp_path, redis_url_if, fmnist):
    """8 client threads mix inserts, queries and reads on a 2-worker server for
    SOAK_SECONDS: no errors, every insert visible at once to the *other* worker's
    reads (reads use a fresh connection), and the final count is exact."""
    be = Backend(backend_kind, tmp_path, redis_url_if)
    srv = Server(tmp_path, be.env, workers=2).start()
    train = fmnist[0][:2000].astype(np.float64)
    errors: list[str] = []
    inserted: list[set[str]] = [set() for _ in range(8)]
    pids: set[int] = set()
    ops = [0] * 8
    insert_posts = [0] * 8
    lock = threading.Lock()
    deadline = time.monotonic() + SOAK_SECONDS

    def check(r: httpx.Response, what: str) -> bool:
        if r.status_code != 200:
            with lock:
                errors.append(f"{what}: {r.status_code} {r.text[:300]}")
            return False
        return True

    def client_thread(t: int) -> None:
        rng = random.Random(t)
        writer = srv.client()
        n = 0
        try:
            while time.monotonic() < deadline and not errors:
                ops[t] += 1
                op = rng.random()
                if op < 0.35 or not inserted[t]:
                    size = rng.randint(1, 8)
                    ids = [f"t{t}-{n + j}" for j in range(size)]
                    rows = [rng.randrange(len(train)) for _ in ids]
                    body = {"vectors": [{"id": i, "values": train[r].tolist(), "metadata": {"row": r}}
                                        for i, r in zip(ids, rows, strict=True)]}
                    if check(writer.post("/vectors", json=body), "insert"):
                        insert_posts[t] += 1
                        inserted[t].update(ids)
                        n += size
                        # read back through a new connection, i.e. maybe the other worker
                        with srv.client() as reader:
                            got = reader.get(f"/vectors/{ids[-1]}")
                            if check(got, f"read-after-write {ids[-1]}"):
                                assert got.json()["metadata"] == {"row": rows[-1]}
                            st = reader.get("/stats")
                            if check(st, "stats"):
                                with lock:
                                    pids.add(st.json()["pid"])
                elif op < 0.6:
                    q = train[rng.randrange(len(train))]
                    check(writer.get("/neighbors", params={"vector": ",".join(str(int(x)) for x in q),
                                                           "k": 10}), "query by vector")
                elif op < 0.8:
                    ext = rng.choice(sorted(inserted[t]))
                    r = writer.get("/neighbors", params={"id": ext, "k": 5})
                    if check(r, f"query by id {ext}"):
                        assert ext not in [x["id"] for x in r.json()["neighbors"]]
                elif op < 0.9:
                    qs = [{"values": train[rng.randrange(len(train))].tolist()} for _ in range(4)]
                    check(writer.post("/neighbors/search", json={"k": 3, "queries": qs}), "batch search")
                else:
                    ext = rng.choice(sorted(inserted[t]))
                    check(writer.get(f"/vectors/{ext}"), f"get {ext}")
                if ops[t] % 25 == 0:  # hop to a new connection now and then
                    writer.close()
                    writer = srv.client()
        except Exception as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(f"thread {t}: {type(exc).__name__}: {exc}")
        finally:
            writer.close()

    try:
        threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(SOAK_SECONDS + 120)
        assert not errors, (errors[:5], srv.log())
        total = sum(len(s) for s in inserted)
        print(f"soak {backend_kind}: {sum(ops)} requests groups, {sum(insert_posts)} inserts, "
              f"{total} vectors, pids {sorted(pids)}")
        assert total > 0 and sum(ops) >= 8 * 10
        with srv.client() as c:
            assert count(c) == total
            metrics = c.get("/metrics").text
        assert len(pids) == 2, f"expected answers from both workers, saw pids {pids}"
        # /metrics aggregates both workers (prometheus multiprocess mode)
        inserts = 'gmmlsh_http_requests_total{collection="default",method="POST",route="/vectors",status="200"}'
        posts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(inserts)]
        assert posts == [float(sum(insert_posts))], "every insert counted once, whichever worker took it"
        with be.open_index() as index:
            assert index.count() == total
            some = sorted(inserted[0])[:5]
            assert all(index.contains(i) for i in some)
    finally:
        srv.stop()
    assert srv.proc is not None and srv.proc.returncode == 0, srv.log()


@pytest.fixture(params=BACKENDS)
def backend_kind(request) -> str:
    return request.param


@pytest.fixture
def redis_url_if(request, backend_kind) -> str | None:
    return request.getfixturevalue("redis_url") if backend_kind == "redis" else None


def test_multi_worker_listener_gives_connections_tcp_nodelay():
    """``--workers N`` listens on a socket uvicorn binds with proto 0 (uvicorn #3149);
    asyncio then leaves Nagle on and each keep-alive response waits ~40 ms on the
    client's delayed ACK. Our listener must make asyncio set TCP_NODELAY."""
    import asyncio

    import uvicorn

    from gmmlsh.service.server import APP, tcp_listener

    sock = tcp_listener(uvicorn.Config(APP, host="127.0.0.1", port=0, workers=2))
    assert sock.proto == socket.IPPROTO_TCP

    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            flag = await asyncio.wait_for(seen, 10)
            writer.close()
        return flag

    assert asyncio.run(accepted_nodelay()) != 0


# --- 4. API key -------------------------------------------------------------------------


def test_api_key_and_cors(tmp_path):
    be = Backend("lmdb", tmp_path, None)
    srv = Server(tmp_path, {**be.env, "GMMLSH_API_KEY": "s3cret-key",
                            "GMMLSH_CORS_ORIGINS": "https://app.example"}).start()
    try:
        with srv.client() as c:  # a CORS preflight needs no key; only listed origins are allowed
            pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-api-key"}
            r = c.options("/vectors", headers={"Origin": "https://app.example", **pre})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "https://app.example"
            r = c.options("/vectors", headers={"Origin": "https://evil.example", **pre})
            assert "access-control-allow-origin" not in r.headers
        body = {"id": "a", "values": GOOD}
        with srv.client() as c:
            assert c.get("/health").status_code == 200  # probes need no key
            for method, path, kw in [("POST", "/vectors", {"json": body}), ("GET", "/vectors/a", {}),
                                     ("GET", "/neighbors", {"params": {"id": "a"}}), ("GET", "/stats", {}),
                                     ("GET", "/metrics", {}), ("DELETE", "/vectors/a", {}),
                                     ("POST", "/neighbors/search", {"json": {"id": "a"}})]:
                for headers in ({}, {"X-API-Key": "wrong"}, {"X-API-Key": "s3cret-key-"},
                                {"Authorization": "Bearer nope"}):
                    r = c.request(method, path, headers=headers, **kw)
                    assert r.status_code == 401, (method, path, headers, r.text)
                    assert r.json()["error"]["code"] == "unauthorized"
            assert c.get("/stats", headers={"X-API-Key": "s3cret-key"}).json()["count"] == 0
            ok = {"X-API-Key": "s3cret-key"}
            assert c.post("/vectors", json=body, headers=ok).status_code == 200
            assert c.get("/vectors/a", headers=ok).status_code == 200
            assert c.get("/neighbors", params={"id": "a"}, headers=ok).status_code == 200
            assert c.get("/metrics", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
            assert c.delete("/vectors/a", headers=ok).status_code == 200
            spec = c.get("/openapi.json").json()
            assert "APIKeyHeader" in spec["components"]["securitySchemes"]
    finally:
        srv.stop()


def test_the_readme_scrape_config_scrapes_a_server_with_an_api_key(tmp_path):
    """The README's Prometheus scrape configuration, read and followed as Prometheus does
    (``authorization`` sends ``Authorization: <type, Bearer by default> <the file's key>``),
    against a server with an API key; the requests are counted by collection (issue #35, 11)."""
    import yaml

    text = (REPO / "README.md").read_text()
    block = re.search(r"^### Metrics\n.*?^```yaml\n(.*?)^```", text, re.M | re.S)
    assert block, "the README's Metrics section has no yaml block"
    job = yaml.safe_load(block[1])["scrape_configs"][0]
    key_file = tmp_path / Path(job["authorization"]["credentials_file"]).name
    key_file.write_text("scrape-key\n")
    be = Backend("lmdb", tmp_path, None)
    srv = Server(tmp_path, {**be.env, "GMMLSH_API_KEY": "scrape-key"}).start()
    try:
        header = f"{job['authorization'].get('type', 'Bearer')} {key_file.read_text().strip()}"
        target = job["static_configs"][0]["targets"][0]
        assert target.split(":")[0] in ("127.0.0.1", "localhost")
        with httpx.Client(base_url=srv.base, timeout=30) as c:  # the server's own port for the target's
            path = job.get("metrics_path", "/metrics")
            assert c.get(path).status_code == 401
            c.post("/vectors", json={"id": "a", "values": GOOD}, headers={"X-API-Key": "scrape-key"})
            c.post("/collections", json={"name": "small", "dim": 3}, headers={"X-API-Key": "scrape-key"})
            c.post("/collections/small/vectors", json={"id": "a", "values": [1, 2, 3]},
                   headers={"X-API-Key": "scrape-key"})
            c.get("/collections/nope/vectors/a", headers={"X-API-Key": "scrape-key"})
            r = c.get(path, headers={"Authorization": header})
            assert r.status_code == 200 and "gmmlsh_index_vectors 1.0" in r.text
        counted = {line.rsplit(" ", 1)[0] for line in r.text.splitlines()
                   if line.startswith("gmmlsh_http_requests_total")}
        assert {'gmmlsh_http_requests_total{collection="small",method="POST",route="/vectors",status="200"}',
                'gmmlsh_http_requests_total{collection="default",method="POST",route="/vectors",status="200"}',
                'gmmlsh_http_requests_total{collection="-",method="GET",route="/metrics",status="401"}',
                'gmmlsh_http_requests_total{collection="-",method="GET",route="/vectors/{id}",status="404"}',
                } <= counted, counted
        assert 'collection="nope"' not in r.text
    finally:
        srv.stop()


# --- startup and a store that goes away ---------------------------------------------------------


def test_new_index_without_dim_refuses_to_start(tmp_path):
    srv = Server(tmp_path, {"GMMLSH_INDEX": str(tmp_path / "none")})
    srv.env.pop("GMMLSH_DIM", None)
    with pytest.raises(pytest.fail.Exception) as exc:
        srv.start()
    assert "GMMLSH_DIM" in str(exc.value)
    srv.stop()


def test_existing_index_keeps_its_parameters(tmp_path):
    """Creation settings only apply to a new index: a restart with other ones is harmless."""
    be = Backend("lmdb", tmp_path, None)
    srv = Server(tmp_path, be.env).start()
    with srv.client() as c:
        assert c.post("/vectors", json={"id": "a", "values": GOOD}).status_code == 200
    srv.stop()
    srv = Server(tmp_path, {**be.env, "GMMLSH_DIM": "3", "GMMLSH_SAMPLES": "7"}).start()
    try:
        with srv.client() as c:
            stats = c.get("/stats").json()
            assert stats["config"]["dim"] == DIM and stats["config"]["samples"] == 128
            assert stats["count"] == 1
    finally:
        srv.stop()


def test_redis_down_gives_503(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    be = Backend("redis", tmp_path, redis.url)
    srv = Server(tmp_path, be.env).start()
    try:
        with srv.client() as c:
            assert c.post("/vectors", json={"id": "a", "values": GOOD}).status_code == 200
        redis.stop()
        with srv.client() as c:
            for method, path, kw in [("GET", "/health", {}), ("GET", "/neighbors", {"params": {"id": "a"}}),
                                     ("POST", "/vectors", {"json": {"id": "b", "values": GOOD}}),
                                     ("GET", "/stats", {})]:
                t0 = time.monotonic()
                r = c.request(method, path, **kw)
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["code"] == "unavailable"
                assert "Traceback" not in r.text
                assert time.monotonic() - t0 < 15, "a down store must not hang requests"
            text = c.get("/metrics").text
            assert "gmmlsh_store_up 0.0" in text
    finally:
        srv.stop()
        redis.stop()


def test_lmdb_gone_gives_503(tmp_path):
    be = Backend("lmdb", tmp_path, None)
    srv = Server(tmp_path, be.env).start()
    try:
        shutil.rmtree(be.location)
        with srv.client() as c:
            r = c.get("/health")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "unavailable"
    finally:
        srv.stop()
