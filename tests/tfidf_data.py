"""A sparse tf-idf corpus made here, deterministically: the shape of the issue's held-back documents.

Documents of a topic model: each word of a document is drawn from the corpus' background
distribution (function words: Zipf over the whole vocabulary) with probability
:data:`BACKGROUND`, else from one of the document's 1-3 topics (each a Zipf law over its own
few thousand words). Counts are weighted as scikit-learn's ``TfidfTransformer`` does by
default (``tf · (ln((1 + N) / (1 + df)) + 1)``, rows L2-normalised), with the idf of the stored
documents applied to the queries too: ~6,400 rows, ~55,000 dimensions, positive real weights.
Queries are further documents of the same model (none stored).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfTransformer

DIM = 55_000
TOPICS = 60
TOPIC_WORDS = 3_000
BACKGROUND = 0.4
WORDS = (120, 320)


def _zipf_cdf(n: int, s: float = 1.05) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return np.cumsum(w / w.sum())


def _counts(rng: np.random.Generator, docs: int) -> sp.csr_matrix:
    """Word counts of ``docs`` documents (the topics come from a generator of their own, so that
    stored documents and queries share them)."""
    topic_rng = np.random.default_rng(7)
    background = topic_rng.permutation(DIM)
    topic_words = np.stack([topic_rng.choice(DIM, TOPIC_WORDS, replace=False) for _ in range(TOPICS)])
    bg_cdf, topic_cdf = _zipf_cdf(DIM, 1.1), _zipf_cdf(TOPIC_WORDS)
    rows, cols = [], []
    for d in range(docs):
        n = int(rng.integers(*WORDS))
        topics = rng.choice(TOPICS, int(rng.integers(1, 4)), replace=False)
        weights = rng.dirichlet(np.ones(topics.shape[0]))
        from_bg = rng.random(n) < BACKGROUND
        words = np.empty(n, np.int64)
        words[from_bg] = background[np.minimum(np.searchsorted(bg_cdf, rng.random(int(from_bg.sum()))), DIM - 1)]
        which = topics[rng.choice(topics.shape[0], int((~from_bg).sum()), p=weights)]
        ranks = np.minimum(np.searchsorted(topic_cdf, rng.random(which.shape[0])), TOPIC_WORDS - 1)
        words[~from_bg] = topic_words[which, ranks]
        rows.append(np.full(n, d))
        cols.append(words)
    r, c = np.concatenate(rows), np.concatenate(cols)
    X = sp.csr_matrix((np.ones(r.shape[0]), (r, c)), shape=(docs, DIM))
    X.sum_duplicates()
    return X


def corpus(rows: int = 6_400, queries: int = 200, seed: int = 0) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """(stored documents, query documents) as float32 tf-idf CSR matrices; no row is empty."""
    rng = np.random.default_rng(seed)
    counts = _counts(rng, rows + queries)
    tfidf = TfidfTransformer().fit(counts[:rows])
    X = tfidf.transform(counts).astype(np.float32).tocsr()
    X.sort_indices()
    return X[:rows], X[rows:]
