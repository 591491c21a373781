"""``gmmlsh.Client`` against a real ``gmmlsh serve`` over HTTP (no mocks).

One LMDB server with an API key for the module, started by test_service's ``Server`` /
``Backend`` (the same launcher and settings: 784 dimensions, 128 samples, max_k 100,
max_batch 200); the answers are checked against what was sent and against exact GMM computed
here with numpy. The error-shape tests use a tiny real HTTP server that answers like a proxy.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import scipy.sparse as sp
from test_service import DIM, MAX_BATCH, Backend, Server, free_port

import gmmlsh
from gmmlsh.client import (
    ApiError,
    Client,
    DeleteResult,
    Health,
    Neighbor,
    NoResponseError,
    QueryResult,
    Stats,
    StoredVector,
    UpsertResult,
)

KEY = "client-test-key"
N = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("client")
    srv = Server(tmp, {**Backend("lmdb", tmp, None).env, "GMMLSH_API_KEY": KEY}).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with gmmlsh.Client(server.base, api_key=KEY, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def X() -> np.ndarray:
    """Non-negative rows, about 70 % zeros (image-like), no two alike."""
    rng = np.random.default_rng(7)
    return rng.gamma(2.0, 50.0, size=(N, DIM)) * (rng.random((N, DIM)) < 0.3)


@pytest.fixture(scope="module")
def loaded(server: Server, X: np.ndarray) -> np.ndarray:
    """``d0`` … ``d59`` stored dense with metadata; returns them as stored (float32)."""
    with Client(server.base, api_key=KEY) as c:
        out = c.upsert([f"d{i}" for i in range(N)], X, metadata=[{"row": i, "tag": "dense"} for i in range(N)])
    assert out == UpsertResult(upserted=N, count=N)
    return X.astype(np.float32)


def exact_top(stored: np.ndarray, q: np.ndarray, k: int, skip: int | None = None) -> list[tuple[str, float]]:
    """Exact GMM of non-negative rows (Σ min / Σ max), best first, as the server's ids."""
    q = q.astype(np.float64)
    S = stored.astype(np.float64)
    sims = np.minimum(S, q).sum(axis=1) / np.maximum(S, q).sum(axis=1)
    order = [i for i in np.argsort(-sims, kind="stable") if i != skip][:k]
    return [(f"d{i}", float(sims[i])) for i in order]


def pairs(r: QueryResult) -> list[tuple[str, float]]:
    return [(n.id, n.similarity) for n in r.neighbors]


def assert_pairs(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=1e-6)


# --- vectors ----------------------------------------------------------------------------------


def test_dense_round_trip_with_metadata(client, loaded):
    for i in (0, 17, N - 1):
        sv = client.get(f"d{i}")
        assert isinstance(sv, StoredVector) and sv.id == f"d{i}"
        assert sv.indices is None and sv.values.dtype == np.float32
        np.testing.assert_array_equal(sv.values, loaded[i])
        assert sv.metadata == {"row": i, "tag": "dense"}
    # one vector, from a list and from a float32 array (sent exactly: float32 written as float32)
    v = np.random.default_rng(1).normal(size=DIM).astype(np.float32)  # negative entries too
    assert client.upsert("one-list", v.tolist()).upserted == 1
    assert client.upsert("one-f32", v, metadata={"nested": {"a": [1, 2.5, None]}}).upserted == 1
    for ext_id in ("one-list", "one-f32"):
        np.testing.assert_array_equal(client.get(ext_id).values, v)
    assert client.get("one-list").metadata is None
    assert client.get("one-f32").metadata == {"nested": {"a": [1, 2.5, None]}}
    client.delete("one-list")
    client.delete("one-f32")


