"""The data zoo: four shapes of data, each grown to any size, with held-out queries and exact truth.

Issue 30: the engine's speed and upkeep depend on the data's shape (dense or sparse rows,
non-negative or signed, high or low similarities), so every benchmark of operation runs on
each of these:

* ``fashion``: Fashion-MNIST, dense 784-pixel images grown by shifted, rescaled copies
  (:mod:`bench.scale_data` as it is); queries: the test images.
* ``strokes``: sparse images made from the same grown images: each pixel's stroke is
  ``|I[y, x+1] − I[y, x]| + |I[y+1, x] − I[y, x]|`` (a neighbour outside the frame adds
  nothing), kept where above 80 and zero elsewhere — about 140 nonzeros a row, so most
  rows are stored sparse (fewer than dim/4 nonzeros); the shift and scale are applied to
  the image first, then the strokes taken. A grown row with no stroke left (a faint image
  scaled down) keeps its original image's strokes. Queries: the test images' strokes.
* ``text``: the Brown passages grown by :mod:`bench.sparse_data`'s mixtures (46,973
  dimensions, ~120 nonzeros, low similarities); queries: the held-out test passages.
* ``signed``: Fashion-MNIST centred: each pixel minus the training images' mean pixel, so
  values are signed (dense; the sign split doubles what a sketch sees), grown like
  ``fashion``; queries: the test images, centred by the same mean.

Every size is a prefix of every larger one (:mod:`bench.grown`); the first ``n`` rows are
cached as ``gmmlsh build`` reads them (``.npy`` dense, ``.npz`` CSR), and the exact top 10
of the first queries (:mod:`bench.exact`) is cached beside them.

    python -m bench.zoo 100000                          # every shape: data, truth, and the stats table
    python -m bench.zoo 1000000 --shapes strokes,text   # some shapes
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench import exact, scale_data, sparse_data
from bench.common import DATA, emit
from bench.grown import CACHE, Grown, Rows
from gmmlsh.core.gmm import gmm

#: A stroke is kept where it is above this (pixel levels 0–255).
STROKE_MIN = 80
NEIGHBORS = 10


@dataclass(frozen=True)
class Shape:
    """One shape of the zoo: its grown rows and its held-out queries."""

    name: str
    grown: Grown
    #: ``queries(count, offset)``: held-out queries (never among the rows)
    queries: Callable[[int, int], Rows]
    #: how many held-out queries there are
    held_out: int
    #: the queries whose truth :func:`truth` caches by default
    truth_queries: int

    @property
    def dim(self) -> int:
        return self.grown.dim

    def data(self, n: int) -> Rows:
        return self.grown.data(n)

    def path(self, n: int) -> Path:
        return self.grown.path(n)


@cache
def _test_images() -> np.ndarray:
    return np.load(DATA / "fashion-mnist.npz")["test"]


@cache
def train_mean() -> np.ndarray:
    """The training images' mean pixel (float32, 784): the centre of ``signed``."""
    return scale_data.train().mean(axis=0, dtype=np.float64).astype(np.float32)


def strokes(images: np.ndarray) -> sp.csr_matrix:
    """Rows of 28 × 28 images (n × 784, any numeric type) → their strokes above
    :data:`STROKE_MIN` (CSR float32)."""
    I = np.asarray(images, np.float32).reshape(-1, 28, 28)
    s = np.zeros_like(I)
    s[:, :, :-1] = np.abs(I[:, :, 1:] - I[:, :, :-1])
    s[:, :-1, :] += np.abs(I[:, 1:, :] - I[:, :-1, :])
    s[s <= STROKE_MIN] = 0
    return sp.csr_matrix(s.reshape(-1, 784))


def _strokes_block(b: int) -> sp.csr_matrix:
    X = strokes(scale_data.block(b))
    empty = np.flatnonzero(np.diff(X.indptr) == 0)  # a faint image scaled down: its original's strokes
    if empty.shape[0]:
        X = X.tolil()
        X[empty] = strokes(scale_data.train()[empty])
        X = X.tocsr()
    return X


def _signed_block(b: int) -> np.ndarray:
    return scale_data.block(b) - train_mean()


def _fashion_queries(count: int, offset: int) -> np.ndarray:
    return _test_images()[offset:offset + count].astype(np.float32)


def _strokes_queries(count: int, offset: int) -> sp.csr_matrix:
    return strokes(_test_images()[offset:offset + count])


def _signed_queries(count: int, offset: int) -> np.ndarray:
    return _fashion_queries(count, offset) - train_mean()


