"""Fuzzing: schemathesis against the served OpenAPI document, hypothesis on validation and
on the sparse/dense equivalence.

* Every operation of the document a server built by :func:`service.app.create_app`
  serves (asserted equal to the one fuzzed) gets ``GMMLSH_FUZZ_EXAMPLES`` (default
  100) generated requests — valid and schema-violating (negative) ones — sent to a
  real ``gmmlsh serve`` over HTTP, with the API key on. Checked on every answer:
  no 5xx, status code / content type / headers / body conform to the document,
  schema-violating input is refused, auth is enforced, the ``Allow`` header of a
  405 is right, and no answer carries a traceback or a server file path.
  Not checked: that every schema-valid request succeeds — the vector checks that
  need the index (dimension, sparse index order, all-zero vectors, id existence)
  cannot be written in JSON Schema, so a 422 for such input is by design; nor generated
  headers that frame the message (``Content-Length``): those test uvicorn's parser; nor that
  a request with a query parameter the document does not name is refused: the API ignores
  those by design (a cache-buster must not fail a request), everything else is checked.
* Stateful: schemathesis chains the operations through links it infers from the
  document (POST /vectors → GET /vectors/{id} → DELETE /vectors/{id} → GET ...), for
  ``GMMLSH_FUZZ_STATEFUL`` (default 40) scenarios, with its use-after-free and
  resource-availability checks: after a DELETE the GET must be 404; after a POST
  the GET must not be.
* hypothesis: the core validators refuse bad vectors only with ``VectorError``
  (never another exception), and a vector sent dense or sparse is the same vector
  to the index and to the API (same stored bytes, same sketch, same answers).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import schemathesis
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance
from test_crash import ServerProc, record

from gmmlsh.client import ARROW, arrow_body
from gmmlsh.core.validate import VectorError, check_batch, check_dense, check_sparse
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.records import decode_vector
from gmmlsh.service.app import create_app
from gmmlsh.service.settings import Settings

EXAMPLES = int(os.environ.get("GMMLSH_FUZZ_EXAMPLES", "100"))
STATEFUL = int(os.environ.get("GMMLSH_FUZZ_STATEFUL", "40"))
KEY = "fuzz-key-0123"
HEADERS = {"X-API-Key": KEY}
DIM = 4
#: The server's settings, as environment variables and as the object the document is built from.
ENV = {"GMMLSH_DIM": str(DIM), "GMMLSH_SAMPLES": "16", "GMMLSH_MAX_BODY_BYTES": "65536",
       "GMMLSH_MAX_BATCH": "50", "GMMLSH_MAX_K": "100", "GMMLSH_API_KEY": KEY}
SETTINGS = Settings(index="/nonexistent", dim=DIM, samples=16, max_body_bytes=65536, max_batch=50, max_k=100,
                    api_key=KEY)
DOCUMENT = create_app(SETTINGS).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)


@st.composite
def _arrow_batches(draw) -> bytes:
    """A batch as the Arrow upsert body, of ids and rows of the document's dimension."""
    rows = draw(st.lists(st.lists(st.floats(-1e3, 1e3, allow_subnormal=False), min_size=DIM, max_size=DIM),
                         min_size=1, max_size=5))
    ids = draw(st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8),
                        min_size=len(rows), max_size=len(rows)))
    return arrow_body(ids, np.array(rows))


# The document's Arrow body is raw bytes to schemathesis: junk, or a batch as a client sends it.
schemathesis.openapi.media_type(ARROW, st.one_of(st.binary(max_size=1024), _arrow_batches()))
HYPOTHESIS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)

REPO = Path(__file__).resolve().parents[1]
#: What no answer may contain: tracebacks, source or data file locations.
LEAKS = re.compile(r"Traceback|File \"|site-packages|\.py\b|/tmp/|/work/|/home/|/root/|" + re.escape(str(REPO)))

_stats: Counter = Counter()


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("fuzz")
    srv = ServerProc(tmp, {"GMMLSH_INDEX": str(tmp / "index"), **ENV}).start()
    yield srv
    srv.kill()
    record("fuzz", cases=_stats["cases"], stateful_steps=_stats["stateful"], server_errors=_stats["5xx"],
           by_status=dict(sorted((k, v) for k, v in _stats.items() if isinstance(k, int))))


def no_internal_details(ctx, response, case) -> bool | None:
    """No traceback, source path or server file path in any answer (errors included)."""
    _stats["cases"] += 1
    _stats[response.status_code] += 1
    if response.status_code >= 500:
        _stats["5xx"] += 1
    text = response.content.decode("utf-8", "replace") if response.content else ""
    found = LEAKS.search(text)
    if found:
        raise AssertionError(f"the answer shows server internals ({found.group(0)!r}): {text[:300]}")
    return None


def test_fuzzed_document_is_the_served_one(api):
    with httpx.Client(base_url=api.base, timeout=10) as c:
        served = c.get("/openapi.json").json()
    assert served == DOCUMENT


#: Headers that frame the HTTP message. A generated one (a ``Content-Length`` of junk) tests
#: uvicorn's parser, which refuses the request (400, text/plain) before the API sees it.
FRAMING = ("content-length", "transfer-encoding")