def test_sparse_round_trip_sent_as_nonzeros(client, loaded):
    rng = np.random.default_rng(2)
    dense = np.zeros((3, DIM))
    for row in dense:
        cols = rng.choice(DIM, 12, replace=False)
        row[cols] = rng.normal(size=12)
    M = sp.csr_matrix(dense)
    out = client.upsert(["s0", "s1", "s2"], M, metadata=[{"k": 0}, None, {"k": 2}])
    assert out.upserted == 3 and out.count == N + 3
    for i in range(3):
        sv = client.get(f"s{i}")
        assert sv.indices is not None, "a sparse row must be stored (hence sent) sparse"
        np.testing.assert_array_equal(sv.indices, np.flatnonzero(dense[i]))
        np.testing.assert_array_equal(sv.values, dense[i][dense[i] != 0].astype(np.float32))
        np.testing.assert_array_equal(sv.toarray(DIM), dense[i].astype(np.float32))
        assert sv.metadata == ([{"k": 0}, None, {"k": 2}][i])
    # one row in other forms: CSR and COO with unsorted, repeated entries (scipy adds them up),
    # a 1-D sparse array, and an (indices, values) pair
    data, cols = [1.0, 2.0, 0.5, 0.25], [700, 3, 700, 42]
    for row in (sp.csr_matrix((data, cols, [0, 4]), shape=(1, DIM)),
                sp.coo_matrix((data, ([0, 0, 0, 0], cols)), shape=(1, DIM))):
        client.upsert("s-coo", row)
        sv = client.get("s-coo")
        assert sv.indices.tolist() == [3, 42, 700] and sv.values.tolist() == [2.0, 0.25, 1.5]
    client.upsert("s-1d", sp.coo_array(dense[0]))
    np.testing.assert_array_equal(client.get("s-1d").indices, np.flatnonzero(dense[0]))
    client.upsert("s-pair", ([5, 9], [1.0, 2.0]))
    sv = client.get("s-pair")
    assert sv.indices.tolist() == [5, 9] and sv.values.tolist() == [1.0, 2.0]
    for ext_id in ("s0", "s1", "s2", "s-coo", "s-1d", "s-pair"):
        client.delete(ext_id)


def test_ids_integers_and_odd_characters(client, loaded):
    v = loaded[5]
    for ext_id in (42, np.int64(43), "a/b?c#d é", ".", "..", "100%", "line\nbreak"):
        client.upsert(ext_id, v, metadata={"id": str(ext_id)})
        sv = client.get(ext_id)
        assert sv.id == str(ext_id) and sv.metadata == {"id": str(ext_id)}
        r = client.query(id=ext_id, k=1, mode="exact")
        assert r.neighbors[0].id == "d5" and r.neighbors[0].similarity == pytest.approx(1.0, abs=1e-6)
        assert client.delete(ext_id).deleted == 1
    assert client.upsert([7, "seven"], [v, v]).upserted == 2
    assert client.get("7").id == "7"
    client.delete(7)
    client.delete("seven")


# --- queries ----------------------------------------------------------------------------------


def test_query_by_id_and_by_vector(client, loaded):
    r = client.query(id="d3", k=5, mode="exact")
    assert isinstance(r, QueryResult) and r.mode == "exact" and r.k == 5 and r.candidates >= N - 1
    assert all(isinstance(n, Neighbor) for n in r.neighbors)
    assert_pairs(pairs(r), exact_top(loaded, loaded[3], 5, skip=3))  # itself left out
    assert [n.metadata for n in r.neighbors] == [{"row": int(n.id[1:]), "tag": "dense"} for n in r.neighbors]

    r = client.query(loaded[3], k=5, mode="exact")
    assert r.neighbors[0].id == "d3" and r.neighbors[0].similarity == pytest.approx(1.0, abs=1e-6)
    assert_pairs(pairs(r), exact_top(loaded, loaded[3], 5))

    q = loaded[4] * (np.random.default_rng(3).random(DIM) < 0.5)  # a new vector, sent sparse
    r_sparse = client.query(sp.csr_matrix(q), k=4, mode="exact")
    r_dense = client.query(q, k=4, mode="exact", min_similarity=0.0)
    assert pairs(r_sparse) == pairs(r_dense)
    assert_pairs(pairs(r_dense), exact_top(loaded, q, 4))

    r = client.query(id="d3", k=3)  # the server's default mode
    assert r.mode in ("sketch", "exact") and len(r.neighbors) == 3 and "d3" not in [n.id for n in r.neighbors]
    sims = [n.similarity for n in r.neighbors]
    assert sims == sorted(sims, reverse=True)
    r = client.query(id="d3", k=50, mode="exact", min_similarity=0.99)
    assert r.neighbors == ()