SHAPES: dict[str, Shape] = {
    "fashion": Shape("fashion", scale_data.FASHION, _fashion_queries, 10_000, 1000),
    "strokes": Shape("strokes", Grown("strokes", scale_data.BASE, 784, sparse=True, block=_strokes_block),
                     _strokes_queries, 10_000, 1000),
    "text": Shape("text", sparse_data.BROWN, sparse_data.queries, 500, 200),
    "signed": Shape("signed", Grown("signed", scale_data.BASE, 784, sparse=False, block=_signed_block),
                    _signed_queries, 10_000, 1000),
}


def truth(shape: Shape, n: int, nq: int | None = None, k: int = NEIGHBORS) -> tuple[np.ndarray, np.ndarray]:
    """The first ``nq`` queries' exact top ``k`` among the first ``n`` rows: (row numbers,
    similarities), best first (cached). Compare answers by similarity: text has ties."""
    nq = shape.truth_queries if nq is None else nq
    path = CACHE / f"zoo-{shape.name}-{n}-truth-{nq}x{k}.npz"
    if path.exists():
        f = np.load(path)
        return f["rows"], f["sims"]
    rows, sims = exact.top_k(shape.queries(nq, 0), [(np.arange(n), shape.data(n))], k)
    np.savez(path, rows=rows, sims=sims)
    return rows, sims


def nonzeros(X: Rows) -> np.ndarray:
    """Nonzeros of each row."""
    return np.diff(sp.csr_matrix(X).indptr) if sp.issparse(X) else np.count_nonzero(X, axis=1)


def stored_sparse(X: Rows, dim: int) -> np.ndarray:
    """Whether gmmlsh stores each row sparse: fewer than dim/4 nonzeros (index/records.py, encode_vectors)."""
    return 4 * nonzeros(X) < dim


def random_pairs(X: Rows, pairs: int = 2000, seed: int = 0) -> np.ndarray:
    """Exact GMM of ``pairs`` random pairs of distinct rows."""
    rng = np.random.default_rng(seed)
    n = X.shape[0]
    a = rng.integers(0, n, pairs)
    b = (a + rng.integers(1, n, pairs)) % n
    return np.array([gmm(X[i], X[j]) for i, j in zip(a.tolist(), b.tolist(), strict=True)])


def stats(shape: Shape, n: int, nq: int | None = None) -> dict:
    """What the shape looks like at ``n`` rows: nonzeros, rows stored sparse, similarities."""
    cached = shape.path(n).exists()
    t = time.perf_counter()
    X = shape.data(n)
    made = None if cached else time.perf_counter() - t
    nq = shape.truth_queries if nq is None else nq
    cached = (CACHE / f"zoo-{shape.name}-{n}-truth-{nq}x{NEIGHBORS}.npz").exists()
    t = time.perf_counter()
    _, sims = truth(shape, n, nq)
    found = None if cached else time.perf_counter() - t
    nnz = nonzeros(X)
    signed = bool((X.data if sp.issparse(X) else np.asarray(X[:10_000])).min() < 0)
    return {"shape": shape.name, "n": n, "dim": shape.dim, "nnz_mean": float(nnz.mean()),
            "nnz_median": float(np.median(nnz)), "sparse_share": float(stored_sparse(X, shape.dim).mean()),
            "signed": signed, "random_pair": float(random_pairs(X).mean()), "tenth": float(sims[:, -1].mean()),
            "first": float(sims[:, 0].mean()), "queries": sims.shape[0], "data_s": made, "truth_s": found,
            "file": str(shape.path(n))}


def _took(seconds: float | None) -> str:
    return "cached" if seconds is None else f"{seconds:,.0f}"


def table(rows: list[dict]) -> list[str]:
    L = ["| shape | n | dim | nonzeros a row (mean / median) | rows stored sparse | signed | "
         "GMM of a random pair | GMM of a query's true 1st / 10th neighbour | made in (s): data, truth |",
         "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for s in rows:
        L.append(f"| {s['shape']} | {s['n']:,} | {s['dim']:,} | {s['nnz_mean']:.0f} / {s['nnz_median']:.0f} | "
                 f"{s['sparse_share']:.1%} | {'yes' if s['signed'] else 'no'} | {s['random_pair']:.3f} | "
                 f"{s['first']:.3f} / {s['tenth']:.3f} | {_took(s['data_s'])}, {_took(s['truth_s'])} |")
    return L


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n", type=int, help="rows of each shape")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    p.add_argument("--queries", type=int, help="queries with a cached truth (default: 1,000; text 200)")
    p.add_argument("--out", type=Path, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    rows = []
    for name in a.shapes.split(","):
        rows.append(stats(SHAPES[name], a.n, a.queries))
        print(rows[-1], flush=True)
    emit(table(rows), a.out)


if __name__ == "__main__":
    main()