@schema.parametrize()
@HYPOTHESIS
def test_every_operation_conforms(case, api):
    for name in [h for h in case.headers or {} if h.lower() in FRAMING]:
        del case.headers[name]
    declared = {p.name for p in case.operation.query}
    ignored = [negative_data_rejection] if any(q not in declared for q in case.query or {}) else []
    case.call_and_validate(base_url=api.base, headers=HEADERS, additional_checks=[no_internal_details],
                           excluded_checks=[positive_data_acceptance, *ignored])


def test_stateful_post_get_delete_get(api):
    """Scenarios chained through the document's (inferred) links, checked as above plus
    use-after-free (GET after DELETE must be 404) and resource availability."""
    base = schema.as_state_machine()
    links = {name for name in dir(base) if "vectors" in name}
    assert any(n.startswith("POST_vectors") and "GET_vectors" in n for n in links), links
    assert any("DeleteVector" in n for n in links), links

    class Machine(base):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case):
            return {"base_url": api.base, "headers": HEADERS}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            _stats["stateful"] += 1
            case.validate_response(response, excluded_checks=[positive_data_acceptance],
                                   additional_checks=[*(additional_checks or []), no_internal_details],
                                   headers=HEADERS, transport_kwargs=kwargs or None, recorder=self.recorder)

    Machine.run(settings=settings(max_examples=STATEFUL, deadline=None, stateful_step_count=8,
                                  suppress_health_check=list(HealthCheck), database=None))


def test_post_get_delete_get_by_hand(api):
    """The same chain, spelled out, on both body forms (a generated chain may not hit it)."""
    with httpx.Client(base_url=api.base, timeout=10, headers=HEADERS) as c:
        for body in ({"id": "chain/é", "values": [1, -2, 0, 0.5], "metadata": {"k": [1, None]}},
                     {"vectors": [{"id": "chain/é", "indices": [0, 3], "values": [1, 0.5]}]}):
            assert c.post("/vectors", json=body).status_code == 200
            r = c.get("/vectors/chain%2F%C3%A9")
            assert r.status_code == 200 and r.json()["id"] == "chain/é"
            assert c.delete("/vectors/chain%2F%C3%A9").status_code == 200
            assert c.get("/vectors/chain%2F%C3%A9").status_code == 404
            assert c.delete("/vectors/chain%2F%C3%A9").status_code == 404
            r = c.get("/neighbors", params={"id": "chain/é"})
            assert r.status_code == 404


# --- hypothesis: validation -----------------------------------------------------------------------

_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**63), 2**63 - 1), st.just(0.0), st.just(-0.0),
    st.floats(min_value=-1e-40, max_value=1e-40), st.booleans(),
)
_junk = st.one_of(st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2))


@given(values=st.one_of(st.lists(_numbers, max_size=12), st.lists(st.one_of(_numbers, _junk), max_size=4), _junk),
       dim=st.one_of(st.none(), st.integers(1, 12)))
@settings(max_examples=300, deadline=None, database=None)
def test_check_dense_refuses_only_with_vector_error(values, dim):
    try:
        v = check_dense(values, dim)
    except VectorError:
        return
    assert v.dtype == np.float64 and v.ndim == 1 and np.isfinite(v).all() and v.any()
    assert dim is None or v.shape[0] == dim


@given(indices=st.one_of(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8),
                         st.lists(st.integers(-3, 12), max_size=8),
                         st.lists(st.floats(allow_nan=True), max_size=4)),
       values=st.lists(_numbers, max_size=8), dim=st.one_of(st.none(), st.integers(1, 12)))
@settings(max_examples=300, deadline=None, database=None)
def test_check_sparse_refuses_only_with_vector_error(indices, values, dim):
    """Integers are within int64, as the API's schema bounds them (see the report on larger ones)."""
    try:
        idx, val = check_sparse(indices, values, dim)
    except VectorError:
        return
    assert idx.dtype == np.int64 and val.dtype == np.float64 and idx.shape == val.shape
    assert (np.diff(idx) > 0).all() and idx.min() >= 0 and (dim is None or idx.max() < dim)
    assert np.isfinite(val).all() and val.any()


@given(rows=st.lists(st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=3), min_size=1, max_size=5))
@settings(max_examples=100, deadline=None, database=None)
def test_check_batch_dense_and_csr_agree(rows):
    A = np.array(rows)
    try:
        dense = check_batch(A, 3)
    except VectorError as e1:
        with pytest.raises(VectorError) as e2:
            check_batch(sp.csr_matrix(A), 3)
        assert e1.field == e2.value.field
        return
    np.testing.assert_array_equal(check_batch(sp.csr_matrix(A), 3).toarray(), dense)


# --- hypothesis: a vector sent dense or sparse is the same vector -------------------------------

_vectors = st.lists(st.one_of(st.just(0.0), st.floats(-1e3, 1e3, allow_subnormal=False)), min_size=DIM * 3,
                    max_size=DIM * 3).filter(lambda v: any(np.float32(x) != 0 for x in v))


