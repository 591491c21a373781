"""Metadata filters inside the search, scroll and delete by filter, on a real LMDB and a real Redis.

Every filtered answer is compared with a reference computed here from the metadata in
plain Python and exact GMM over the matching vectors (numpy), for a selective condition
(answered by exact scoring of the matching rows) and a broad one (the widened sketch search).
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from conftest import replaced_over_and_over
from redis_fixtures import redis_url  # noqa: F401

from gmmlsh.core.gmm import gmm_many
from gmmlsh.index.config import FILTER_EXACT_ROWS, IndexConfig
from gmmlsh.index.filters import FilterError, compile_filter
from gmmlsh.index.index import Index

N = 6000


def _meta(i: int, label: int) -> dict:
    m = {"label": int(label), "i": i, "even": i % 2 == 0, "name": f"n{i % 7}", "nested": {"v": i % 5}}
    if i % 3 == 0:
        m["tags"] = ["a", "b"] if i % 2 else ["c"]
    if i % 11 == 0:
        m["opt"] = None
    return m


@pytest.fixture
def loaded(location, fmnist):
    train, labels, test, _ = fmnist
    X = train[:N].astype(np.float64)
    metas = [_meta(i, labels[i]) for i in range(N)]
    loc, opts = location
    ix = Index.open(loc, IndexConfig(dim=784, samples=256), maintain=False, **opts)
    ix.upsert([f"v{i}" for i in range(N)], X, metas)
    ix.maintain()
    yield ix, X, metas, test[:12].astype(np.float64)
    ix.close()


def _ref_match(m: dict, flt: dict) -> bool:
    """The filter semantics, written plainly."""

    def get(key):
        if key in m:
            return m[key]
        node = m
        for p in key.split("."):
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    def scalar_eq(a, b):
        if isinstance(a, bool) or isinstance(b, bool):
            return isinstance(a, bool) and isinstance(b, bool) and a == b
        return a == b

    def cond(c):
        if "key" not in c:
            return _ref_match(m, c)
        v = get(c["key"])
        vals = v if isinstance(v, list) else [v]
        if "exists" in c:
            return (v is not None) == c["exists"]
        if "match" in c:
            wanted = [c["match"]["value"]] if "value" in c["match"] else c["match"]["any"]
            return any(scalar_eq(x, w) for x in vals for w in wanted if x is not None)
        r = c["range"]
        return any(isinstance(x, int | float) and not isinstance(x, bool)
                   and ("gt" not in r or x > r["gt"]) and ("gte" not in r or x >= r["gte"])
                   and ("lt" not in r or x < r["lt"]) and ("lte" not in r or x <= r["lte"]) for x in vals)

    return (all(cond(c) for c in flt.get("must", []))
            and (not flt.get("should") or any(cond(c) for c in flt["should"]))
            and not any(cond(c) for c in flt.get("must_not", [])))


FILTERS = [
    {"must": [{"key": "label", "match": {"value": 3}}]},
    {"must": [{"key": "label", "match": {"any": [1, 7]}}, {"key": "i", "range": {"gte": 100, "lt": 4000}}]},
    {"should": [{"key": "name", "match": {"value": "n3"}}, {"key": "tags", "match": {"value": "c"}}]},
    {"must_not": [{"key": "even", "match": {"value": True}}], "must": [{"key": "nested.v", "range": {"lte": 1}}]},
    {"must": [{"key": "opt", "exists": False}, {"key": "tags", "exists": True}]},
    {"must": [{"should": [{"key": "label", "match": {"value": 0}}, {"key": "label", "match": {"value": 9}}]},
              {"must_not": [{"key": "i", "range": {"gt": 5000}}]}]},
]


def _scrolled(ix, limit: int, flt: dict | None = None) -> list[str]:
    """Every id a scroll in pages of ``limit`` visits, in the order it visits them."""
    seen, cursor = [], None
    while True:
        page, cursor = ix.scroll(cursor, limit, flt)
        seen += [i for i, _ in page]
        if cursor is None:
            return seen


def test_every_operator_selects_exactly_what_the_reference_does(loaded):
    ix, _, metas, _ = loaded
    for flt in FILTERS:
        want = sorted(f"v{i}" for i, m in enumerate(metas) if _ref_match(m, flt))
        assert sorted(_scrolled(ix, 1000, flt)) == want, flt
        assert want, flt  # every filter of the list selects something


@pytest.mark.parametrize("share", ["rare", "broad"])
def test_filtered_neighbours_match_and_equal_the_exact_filtered_answer(loaded, share, monkeypatch):
    ix, X, metas, Q = loaded
    # rare: one label among the first 1500 rows (~150 rows), scored exactly; broad: one label
    # (~10 % of the rows) with the exact-scoring limit lowered under it, so the widened sketch
    # search answers (at 6,000 rows it would otherwise be cheaper to score them all).
    flt = ({"must": [{"key": "label", "match": {"value": 5}}, {"key": "i", "range": {"lt": 1500}}]}
           if share == "rare" else {"must": [{"key": "label", "match": {"value": 7}}]})
    if share == "broad":
        monkeypatch.setattr("gmmlsh.index.filtered.FILTER_EXACT_ROWS", 200)
    rows = np.array([i for i, m in enumerate(metas) if _ref_match(m, flt)])
    assert 100 < len(rows) < FILTER_EXACT_ROWS
    hits = total = 0
    for q in Q:
        r = ix.query(q, k=10, filter=flt)
        assert len(r.neighbors) == 10
        assert all(_ref_match(n.metadata, flt) for n in r.neighbors)
        assert r.mode == ("exact" if share == "rare" else "sketch")
        sims = gmm_many(q, X[rows])
        truth = {f"v{i}" for i in rows[np.argsort(-sims, kind="stable")[:10]]}
        hits += len(truth & {n.id for n in r.neighbors})
        total += 10
        if share == "rare":  # exact: the very same similarities
            assert np.allclose(sorted((n.similarity for n in r.neighbors), reverse=True),
                               np.sort(sims)[::-1][:10], atol=1e-5)
    assert hits / total >= 0.95, hits / total


def test_a_filter_nothing_passes_answers_no_neighbours_and_exact_mode_filters_too(loaded):
    ix, _, _, Q = loaded
    assert ix.query(Q[0], k=5, filter={"must": [{"key": "label", "match": {"value": 42}}]}).neighbors == ()
    flt = {"must": [{"key": "even", "match": {"value": False}}]}
    for mode in ("exact", "auto"):
        r = ix.query(Q[0], k=20, mode=mode, filter=flt)
        assert len(r.neighbors) == 20 and all(n.metadata["even"] is False for n in r.neighbors)
    rs = ix.query_batch(Q[:4], k=5, filter=flt)
    assert [[n.id for n in r.neighbors] for r in rs] == [
        [n.id for n in ix.query(q, k=5, filter=flt).neighbors] for q in Q[:4]]


def test_query_by_id_with_a_filter_leaves_the_vector_out(loaded):
    ix, _, metas, _ = loaded
    flt = {"must": [{"key": "label", "match": {"value": metas[0]["label"]}}]}
    r = ix.query(id="v0", k=5, filter=flt)
    assert "v0" not in {n.id for n in r.neighbors} and len(r.neighbors) == 5


def test_bad_filters_are_refused_naming_the_field(loaded):
    ix, _, _, Q = loaded
    cases = [
        ({"must": {"key": "label"}}, "filter.must[0]"),
        ({"must": [{"key": "label", "match": {"value": [1]}}]}, "filter.must[0].match.value"),
        ({"must": [{"key": "label", "range": {"gt": "3"}}]}, "filter.must[0].range.gt"),
        ({"must": [{"key": "", "exists": True}]}, "filter.must[0].key"),
        ({"shoud": []}, "filter.shoud"),
        ({"must": [{"key": "name", "range": {"gt": 1}}]}, "filter.must[0].range"),  # strings, not numbers
        ({"must": [{"key": "label", "match": {"value": "3"}}]}, "filter.must[0].match"),  # numbers, not strings
        ({"should": [{"must": [{"key": "even", "range": {"lt": 1}}]}]}, "filter.should[0].must[0].range"),
        ([1], "filter"),
    ]
    for flt, field in cases:
        with pytest.raises(FilterError) as e:
            ix.query(Q[0], filter=flt)
        assert e.value.field == field, (flt, e.value)


def test_indexed_fields_answer_from_their_value_lists(loaded):
    ix, _, metas, Q = loaded
    flt = {"must": [{"key": "label", "match": {"value": 2}}]}
    before = [n.id for n in ix.query(Q[1], k=10, filter=flt).neighbors]
    ix.declare_indexed(["label"])
    view = ix.view()
    rows = compile_filter(flt).posting_rows(ix.columns.at(view, {"label"}))
    assert rows is not None
    assert sorted(view.names_of(rows.tolist())) == sorted(f"v{i}" for i, m in enumerate(metas) if m["label"] == 2)
    assert [n.id for n in ix.query(Q[1], k=10, filter=flt).neighbors] == before
    assert ix.stats()["filters"] == {"indexed_fields": ["label"]}
    ix.upsert(["new"], Q[1:2], [{"label": 2}])  # new rows join the value lists
    assert ix.query(Q[1], k=1, filter=flt).neighbors[0].id == "new"


def test_scroll_visits_every_id_exactly_once_while_writes_go_on(loaded):
    ix, X, _, _ = loaded
    stop = threading.Event()
    errors = []

    def writer():
        rng = random.Random(1)
        n = 0
        try:
            while not stop.is_set():
                i = rng.randrange(N // 2, N)  # re-upserts and deletes of the upper half, new ids too
                ix.upsert([f"v{i}", f"w{n}"], X[[i, i]], [{"label": -1}, None])
                ix.delete([f"w{n - 3}"])
                n += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        seen = _scrolled(ix, 137)
    finally:
        stop.set()
        t.join()
    assert not errors
    assert len(seen) == len(set(seen))  # never twice
    assert {f"v{i}" for i in range(N)} <= set(seen)  # every id stored throughout, at least once
    assert seen == sorted(seen, key=lambda s: s.encode())


def test_a_scroll_sees_an_id_being_replaced_on_the_page_it_reads(location):
    """Ids replaced over and over while every page of a scroll is read: each comes exactly once.
    A page read between a sync's retiring an id's old row and its publishing the new one used to
    see the id in neither row. The test above meets that moment only by chance (a page and a
    replacement of the same id at once); here most pages hold an id being replaced."""
    loc, opts = location
    X = np.random.default_rng(0).random((350, 16))
    names = [f"v{i:04d}" for i in range(len(X))]
    with Index.open(loc, IndexConfig(dim=16, samples=64), maintain=False, **opts) as ix:
        ix.upsert(names, X)
        with replaced_over_and_over(ix, names, X, hot=list(range(0, len(X), 5))):
            for _ in range(30):  # a scroll meets the moment by chance: 30 meet it many times
                assert sorted(_scrolled(ix, 7)) == names  # every id once: none missed, none twice


def test_delete_by_filter_removes_exactly_the_matching(loaded):
    ix, X, metas, _ = loaded
    flt = {"must": [{"key": "label", "match": {"value": 4}}], "must_not": [{"key": "i", "range": {"gte": 3000}}]}
    doomed = {f"v{i}" for i, m in enumerate(metas) if _ref_match(m, flt)}
    n0 = ix.count()
    assert ix.delete_where(flt) == len(doomed)
    assert ix.count() == n0 - len(doomed)
    assert set(_scrolled(ix, 5000)) == {f"v{i}" for i in range(N)} - doomed
    assert ix.delete_where(flt) == 0
    left = ix.count()
    for nothing in ({}, {"must": []}):
        with pytest.raises(FilterError):
            ix.delete_where(nothing)
    assert ix.count() == left


def test_a_vector_replaced_since_it_matched_is_not_deleted(location):
    loc, opts = location
    with Index.open(loc, IndexConfig(dim=3), maintain=False, **opts) as ix:
        ix.upsert(["a", "b"], np.array([[1.0, 2, 3], [3, 2, 1]]), [{"x": 1}, {"x": 1}])
        view = ix.view()
        old = view.iid[:2].astype(np.int64)
        ix.upsert(["a"], np.array([[1.0, 1, 1]]), [{"x": 2}])  # a replaced after the match was made
        assert ix.store.delete(["a", "b"], expect=old) == 1
        assert ix.contains("a") and not ix.contains("b")
        assert ix.get("a").metadata == {"x": 2}


def test_a_type_check_follows_the_values_stored_now(location):
    """A condition on values of a type the field does not hold is a 422, judged on the live
    values as of the query: a string written to a numeric field and deleted again used to leave
    the check lenient for ever (200 and no neighbours), and one just added was not seen by it
    (the 422 still said "holds numbers", judged on a mirror behind the store) (issue #35, 8)."""
    loc, opts = location
    X = np.array([[1.0, 2, 3], [3, 2, 1], [1, 1, 1]])
    as_text = {"must": [{"key": "value", "match": {"value": "1"}}]}
    as_bool = {"must": [{"key": "value", "match": {"value": True}}]}
    with Index.open(loc, IndexConfig(dim=3), maintain=False, **opts) as ix:
        ix.upsert(["a", "b"], X[:2], [{"value": 1}, {"value": 2}])
        with pytest.raises(FilterError, match="holds numbers; the filter gives strings"):
            ix.query(X[0], filter=as_text)
        ix.upsert(["s"], X[2:], [{"value": "1"}])
        assert [n.id for n in ix.query(X[0], k=3, filter=as_text).neighbors] == ["s"]
        with pytest.raises(FilterError, match="holds numbers and strings; the filter gives booleans"):
            ix.query(X[0], filter=as_bool)
        ix.delete(["s"])
        with pytest.raises(FilterError, match="holds numbers; the filter gives strings"):
            ix.query(X[0], filter=as_text)
        ix.declare_indexed(["value"])  # an indexed field: answered from its value lists, checked alike
        with pytest.raises(FilterError, match="holds numbers; the filter gives strings"):
            ix.query(X[0], filter=as_text)
        assert [n.id for n in ix.query(X[0], k=3, filter={"must": [{"key": "value", "match": {"value": 2}}]}
                                       ).neighbors] == ["b"]
