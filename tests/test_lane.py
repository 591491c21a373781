"""The query lane's batching (service/lane.py) on a real LMDB index: single queries answered
together give each request exactly the answer it would get alone, and a bad one fails alone."""

from __future__ import annotations

import numpy as np
import pytest

from gmmlsh.core.validate import VectorError
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.service.lane import Job, answer_jobs
from gmmlsh.service.routes.neighbors import Knobs, Target, result_dict, run_query


@pytest.fixture(scope="module")
def index(tmp_path_factory, fmnist):
    X = fmnist[0][:3000].astype(np.float32)
    with Index.open(tmp_path_factory.mktemp("lane") / "idx", IndexConfig(dim=784, samples=128)) as ix:
        ix.upsert([str(i) for i in range(len(X))], X)
        ix.maintain()
        yield ix


def job(index: Index, target: Target, knobs: Knobs) -> Job:
    dense = target.id is None and not target.sparse
    return Job(index=index, run=lambda: run_query(index, target, knobs), finish=result_dict,
               vector=target.vector if dense else None, key=knobs if dense else None)


def test_jobs_batched_by_options_answer_as_alone(index, fmnist, monkeypatch):
    Q = fmnist[2][:6].astype(np.float64)
    five, exact = Knobs(5, "auto", 0.0, None, None), Knobs(3, "exact", 0.0, None, None)
    targets = [(Target(vector=Q[0]), five), (Target(id="7"), five), (Target(vector=Q[1]), five),
               (Target(vector=Q[2]), exact), (Target(vector=Q[3]), five), (Target(vector=Q[4]), exact),
               (Target(vector=np.zeros(784)), five), (Target(id="no-such-id"), five)]
    calls: list[int] = []
    real = index.query_batch
    monkeypatch.setattr(index, "query_batch", lambda X, **kw: calls.append(len(X)) or real(X, **kw))
    out = answer_jobs([job(index, t, k) for t, k in targets])
    # dense auto k=5: Q0, Q1, Q3 and the zero vector (refused as a batch, then answered one by one);
    # dense exact k=3: Q2, Q4
    assert sorted(calls) == [2, 4]
    for (target, knobs), got in list(zip(targets, out, strict=True))[:6]:
        assert got == result_dict(run_query(index, target, knobs))
    assert isinstance(out[6], VectorError) and out[6].field == "values"
    assert getattr(out[7], "status", None) == 404