def test_query_batch(client, loaded):
    Q = loaded[[1, 8, 20]]
    by_rows = client.query_batch(Q, k=3, mode="exact")
    assert len(by_rows) == 3 and all(isinstance(r, QueryResult) for r in by_rows)
    for r, q in zip(by_rows, Q, strict=True):
        assert r.k == 3 and r.mode == "exact"
        assert_pairs(pairs(r), exact_top(loaded, q, 3))
    by_sparse = client.query_batch(sp.csr_matrix(Q), k=3, mode="exact")
    by_list = client.query_batch([Q[0], sp.csr_matrix(Q[1]), Q[2].tolist()], k=3, mode="exact")
    assert [pairs(r) for r in by_sparse] == [pairs(r) for r in by_list] == [pairs(r) for r in by_rows]
    by_ids = client.query_batch(ids=["d1", "d8", "d20"], k=2, mode="exact")
    for r, i in zip(by_ids, (1, 8, 20), strict=True):
        assert_pairs(pairs(r), exact_top(loaded, loaded[i], 2, skip=i))


# --- errors -----------------------------------------------------------------------------------


def test_delete_then_get_is_a_404(client, loaded):
    n = client.stats().count
    client.upsert("doomed", loaded[9], metadata={"x": 1})
    assert client.delete("doomed") == DeleteResult(deleted=1, count=n)
    for call in (lambda: client.get("doomed"), lambda: client.delete("doomed"),
                 lambda: client.query(id="doomed")):
        with pytest.raises(ApiError) as exc:
            call()
        e = exc.value
        assert (e.status, e.code, e.field) == (404, "not_found", "id")
        assert "doomed" in e.message and "404 not_found [id]" in str(e)
    with pytest.raises(ApiError) as exc:
        client.query_batch(ids=["d1", "doomed"])
    assert (exc.value.status, exc.value.field) == (404, "queries[1].id")
    assert client.stats().count == n


@pytest.mark.parametrize("call,status,code,field", [
    (lambda c, X: c.upsert("bad", X[0][:10]), 422, "invalid_vector", "values"),
    (lambda c, X: c.upsert(["ok", "bad"], [X[0], np.append(X[1], 1.0)]), 422, "invalid_vector",
     "vectors[1].values"),
    (lambda c, X: c.upsert("bad", np.zeros(DIM)), 422, "invalid_vector", "values"),
    (lambda c, X: c.upsert("bad", ([3, 3], [1.0, 2.0])), 422, "invalid_vector", "indices"),
    (lambda c, X: c.upsert("", X[0]), 422, "invalid_request", "id"),
    (lambda c, X: c.query(X[0][:100]), 422, "invalid_vector", "values"),
    (lambda c, X: c.query_batch([X[0], X[1][:5]]), 422, "invalid_vector", "queries[1].values"),
    (lambda c, X: c.query(id="d1", k=101), 422, "invalid_request", "k"),
    (lambda c, X: c.query(id="d1", mode="cosine"), 422, "invalid_request", "mode"),
    (lambda c, X: c.query_batch(ids=["d1"] * (MAX_BATCH + 1)), 413, "too_large", "queries"),
    (lambda c, X: c.upsert([f"big{i}" for i in range(MAX_BATCH)], np.random.default_rng(0).random((MAX_BATCH, DIM))),
     413, "too_large", None),  # 1.25 MB of float64 over max_body_bytes (1 MiB): refused before the body is read
])
def test_bad_input_is_an_api_error_naming_the_field(client, loaded, call, status, code, field):
    n = client.stats().count
    with pytest.raises(ApiError) as exc:
        call(client, loaded)
    e = exc.value
    assert (e.status, e.code, e.field) == (status, code, field), e
    assert e.message
    if status == 422:
        assert e.details and e.details[0]["field"] == field
    assert client.stats().count == n  # nothing written
    for ext_id in ("bad", "ok"):
        with pytest.raises(ApiError):
            client.get(ext_id)


