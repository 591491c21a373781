"""Named collections on a real LMDB and a real Redis: the library, the REST API over a real
uvicorn server (started as ``gmmlsh serve`` starts it), and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from redis_fixtures import redis_cluster_url, redis_url  # noqa: F401
from test_service import Server

from gmmlsh.client import ApiError, Client
from gmmlsh.index.collections import CollectionExists, Collections, UnknownCollection
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["lmdb", "redis"])
def where(request, tmp_path):
    """(location, options, server environment) of a fresh default index."""
    if request.param == "lmdb":
        loc = str(tmp_path / "idx")
        return loc, {}, {"GMMLSH_INDEX": loc}
    url, prefix = request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:12]}"
    cache = str(tmp_path / "cache")
    return url, {"prefix": prefix, "cache_dir": cache}, {"GMMLSH_REDIS_URL": url, "GMMLSH_PREFIX": prefix,
                                                         "GMMLSH_CACHE_DIR": cache}


# --- the library ---------------------------------------------------------------------------------


def test_collections_are_separate_indexes_that_outlive_a_reopen(where):
    loc, opts, _ = where
    rng = np.random.default_rng(0)
    with Index.open(loc, IndexConfig(dim=4), **opts) as base, Collections(loc, **opts) as cols:
        base.upsert(["x"], np.ones((1, 4)))
        cols.create("small", IndexConfig(dim=3), indexed=["label"])
        cols.create("wide", IndexConfig(dim=50, samples=64))
        with pytest.raises(CollectionExists):
            cols.create("small", IndexConfig(dim=3))
        with pytest.raises(CollectionExists):
            cols.create("default", IndexConfig(dim=3))
        with pytest.raises(ValueError, match="collection"):
            cols.create("../evil", IndexConfig(dim=3))
        with cols.open("small") as small, cols.open("wide") as wide:
            small.upsert(["x", "y"], rng.random((2, 3)) + 0.1, [{"label": 1}, {"label": 2}])
            wide.upsert([f"w{i}" for i in range(20)], rng.random((20, 50)) + 0.1)
            assert (base.count(), small.count(), wide.count()) == (1, 2, 20)
            assert small.get("x").values.shape == (3,) and base.get("x").values.shape == (4,)
            assert not wide.contains("x")
            assert [n.id for n in small.query(np.ones(3), k=5).neighbors] != []
            assert small.stats()["filters"] == {"indexed_fields": ["label"]}
        assert [e["name"] for e in cols.list()] == ["small", "wide"]
    # reopened from scratch (a restart): both there, each with its own data
    with Collections(loc, **opts) as cols:
        with cols.open("small") as small, cols.open("wide") as wide:
            assert (small.count(), wide.count(), small.config.dim, wide.config.dim) == (2, 20, 3, 50)
        cols.delete("wide")
        with pytest.raises(UnknownCollection):
            cols.open("wide")
        with pytest.raises(UnknownCollection):
            cols.delete("wide")
        with cols.open("small") as small:
            assert small.count() == 2
        # made again under the same name: a new, empty collection, nothing of the old one
        cols.create("wide", IndexConfig(dim=7))
        with cols.open("wide") as wide:
            assert wide.count() == 0 and wide.config.dim == 7
    with Index.open(loc, None, create=False, **opts) as base:
        assert base.count() == 1


def test_a_deleted_redis_collection_leaves_no_key(request, tmp_path):
    import redis

    url = request.getfixturevalue("redis_url")
    prefix = f"t{uuid.uuid4().hex[:12]}"
    with Collections(url, prefix=prefix, cache_dir=str(tmp_path)) as cols:
        cols.create("c", IndexConfig(dim=3))
        with cols.open("c") as c:
            c.upsert([f"v{i}" for i in range(3000)], np.random.default_rng(1).random((3000, 3)) + 0.1,
                     [{"i": i} for i in range(3000)])
        r = redis.Redis.from_url(url)
        assert len(list(r.scan_iter(f"{{{prefix}.c.*"))) > 10
        assert len(list(tmp_path.iterdir())) == 1  # its search mirror on this machine
        cols.delete("c")
        assert list(r.scan_iter(f"{{{prefix}.c.*")) == [] and list(tmp_path.iterdir()) == []
        assert r.hlen(f"{{{prefix}}}:collections") == 0 and r.hlen(f"{{{prefix}}}:collections:pending") == 0


def test_collections_on_a_redis_cluster(request, tmp_path):
    url = request.getfixturevalue("redis_cluster_url")
    prefix = f"t{uuid.uuid4().hex[:12]}"
    with Collections(url, prefix=prefix, cache_dir=str(tmp_path)) as cols:
        cols.create("a", IndexConfig(dim=3))
        cols.create("b", IndexConfig(dim=5))
        with cols.open("a") as a, cols.open("b") as b:
            a.upsert(["p", "q"], np.array([[1.0, 2, 3], [3, 2, 1]]))
            b.upsert(["p"], np.ones((1, 5)))
            assert (a.count(), b.count()) == (2, 1)
            assert a.query(np.array([1.0, 2, 3]), k=1).neighbors[0].id == "p"
        cols.delete("b")
        assert [e["name"] for e in cols.list()] == ["a"]


# --- the REST API -------------------------------------------------------------------------------


def _vectors(dim: int, n: int, seed: int, label: str = "lab") -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"v{i}", "values": (rng.random(dim) + 0.05).tolist(), "metadata": {label: i % 4, "i": i}}
            for i in range(n)]


def test_two_collections_of_different_dimensions_on_one_server(where, tmp_path):
    loc, opts, env = where
    server = Server(tmp_path, {**env, "GMMLSH_DIM": "6", "GMMLSH_SAMPLES": "64"}, workers=2).start()
    try:
        with server.client() as c:
            r = c.post("/collections", json={"name": "c3", "dim": 3, "indexed_fields": ["lab"]})
            assert r.status_code == 201, r.text
            r = c.post("/collections", json={"name": "c9", "sample": [[1.0] * 9, [0.5] * 9], "samples": 128})
            assert r.status_code == 201 and r.json()["dim"] == 9, r.text
            assert c.post("/collections", json={"name": "c3", "dim": 4}).status_code == 409
            for body, field in (({"name": "x y", "dim": 3}, "name"), ({"name": "ok"}, "dim"),
                                ({"name": "ok", "dim": 3, "bits": 99}, "bits"),
                                ({"name": "ok", "sample": [[1.0], [1.0, 2.0]]}, "sample"),
                                ({"name": "ok", "dim": 2, "sample": [[1.0, float("nan")]]}, "sample[1]"),
                                ({"name": "ok", "dim": 3, "indexed_fields": ["a", ""]}, "indexed_fields[1]"),
                                ({"name": "ok", "dim": 3, "indexed_fields": ["\U0001d54b" * 257]}, "indexed_fields[0]"),
                                ({"name": "ok", "dim": 3, "indexed_fields": ["a", "a"]}, "indexed_fields"),
                                ({"name": "ok", "dim": 3, "indexed_fields": [f"f{i}" for i in range(33)]},
                                 "indexed_fields")):
                r = c.post("/collections", json=body) if "nan" not in str(body) else c.post(
                    "/collections", content=json.dumps(body), headers={"Content-Type": "application/json"})
                assert r.status_code == 422 and r.json()["error"]["field"].startswith(field.split("[")[0]), r.text
                assert "indexed_fields" not in field or r.json()["error"]["field"] == field, r.text
            assert "ok" not in [x["name"] for x in c.get("/collections").json()["collections"]]
            assert c.post("/collections/c3/vectors", json={"vectors": _vectors(3, 40, 1)}).status_code == 200
            assert c.post("/collections/c9/vectors", json={"vectors": _vectors(9, 30, 2)}).status_code == 200
            assert c.post("/vectors", json={"vectors": _vectors(6, 5, 3)}).status_code == 200
            # the wrong dimension for this collection is refused, and writes nothing
            r = c.post("/collections/c3/vectors", json={"vectors": _vectors(9, 1, 4)})
            assert r.status_code == 422 and r.json()["error"]["field"] == "vectors[0].values"
            counts = {n: c.get(f"/collections/{n}").json()["count"] for n in ("c3", "c9", "default")}
            assert counts == {"c3": 40, "c9": 30, "default": 5}
            assert c.get("/stats").json()["count"] == 5
            # the same id in three collections: three vectors
            assert len(c.get("/collections/c3/vectors/v1").json()["values"]) == 3
            assert len(c.get("/collections/c9/vectors/v1").json()["values"]) == 9
            assert len(c.get("/vectors/v1").json()["values"]) == 6
            r = c.post("/collections/c3/neighbors/search", json={"id": "v1", "k": 50,
                                                                 "filter": {"must": [{"key": "lab",
                                                                                      "match": {"value": 2}}]}})
            assert r.status_code == 200, r.text
            got = r.json()["neighbors"]
            assert len(got) == 10 and all(n["metadata"]["lab"] == 2 for n in got)
            r = c.get("/collections/c3/neighbors", params={"id": "v1", "filter": '{"must": [{"key": "lab", '
                                                                                '"range": {"gt": "x"}}]}'})
            assert r.status_code == 422 and r.json()["error"]["field"] == "filter.must[0].range.gt"
            stats = c.get("/collections/c3").json()
            assert stats["filters"]["indexed_fields"] == ["lab"] and stats["config"]["dim"] == 3
            assert c.get("/collections/nope/vectors/v1").json()["error"] == {
                "status": 404, "code": "not_found", "field": "collection", "message": "no collection named 'nope'"}
            assert c.get("/collections/b%20ad/vectors/v1").status_code == 422
            assert c.delete("/collections/c9").json() == {"deleted": "c9"}
            assert c.delete("/collections/c9").status_code == 404
            assert c.get("/collections/c9/vectors/v1").status_code == 404
            assert c.delete("/collections/default").status_code == 422
        server.stop()
        server.start()  # a restart keeps both the default index and the remaining collection
        with server.client() as c:
            names = [x["name"] for x in c.get("/collections").json()["collections"]]
            assert names == ["default", "c3"]
            assert c.get("/collections/c3").json()["count"] == 40 and c.get("/stats").json()["count"] == 5
            # every worker notices a collection deleted and made again elsewhere (another dimension)
            for _ in range(4):
                assert c.get("/collections/c3/vectors/v0").status_code == 200
            with Collections(loc, **opts) as cols:
                cols.delete("c3")
                cols.create("c3", IndexConfig(dim=2))
            for _ in range(4):
                assert c.get("/collections/c3/vectors/v0").status_code == 404
                assert c.get("/collections/c3").json()["config"]["dim"] == 2
    finally:
        server.stop()


def test_scroll_and_batch_delete_over_http(where, tmp_path):
    _, _, env = where
    server = Server(tmp_path, {**env, "GMMLSH_DIM": "3", "GMMLSH_SAMPLES": "64"}).start()
    try:
        with server.client() as c:
            assert c.post("/collections", json={"name": "s", "dim": 4}).status_code == 201
            assert c.post("/collections/s/vectors", json={"vectors": _vectors(4, 250, 5)}).status_code == 200
            seen, cursor = [], None
            while True:
                body = {"limit": 60, **({"cursor": cursor} if cursor else {}),
                        "filter": {"must_not": [{"key": "lab", "match": {"value": 0}}]}}
                r = c.post("/collections/s/scroll", json=body)
                assert r.status_code == 200, r.text
                seen += [x["id"] for x in r.json()["items"]]
                assert all(x["metadata"]["lab"] != 0 for x in r.json()["items"])
                cursor = r.json()["next_cursor"]
                if cursor is None:
                    break
            assert sorted(seen) == sorted(f"v{i}" for i in range(250) if i % 4) and len(seen) == len(set(seen))
            r = c.post("/collections/s/delete", json={"filter": {"must": [{"key": "i", "range": {"lt": 100}}]}})
            assert r.json() == {"deleted": 100, "count": 150}
            assert c.post("/collections/s/delete", json={"ids": ["v100", "v101", "zz"]}).json() == {
                "deleted": 2, "count": 148}
            for body in ({}, {"ids": ["a"], "filter": {}}, {"filter": {"must": [{"key": "i", "range": {}}]}}):
                r = c.post("/collections/s/delete", json=body)
                assert r.status_code == 422, r.text
            assert c.post("/collections/s/scroll", json={"limit": 0}).status_code == 422
            assert c.get("/collections/s").json()["count"] == 148
        with Client(server.base, collection="s") as cl:  # the Python client, on a collection
            lab = {"must": [{"key": "lab", "match": {"value": 3}}]}
            assert cl.stats().count == 148 and cl.stats().config["dim"] == 4
            cl.upsert("new", np.ones(4), metadata={"lab": 3})
            assert cl.get("new").values.shape == (4,)
            got = cl.query(id="new", k=5, filter=lab)
            assert len(got.neighbors) == 5 and all(n.metadata["lab"] == 3 for n in got.neighbors)
            assert all(n.metadata["lab"] == 3 for r in cl.query_batch(np.ones((2, 4)), k=3, filter=lab)
                       for n in r.neighbors)
            with pytest.raises(ApiError) as e:
                cl.query(np.ones(4), filter={"must": [{"key": "lab", "range": {"gt": "x"}}]})
            assert (e.value.status, e.value.field) == (422, "filter.must[0].range.gt")
        with Client(server.base, collection="nope") as cl, pytest.raises(ApiError) as e:
            cl.get("a")
        assert (e.value.status, e.value.field) == (404, "collection")
    finally:
        server.stop()


# --- the command line ---------------------------------------------------------------------------


def _gmmlsh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gmmlsh.service.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_the_command_line_takes_a_collection_everywhere(tmp_path):
    idx = str(tmp_path / "idx")
    rows = tmp_path / "rows.csv"
    rows.write_text("id,label,x0,x1,x2\nr1,cat,0.5,0,2\nr2,dog,1,1,0\nr3,cat,0,2,1\n")
    r = _gmmlsh("build", str(rows), "--index", idx, "--collection", "pets", "--id-column", "id", "--label-column",
                "label", "--indexed-field", "label", "--no-progress")
    assert r.returncode == 0, r.stderr
    r = _gmmlsh("build", str(rows), "--index", idx, "--collection", "pets", "--id-column", "id", "--label-column",
                "label", "--no-progress")
    assert r.returncode == 0, r.stderr  # fills the same collection again: nothing duplicated
    r = _gmmlsh("query", "--index", idx, "--collection", "pets", "--vector", "0.4,0,2", "-k", "3", "--json",
                "--filter", '{"must": [{"key": "label", "match": {"value": "cat"}}]}')
    assert r.returncode == 0, r.stderr
    assert [n["id"] for n in json.loads(r.stdout)["neighbors"]] == ["r1", "r3"]
    r = _gmmlsh("info", "--index", idx, "--collection", "pets", "--json")
    assert json.loads(r.stdout)["count"] == 3 and json.loads(r.stdout)["filters"]["indexed_fields"] == ["label"]
    assert _gmmlsh("check", "--index", idx, "--collection", "pets").returncode == 0
    r = _gmmlsh("collections", "--index", idx, "--json")
    assert [e["name"] for e in json.loads(r.stdout)["collections"]] == ["pets"]
    r = _gmmlsh("query", "--index", idx, "--collection", "nope", "--id", "r1")
    assert r.returncode == 2 and "no collection 'nope'" in r.stderr
    r = _gmmlsh("query", "--index", idx, "--collection", "pets", "--id", "r1", "--filter", "{bad")
    assert r.returncode == 2 and "--filter" in r.stderr
    assert _gmmlsh("collections", "--index", idx, "--delete", "pets").returncode == 0
    r = _gmmlsh("collections", "--index", idx, "--delete", "pets")
    assert r.returncode == 2 and "no collection" in r.stderr


def test_the_command_line_lists_the_default_collection_as_the_api_does(tmp_path):
    """``gmmlsh collections`` printed nothing where only the index itself (``default``) was
    there, while ``GET /collections`` listed it (issue #35, item 7); both list one listing now."""
    idx = str(tmp_path / "idx")
    rows = tmp_path / "rows.csv"
    rows.write_text("id,x0,x1,x2\nr1,0.5,0,2\nr2,1,1,0\n")
    assert _gmmlsh("build", str(rows), "--index", idx, "--id-column", "id", "--no-progress").returncode == 0
    r = _gmmlsh("collections", "--index", idx)
    assert r.returncode == 0 and r.stdout.split() == ["default", "dim", "3,", "indexed", "fields:", "none"], r.stdout
    assert _gmmlsh("build", str(rows), "--index", idx, "--id-column", "id", "--collection", "pets",
                   "--indexed-field", "x0", "--no-progress").returncode == 0
    listed = json.loads(_gmmlsh("collections", "--index", idx, "--json").stdout)["collections"]
    assert [(e["name"], e["dim"], e["indexed_fields"]) for e in listed] == [("default", 3, []), ("pets", 3, ["x0"])]
    server = Server(tmp_path, {"GMMLSH_INDEX": idx}).start()
    try:
        with server.client() as c:
            assert c.get("/collections").json() == {"collections": listed}
    finally:
        server.stop()


def test_a_server_may_answer_for_a_collection_without_the_prefix(tmp_path):
    idx = str(tmp_path / "idx")
    with Index.open(idx, IndexConfig(dim=4)), Collections(idx) as cols:
        cols.create("imgs", IndexConfig(dim=3))
    r = _gmmlsh("serve", "--index", idx, "--collection", "nope", "--port", "0")
    assert r.returncode == 1 and "no collection named 'nope'" in r.stderr, r.stderr
    server = Server(tmp_path, {"GMMLSH_INDEX": idx, "GMMLSH_COLLECTION": "imgs"}).start()
    try:
        with server.client() as c:
            assert c.post("/vectors", json={"id": "a", "values": [1, 2, 3]}).status_code == 200
            assert c.get("/collections/imgs/vectors/a").status_code == 200
            assert c.get("/collections/default/vectors/a").status_code == 404
            assert c.get("/stats").json()["collection"] == "imgs"
    finally:
        server.stop()
