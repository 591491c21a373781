"""Brown passages (bag-of-words, 46,973 dimensions) grown to any size, deterministically.

Rows ``0 … 4,504`` are the training passages. Row ``i ≥ 4,505`` is a new 200-word
passage: words drawn at random from a mixture of one training passage's word
distribution (weight 0.8) and another's (0.2), both picked at random: Zipf-like
counts with the vocabulary and similarity scale of the real thing (a random pair
≈ 0.15), and no exact copies. The draws come from a generator seeded by the row's
block of 4,505, so every size is a prefix of every larger one. Queries are the
held-out test passages; the truth is the exact GMM top 10 against the first ``n`` rows.

    python -m bench.sparse_data 200000       # writes the data and the truth, prints where
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from bench.common import DATA, data_main
from bench.scale_data import CACHE
from gmmlsh.core.gmm import gmm_many, l1_norms

#: Rows of the Brown passages themselves (the training split).
PASSAGES = 4505
WORDS = 200
MIX = 0.8


def _brown(split: str) -> sp.csr_matrix:
    d = np.load(DATA / "brown-passages.npz")
    return sp.csr_matrix((d[f"{split}_data"], d[f"{split}_indices"], d[f"{split}_indptr"]),
                         shape=tuple(d[f"{split}_shape"]))


def _block(train: sp.csr_matrix, b: int) -> sp.csr_matrix:
    n = train.shape[0]
    if b == 0:
        return train.astype(np.float32)
    rng = np.random.default_rng([20261125, 2, b])
    base, other = rng.integers(0, n, n), rng.integers(0, n, n)
    from_base = rng.binomial(WORDS, MIX, n)
    rows, cols = [], []
    for i in range(n):
        for p, draws in ((base[i], from_base[i]), (other[i], WORDS - from_base[i])):
            lo, hi = train.indptr[p], train.indptr[p + 1]
            weights = train.data[lo:hi].astype(np.float64)
            cols.append(train.indices[lo:hi][rng.choice(hi - lo, draws, p=weights / weights.sum())])
            rows.append(np.full(draws, i))
    r, c = np.concatenate(rows), np.concatenate(cols)
    X = sp.csr_matrix((np.ones(r.shape[0], np.float32), (r, c)), shape=train.shape)
    X.sum_duplicates()
    return X


def data_path(n: int):
    return CACHE / f"brown-{n}.npz"


def data(n: int) -> sp.csr_matrix:
    """The first ``n`` rows (CSR, float32 counts), written on first use."""
    path = data_path(n)
    if not path.exists():
        train = _brown("train")
        blocks = [_block(train, b) for b in range(-(-n // train.shape[0]))]
        X = sp.vstack(blocks, format="csr")[:n]
        CACHE.mkdir(parents=True, exist_ok=True)
        sp.save_npz(path, X, compressed=False)
    return sp.load_npz(path).tocsr()


def queries(nq: int, offset: int = 0) -> sp.csr_matrix:
    return _brown("test")[offset:offset + nq].astype(np.float32)


def truth(n: int, nq: int, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Each query's exact top ``k`` among the first ``n`` rows: (row numbers, similarities),
    cached. Text has ties at the 10th neighbour: compare answers by similarity, not ids."""
    path = CACHE / f"brown-{n}-truth-{nq}x{k}.npz"
    if path.exists():
        f = np.load(path)
        return f["rows"], f["sims"]
    X, Q = data(n), queries(nq)
    norms = l1_norms(X)
    rows, sims = np.empty((nq, k), np.int64), np.empty((nq, k))
    for i in range(nq):
        s = gmm_many(Q[i], X, norms)
        top = np.argpartition(-s, k - 1)[:k]
        rows[i] = top[np.argsort(-s[top], kind="stable")]
        sims[i] = s[rows[i]]
    np.savez(path, rows=rows, sims=sims)
    return rows, sims


if __name__ == "__main__":
    data_main(__doc__, data, truth, data_path, queries=200)