def test_client_side_mistakes_are_refused_before_sending(client, loaded):
    with pytest.raises(TypeError):
        client.query()
    with pytest.raises(TypeError):
        client.query(loaded[0], id="d0")
    with pytest.raises(TypeError):
        client.query_batch(loaded[:2], ids=["d0"])
    with pytest.raises(ValueError, match="2 ids for 3 vectors"):
        client.upsert(["a", "b"], loaded[:3])
    with pytest.raises(ValueError, match="one dict"):
        client.upsert(["a", "b"], loaded[:2], metadata={"x": 1})
    with pytest.raises(ValueError, match="JSON"):  # orjson would write null in silence
        client.upsert("a", loaded[0], metadata={"x": float("nan")})
    with pytest.raises(ValueError, match="1-D"):
        client.query(loaded[:2])
    with pytest.raises(ValueError, match="2-D"):
        client.query_batch(loaded[0])
    with pytest.raises(ApiError):
        client.get("a")


def test_nan_and_infinity_are_refused_before_sending_naming_the_field(client, loaded):
    """JSON has no NaN or infinity: sent, they went as null, and the server could only say
    "Input should be a valid number" (issue #35, item 10). The client says what the server says
    of a non-finite value, naming the field, and sends nothing."""
    n = client.stats().count
    bad = loaded[1].copy()
    bad[7] = np.nan
    inf = sp.csr_matrix(loaded[2])
    inf.data[0] = np.inf
    for call, field in ((lambda: client.upsert("bad", bad), "values"),
                        (lambda: client.upsert(["ok", "bad"], [loaded[0], bad]), r"vectors\[1\]\.values"),
                        (lambda: client.upsert(["ok", "bad"], sp.vstack([sp.csr_matrix(loaded[0]), inf])),
                         r"vectors\[1\]\.values"),
                        (lambda: client.upsert("bad", ([3, 9], [1.0, -np.inf])), "values"),
                        (lambda: client.query(bad), "values"),
                        (lambda: client.query_batch([loaded[0], inf]), r"queries\[1\]\.values")):
        with pytest.raises(ValueError, match=f"^{field}: values must be finite"):
            call()
    assert client.stats().count == n
    for ext_id in ("bad", "ok"):
        with pytest.raises(ApiError):
            client.get(ext_id)


def test_api_key_required(server, loaded):
    for key in (None, "wrong"):
        with Client(server.base, api_key=key) as c:
            assert c.health().status == "ok"  # /health needs no key
            for call in (c.stats, lambda: c.get("d0"), lambda: c.query(id="d0"),
                         lambda: c.upsert("k", loaded[0]), lambda: c.delete("d0")):
                with pytest.raises(ApiError) as exc:
                    call()
                assert (exc.value.status, exc.value.code, exc.value.field) == (401, "unauthorized", "X-API-Key")
    with Client(server.base, api_key=KEY) as c:
        assert c.get("d0").id == "d0"
        with pytest.raises(ApiError):
            c.get("k")


def test_stats_and_health(client, loaded):
    s = client.stats()
    assert isinstance(s, Stats)
    assert s.count == N and s.backend == "lmdb" and s.pid > 0
    assert s.config["dim"] == DIM and s.config["samples"] == 128
    assert s.service["auth"] is True and s.service["max_batch"] == MAX_BATCH
    assert s.mirror["rows"] >= N and "search" in s.raw
    assert client.health() == Health(status="ok", backend="lmdb", writable=True, problem=None)


# --- answers that are not the API's, and no answer ----------------------------------------------


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Answers like a reverse proxy in front of a dead server, or a web page at the wrong URL."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status, body = (200, b"<html>a web page</html>") if self.path == "/health" else \
            (502, b"<html><body><h1>502 Bad Gateway</h1></body></html>")
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_an_answer_not_in_the_api_shape_still_raises_api_error(proxy):
    with Client(proxy) as c:
        with pytest.raises(ApiError) as exc:
            c.stats()
        e = exc.value
        assert (e.status, e.code, e.field) == (502, "bad_gateway", None)
        assert "not the API's error shape" in e.message and "502 Bad Gateway" in e.body
        with pytest.raises(ApiError) as exc:
            c.health()
        assert (exc.value.status, exc.value.code) == (200, "invalid_response")


def test_no_server_raises_no_response_error():
    with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as c:
        with pytest.raises(NoResponseError) as exc:
            c.stats()
    assert isinstance(exc.value, ConnectionError) and isinstance(exc.value.__cause__, httpx.ConnectError)
    assert "/stats" in str(exc.value)


def test_exported_from_the_package():
    assert gmmlsh.Client is Client and gmmlsh.ApiError is ApiError
