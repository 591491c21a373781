"""``POST /vectors`` with an Arrow IPC stream body, against a real ``gmmlsh serve`` (LMDB).

The Arrow body is the JSON batch without decimal text (:mod:`gmmlsh.service.arrow_rows`):
a batch sent both ways must store the same thing, and bad input must be refused with the
field named and nothing written, as for JSON.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import orjson
import pyarrow as pa
import pytest
from test_service import DIM, MAX_BATCH, Backend, Server, count

from gmmlsh.service.arrow_rows import MEDIA


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("arrow")
    srv = Server(tmp, Backend("lmdb", tmp, None).env).start()
    yield srv
    srv.stop()


def stream(columns: dict, compression: str | None = None) -> bytes:
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def lists(rows: list, kind: pa.DataType | None = None) -> pa.Array:
    """Rows as a list column (float32 unless ``kind``); None rows are null."""
    return pa.array([None if r is None else list(r) for r in rows], pa.list_(kind or pa.float32()))


def post(c, body: bytes):
    return c.post("/vectors", content=body, headers={"content-type": MEDIA})


def rows_mixed(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    dense = (rng.gamma(2.0, 30.0, (3, DIM)) * (rng.random((3, DIM)) < 0.4)).astype(np.float32)
    sparse = []
    for _ in range(2):
        idx = np.sort(rng.choice(DIM, 20, replace=False))
        sparse.append((idx, rng.gamma(2.0, 30.0, 20).astype(np.float32)))
    return dense, sparse


def test_an_arrow_batch_stores_what_the_same_json_batch_stores(server):
    """Dense rows as a fixed-size list and as a list, sparse rows with indices, integer ids and
    metadata: each read back equal to its twin sent as JSON."""
    dense, sparse = rows_mixed(np.random.default_rng(3))
    meta = [{"n": i, "tag": "x"} for i in range(5)]
    json_body = {"vectors": [{"id": f"j{i}", "values": dense[i].tolist(), "metadata": meta[i]} for i in range(3)]
                 + [{"id": f"j{3 + i}", "indices": s[0].tolist(), "values": s[1].tolist(), "metadata": meta[3 + i]}
                    for i, s in enumerate(sparse)]}
    with server.client() as c:
        assert c.post("/vectors", json=json_body).status_code == 200
        fixed = stream({"id": pa.array([f"a{i}" for i in range(3)]),
                        "values": pa.FixedSizeListArray.from_arrays(pa.array(dense.ravel()), DIM),
                        "metadata": pa.array([orjson.dumps(m).decode() for m in meta[:3]])})
        r = post(c, fixed)
        assert r.status_code == 200, r.text
        assert r.json()["upserted"] == 3
        mixed = stream({"id": pa.array([103, 104], pa.int64()),
                        "values": lists([s[1] for s in sparse]),
                        "indices": lists([s[0] for s in sparse], pa.int32()),
                        "metadata": pa.array([orjson.dumps(m).decode() for m in meta[3:]])})
        assert post(c, mixed).status_code == 200
        as_list = stream({"id": pa.array(["l0", "l1"]), "values": lists([dense[0], dense[1]], pa.float64()),
                          "indices": lists([None, None], pa.int64())})
        assert post(c, as_list).status_code == 200
        for j, a in [("j0", "a0"), ("j1", "a1"), ("j2", "a2"), ("j3", "103"), ("j4", "104")]:
            got_j, got_a = c.get(f"/vectors/{j}").json(), c.get(f"/vectors/{a}").json()
            assert {k: v for k, v in got_a.items() if k != "id"} == {k: v for k, v in got_j.items() if k != "id"}
        assert c.get("/vectors/l1").json()["values"] == c.get("/vectors/j1").json()["values"]
        assert "indices" in c.get("/vectors/103").json()
        near = c.get("/neighbors", params={"id": "j0", "k": 3}).json()["neighbors"]
        assert {n["id"] for n in near[:2]} == {"a0", "l0"} and near[0]["similarity"] == pytest.approx(1.0)


def _good(**replace) -> bytes:
    rng = np.random.default_rng(5)
    X = (rng.random((2, DIM)) + 0.1).astype(np.float32)
    columns = {"id": pa.array(["bad-new", "ok-1"]), "values": lists(list(X))}
    columns.update(replace)
    return stream({k: v for k, v in columns.items() if v is not None})


def _wrong_length() -> bytes:
    return _good(values=lists([np.ones(DIM), np.ones(DIM - 1)]))


BAD = [
    ("not an Arrow stream", lambda: b'{"vectors": []}', 422, "body"),
    ("compressed", lambda: stream({"id": pa.array(["bad-new"]), "values": lists([np.ones(DIM)])}, "zstd"),
     422, "body"),
    ("unknown column", lambda: _good(indicies=lists([None, None], pa.int64())), 422, "indicies"),
    ("no values column", lambda: _good(values=None), 422, "values"),
    ("a null id", lambda: _good(id=pa.array(["bad-new", None])), 422, "vectors[1].id"),
    ("ids of floats", lambda: _good(id=pa.array([1.5, 2.5])), 422, "id"),
    ("a row of the wrong length", _wrong_length, 422, "vectors[1].values"),
    ("a NaN", lambda: _good(values=lists([np.ones(DIM), np.r_[np.ones(DIM - 1), np.nan]])), 422, "vectors[1].values"),
    ("values of strings", lambda: _good(values=pa.array([["1"], ["2"]])), 422, "values"),
    ("a null row of values", lambda: _good(values=lists([np.ones(DIM), None])), 422, "vectors[1].values"),
    ("unsorted indices", lambda: _good(values=lists([[1.0, 2.0], np.ones(DIM)]),
                                       indices=lists([[5, 3], None], pa.int64())), 422, "vectors[0].indices"),
    ("metadata not JSON", lambda: _good(metadata=pa.array(["{", None])), 422, "vectors[0].metadata"),
    ("metadata not an object", lambda: _good(metadata=pa.array([None, "[1, 2]"])), 422, "vectors[1].metadata"),
    ("no rows", lambda: stream({"id": pa.array([], pa.string()), "values": lists([])}), 422, "vectors"),
    ("too many rows", lambda: stream({"id": pa.array([f"bad-{i}" for i in range(MAX_BATCH + 1)]),
                                      "values": lists([np.ones(DIM)] * (MAX_BATCH + 1))}), 413, "vectors"),
]


@pytest.mark.parametrize(("name", "body", "status", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_arrow_input_names_the_field_and_writes_nothing(server, name, body, status, field):
    with server.client() as c:
        before = count(c)
        r = post(c, body())
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["field"] == field, err
        assert len(r.content) < 4096
    with server.client() as c:
        assert count(c) == before
        for ext_id in ("bad-new", "ok-1", "bad-0"):
            assert c.get(f"/vectors/{ext_id}").status_code == 404