@pytest.fixture(scope="module")
def local_index(tmp_path_factory) -> Iterator[Index]:
    # No background upkeep: each example's two queries meet one state of the index (a fit
    # published between them would change the exact path, which rounds the last bit differently).
    ix = Index.open(str(tmp_path_factory.mktemp("eq") / "idx"), IndexConfig(dim=DIM * 3, samples=64), maintain=False)
    yield ix
    ix.close()


_fresh = iter(range(10**9))


def _dense(indices, values) -> np.ndarray:
    if indices is None:
        return values
    out = np.zeros(DIM * 3, np.float32)
    out[indices] = values
    return out


@given(values=_vectors)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_index_dense_and_sparse_are_one_vector(local_index, values):
    ix = local_index
    x = np.array(values)
    nz = np.flatnonzero(x)
    n = next(_fresh)  # fresh ids: replacing ids trips the stale-iid bug tested below
    d, s, d2, s2 = (f"{t}{n}" for t in ("d", "s", "d2-", "s2-"))
    ix.upsert([d], x[None, :])
    ix.upsert([s], sp.csr_matrix(x[None, :]))  # CSR input into a dense index
    ix.upsert([d2, s2], sp.csr_matrix(np.stack([x, x])).toarray())
    ix.maintain()  # the upkeep due, here: lists and postings once the rows pass their minimum
    for a, b in ((d, s), (d, d2), (s, s2)):
        rec = ix.store.read(ix.store.lookup([a, b]), ["vector", "sketch"])
        (na, _, ia, va), (nb, _, ib, vb) = (decode_vector(v) for v in rec["vector"])
        assert na == nb  # the stored L1 norm, bit for bit
        assert np.array_equal(_dense(ia, va), _dense(ib, vb))  # the same values, whatever shape they came in
        assert rec["sketch"][0] == rec["sketch"][1]
    q_sparse = (nz, x[nz])
    for mode in ("auto", "exact"):
        r1, r2 = ix.query(x, k=5, mode=mode), ix.query(q_sparse, k=5, mode=mode)
        assert [(n.id, n.similarity) for n in r1.neighbors] == [(n.id, n.similarity) for n in r2.neighbors]
    # The vector's own copies lead exact search. (Not asserted of the sketch search: the examples
    # Hypothesis shrinks towards fill the index with near-copies, which can outnumber the
    # candidates while agreeing on every sample; which of them the shortlist keeps is not defined.)
    assert r1.neighbors and r1.neighbors[0].similarity == pytest.approx(1.0, abs=1e-12)


def test_lsh_after_replacements_finds_live_vectors(tmp_path):
    with Index.open(str(tmp_path / "idx"), IndexConfig(dim=12, samples=64)) as ix:
        x = np.zeros(12)
        x[3] = 1.0
        for _ in range(3):  # every upsert retires the previous versions
            ix.upsert(["a"], x[None, :])
            ix.upsert(["b"], sp.csr_matrix(x[None, :]))
            ix.upsert(["c", "d"], np.stack([x, x]))
            got = ix.query(x, k=4)
            assert sorted(n.id for n in got.neighbors) == ["a", "b", "c", "d"]


@given(values=st.lists(st.one_of(st.just(0.0), st.floats(-1e3, 1e3, allow_subnormal=False)), min_size=DIM,
                       max_size=DIM).filter(lambda v: any(np.float32(x) != 0 for x in v)))
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_api_dense_and_sparse_are_one_vector(api, values):
    x = np.array(values, dtype=np.float32)
    nz = np.flatnonzero(x)
    with httpx.Client(base_url=api.base, timeout=10, headers=HEADERS) as c:
        r = c.post("/vectors", json={"vectors": [
            {"id": "eq-dense", "values": x.tolist()},
            {"id": "eq-sparse", "indices": nz.tolist(), "values": x[nz].tolist()}]})
        assert r.status_code == 200, r.text
        dense, sparse = (c.get(f"/vectors/{i}").json() for i in ("eq-dense", "eq-sparse"))
        # JSON carries the shortest decimal of each float32: exact once read as float32. A dense
        # vector comes back dense; a sparse one sparse where the index stores it sparse (under
        # a quarter nonzero: never at this dimension), else dense
        assert np.array_equal(np.asarray(dense["values"], np.float32), x) and dense.get("indices") is None
        if sparse.get("indices") is not None:
            assert sparse["indices"] == nz.tolist()
            assert np.array_equal(np.asarray(sparse["values"], np.float32), x[nz])
        else:
            assert np.array_equal(np.asarray(sparse["values"], np.float32), x)
        answers = []
        for q in ({"values": x.tolist()}, {"indices": nz.tolist(), "values": x[nz].tolist()}):
            r = c.post("/neighbors/search", json={**q, "k": 2, "mode": "exact"})
            assert r.status_code == 200, r.text
            answers.append(sorted((n["id"], n["similarity"]) for n in r.json()["neighbors"]))
        assert answers[0] == answers[1]
        assert {i for i, _ in answers[0]} == {"eq-dense", "eq-sparse"}
        assert all(s == pytest.approx(1.0, abs=1e-12) for _, s in answers[0])
