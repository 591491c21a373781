"""Near-copies (:mod:`gmmlsh.index.nearcopies`): a build on data whose rows are resampled copies
of a few originals says so, points to ``--tune-queries`` and answers by exact search; sample
queries given to the build make it tune as usual.

The data: 800 Brown passages, each resampled 30 times (200 words drawn from the passage's own
word counts), 24,000 rows: a stored vector's 10 nearest are its own copies. The queries to come
are other passages (held out), whose nearest neighbours stand nowhere near as high.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA
from test_build_cli import run_cli

from gmmlsh.index.index import Index

ORIGINALS, COPIES, WORDS = 800, 30, 200


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    d = np.load(DATA / "brown-passages.npz")
    train = sp.csr_matrix((d["train_data"], d["train_indices"], d["train_indptr"]), shape=tuple(d["train_shape"]))
    test = sp.csr_matrix((d["test_data"], d["test_indices"], d["test_indptr"]), shape=tuple(d["test_shape"]))
    rng = np.random.default_rng(34)
    rows = []
    for p in rng.choice(train.shape[0], ORIGINALS, replace=False):
        lo, hi = train.indptr[p], train.indptr[p + 1]
        words, counts = train.indices[lo:hi], train.data[lo:hi].astype(np.float64)
        for draw in rng.multinomial(WORDS, counts / counts.sum(), size=COPIES):
            keep = draw > 0
            rows.append(sp.csr_matrix((draw[keep].astype(np.float32), (np.zeros(int(keep.sum())), words[keep])),
                                      shape=(1, train.shape[1])))
    where = tmp_path_factory.mktemp("copies")
    sp.save_npz(where / "copies.npz", sp.vstack(rows, format="csr"), compressed=False)
    sp.save_npz(where / "queries.npz", test[:200].astype(np.float32), compressed=False)
    return where


@pytest.mark.slow
def test_a_build_on_near_copies_says_so_and_answers_exactly(copies, tmp_path):
    r = run_cli("build", copies / "copies.npz", "--index", tmp_path / "idx", "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    assert "near-copies" in r.stderr and "--tune-queries" in r.stderr
    tune = json.loads(r.stdout)["upkeep"]["tune"][-1]
    assert tune["near_copies"]["near_copies"] and tune["chosen"] == "exact" and tune["advice"]
    q = sp.load_npz(copies / "queries.npz")
    with Index.open(tmp_path / "idx", maintain=False) as ix:
        assert {ix.query(q[i], k=10).mode for i in range(5)} == {"exact"}

    r = run_cli("build", copies / "copies.npz", "--index", tmp_path / "tuned", "--no-progress", "--json",
                "--tune-queries", copies / "queries.npz")
    assert r.returncode == 0, r.stderr
    assert "near-copies" not in r.stderr
    tune = json.loads(r.stdout)["upkeep"]["tune"][-1]
    assert "near_copies" not in tune and tune["sample"] == "128 queries"
