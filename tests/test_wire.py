"""The router's binary batch protocol and its choice of k per group (no processes needed)."""

from __future__ import annotations

import numpy as np
import pytest

from gmmlsh.index.records import SparseRow
from gmmlsh.service.router.fanout import merge, shard_k
from gmmlsh.service.wire import (
    NodeAnswer,
    NodeQuery,
    WireError,
    decode_answers,
    decode_queries,
    encode_answers,
    encode_queries,
)


def test_queries_round_trip_dense_and_sparse():
    dim = 6
    dense = np.array([0.5, -1, 0, 2, 0, 1e-30], np.float32)
    sparse = SparseRow(np.array([1, 4], np.int32), np.array([3.0, -0.25], np.float32), dim)
    qs = [NodeQuery(dense, 10, "exact", 0.1, None, None, None, None),
          NodeQuery(sparse, 3, "auto", 0.0, 200, 8, "ex-id", {"must": [{"key": "a", "match": 1}]})]
    got, epoch = decode_queries(encode_queries(qs, 42), dim)
    assert epoch == 42
    assert np.array_equal(got[0].vector, dense) and got[0].vector.dtype == np.float32
    assert isinstance(got[1].vector, SparseRow) and np.array_equal(got[1].vector.indices, sparse.indices)
    assert np.array_equal(got[1].vector.values, sparse.values) and got[1].vector.dim == dim
    assert [q.knobs() for q in got] == [q.knobs() for q in qs]


def test_codes_travel_with_the_queries_that_have_them():
    dim = 4
    codes = np.array([0, 3, 65535, 7], np.uint16)
    qs = [NodeQuery(np.ones(dim, np.float32), 5, codes=codes),
          NodeQuery(SparseRow(np.array([2], np.int32), np.array([1.0], np.float32), dim), 5),
          NodeQuery(np.full(dim, 2, np.float32), 5, codes=codes[::-1].copy())]
    got, _ = decode_queries(encode_queries(qs, None), dim)
    assert np.array_equal(got[0].codes, codes) and got[0].codes.dtype == np.uint16
    assert got[1].codes is None and np.array_equal(got[2].codes, codes[::-1])
    assert np.array_equal(got[2].vector, qs[2].vector)


def test_answers_round_trip_bit_for_bit():
    sims = np.array([0.9, 1 / 3, 0.1 + 0.2], np.float64)
    answers = [NodeAnswer("sketch", 812, sims, ["a", "bé", ""], [b'{"x":1}', b"", b"[1,2]"]),
               NodeAnswer("exact", 0, np.zeros(0), [], [])]
    got, epoch = decode_answers(encode_answers(answers, None))
    assert epoch is None and len(got) == 2
    assert got[0].similarities.tobytes() == sims.tobytes()
    assert got[0].names == ["a", "bé", ""] and got[0].metadata == [b'{"x":1}', b"", b"[1,2]"]
    assert (got[1].mode, got[1].candidates, got[1].names) == ("exact", 0, [])


def test_not_the_protocol_is_refused():
    with pytest.raises(WireError):
        decode_queries(b"GET / HTTP/1.1", 4)
    body = encode_queries([NodeQuery(np.ones(4, np.float32), 1)], None)
    with pytest.raises(WireError, match="bytes"):
        decode_queries(body + b"xx", 4)


def test_k_per_group():
    assert [shard_k(10, G) for G in (1, 2, 4, 8, 16)] == [10, 10, 8, 6, 5]
    assert shard_k(100, 4) < 100 and shard_k(1, 4) == 1


def test_merge_by_exact_similarity_ties_in_group_order():
    a = NodeAnswer("sketch", 5, np.array([0.9, 0.5]), ["a1", "a2"], [b"", b""])
    b = NodeAnswer("sketch", 7, np.array([0.7, 0.5]), ["b1", "b2"], [b"", b""])
    mode, candidates, hits = merge([(0, a), (1, b)], 3)
    assert (mode, candidates) == ("sketch", 12) and [h[1] for h in hits] == ["a1", "b1", "a2"]
