"""Brown passages (bag-of-words, 46,973 dimensions) grown to any size, deterministically.

Rows ``0 … 4,504`` are the training passages. Row ``i ≥ 4,505`` is a new 200-word
passage: words drawn at random from a mixture of one training passage's word
distribution (weight 0.8) and another's (0.2), both picked at random: Zipf-like
counts with the vocabulary and similarity scale of the real thing (a random pair
≈ 0.15), and no exact copies. The draws come from a generator seeded by the row's
block of 4,505, so every size is a prefix of every larger one (:mod:`bench.grown`).
Queries are the held-out test passages; the truth is the exact GMM top 10 against the
first ``n`` rows.

    python -m bench.sparse_data 200000       # writes the data and the truth, prints where
"""

from __future__ import annotations

from functools import cache

import numpy as np
import scipy.sparse as sp

from bench import exact
from bench.common import DATA, data_main
from bench.grown import CACHE, Grown

#: Rows of the Brown passages themselves (the training split).
PASSAGES = 4505
WORDS = 200
MIX = 0.8
DIM = 46_973


def _brown(split: str) -> sp.csr_matrix:
    d = np.load(DATA / "brown-passages.npz")
    return sp.csr_matrix((d[f"{split}_data"], d[f"{split}_indices"], d[f"{split}_indptr"]),
                         shape=tuple(d[f"{split}_shape"]))


@cache
def train() -> sp.csr_matrix:
    """The 4,505 training passages (CSR counts)."""
    return _brown("train")


def block(b: int) -> sp.csr_matrix:
    """Block ``b`` (rows ``b·4,505 …``): the passages themselves, or new passages mixed from them."""
    passages = train()
    n = passages.shape[0]
    if b == 0:
        return passages.astype(np.float32)
    rng = np.random.default_rng([20261125, 2, b])
    base, other = rng.integers(0, n, n), rng.integers(0, n, n)
    from_base = rng.binomial(WORDS, MIX, n)
    rows, cols = [], []
    for i in range(n):
        for p, draws in ((base[i], from_base[i]), (other[i], WORDS - from_base[i])):
            lo, hi = passages.indptr[p], passages.indptr[p + 1]
            weights = passages.data[lo:hi].astype(np.float64)
            cols.append(passages.indices[lo:hi][rng.choice(hi - lo, draws, p=weights / weights.sum())])
            rows.append(np.full(draws, i))
    r, c = np.concatenate(rows), np.concatenate(cols)
    X = sp.csr_matrix((np.ones(r.shape[0], np.float32), (r, c)), shape=passages.shape)
    X.sum_duplicates()
    return X


BROWN = Grown("brown", PASSAGES, DIM, sparse=True, block=block)


def data_path(n: int):
    return BROWN.path(n)


def data(n: int) -> sp.csr_matrix:
    """The first ``n`` rows (CSR, float32 counts), written on first use."""
    return BROWN.data(n)


def queries(nq: int, offset: int = 0) -> sp.csr_matrix:
    return _brown("test")[offset:offset + nq].astype(np.float32)


def truth(n: int, nq: int, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Each query's exact top ``k`` among the first ``n`` rows: (row numbers, similarities),
    cached. Text has ties at the 10th neighbour: compare answers by similarity, not ids."""
    path = CACHE / f"brown-{n}-truth-{nq}x{k}.npz"
    if path.exists():
        f = np.load(path)
        return f["rows"], f["sims"]
    rows, sims = exact.top_k(queries(nq), [(np.arange(n), data(n))], k)
    np.savez(path, rows=rows, sims=sims)
    return rows, sims


if __name__ == "__main__":
    data_main(__doc__, data, truth, data_path, queries=200)
