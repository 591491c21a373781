"""Queries/s of one fixed search on an index, for before/after comparisons of the query path.

    python -m bench.bench_fixed_search INDEX ../shared/data/fashion-mnist.npz [--queries 1000] [--rounds 3]
    python -m bench.bench_fixed_search INDEX --zoo strokes --search 64/3000/4/150 --parts

Opens ``INDEX`` (built by the version under test) with the same search forced on it
(``probes`` 8, ``shortlist`` 250, 4 rank bits, 100 candidates: the tuner's choice, which
varies run to run, taken out of the comparison), one thread, and times the first test images
of the ``.npz`` one per call and as one ``query_batch``; prints the median round as JSON
(``--zoo SHAPE``: the held-out queries of a shape of :mod:`bench.zoo` instead, in the form it
gives them — one-row CSR matrices for strokes and text; ``--search``: another fixed search). It
imports nothing of the repository but the API every version has (``Index.open(search=...)``,
``query``, ``query_batch``; and ``bench.zoo`` with ``--zoo``), so the same file times an older
checkout: run it from outside the repository with that checkout's package first on ``PYTHONPATH``.

``--parts``: instead, the CPU time of a query's parts, one per call — preparing it
(``prepare_vectors``: validation, hashing, bit planes), the search kernel, building the
answer, and the rest of ``Index.query`` — timed with the thread's CPU clock by wrapping those
functions, in rounds of 250 queries; each part's least round (µs a query) is printed: the
least disturbed round of a noisy machine. Compare two versions in ABBA order (old, new, new,
old): on a shared machine the second of two processes run back to back is often the slower.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import scipy.sparse as sp

import gmmlsh.index.index as index_module
import gmmlsh.index.search as search_module
from gmmlsh.core import parallel
from gmmlsh.index.index import Index

SEARCH = {"probes": 8, "shortlist": 250, "rank_bits": 4, "candidates": 100}
#: Queries a round of ``--parts``.
PART_ROUND = 250


def parts(ix: Index, rows: list, rounds: int) -> dict[str, float]:
    """Each part's least CPU time over ``rounds`` rounds of ``rows`` (each one call's query; µs a
    query): see ``--parts``."""
    spent: dict[str, int] = {}

    def timed(module, name: str, label: str) -> None:
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            t = time.thread_time_ns()
            out = fn(*args, **kwargs)
            spent[label] = spent.get(label, 0) + time.thread_time_ns() - t
            return out

        setattr(module, name, wrapper)

    timed(index_module, "prepare_vectors", "prepare")
    timed(search_module, "search", "kernel")
    timed(index_module if hasattr(index_module, "answer") else search_module, "answer", "answer")
    best: dict[str, float] = {}
    slices = max(1, len(rows) // PART_ROUND)
    for r in range(rounds):
        part = rows[(r % slices) * PART_ROUND:(r % slices + 1) * PART_ROUND]
        spent.clear()
        t = time.thread_time_ns()
        for q in part:
            ix.query(q, k=10)
        spent["total"] = time.thread_time_ns() - t
        for label, ns in spent.items():
            best[label] = min(best.get(label, float("inf")), ns / len(part) / 1000)
    best["rest"] = best["total"] - best["prepare"] - best["kernel"] - best["answer"]
    return {label: round(us, 1) for label, us in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("index")
    p.add_argument("data", nargs="?", help="an .npz holding the queries as 'test'")
    p.add_argument("--zoo", help="the held-out queries of this shape of bench.zoo instead of the .npz's")
    p.add_argument("--search", help="probes/shortlist/rank bits/candidates (default: %(default)s)",
                   default="/".join(str(v) for v in SEARCH.values()))
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", action="store_true", help="CPU time of a query's parts instead of queries/s")
    a = p.parse_args()
    if (a.data is None) == (a.zoo is None):
        p.error("give the queries: an .npz or --zoo SHAPE")
    if hasattr(parallel, "set_threads"):
        parallel.set_threads(1)
    else:  # a checkout from before core.parallel's thread setting
        import numba

        numba.set_num_threads(1)
    if a.zoo:
        from bench import zoo

        Q = zoo.SHAPES[a.zoo].queries(a.queries, 0)
    else:
        Q = np.load(a.data)["test"].astype(np.float32)[:a.queries]
    rows = [Q[i:i + 1] if sp.issparse(Q) else Q[i] for i in range(Q.shape[0])]  # one call's argument each
    search = dict(zip(SEARCH, (int(v) for v in a.search.split("/")), strict=True))
    with Index.open(a.index, maintain=False, search=search) as ix:
        ix.warm()
        for q in rows[:200]:
            ix.query(q, k=10)
        if a.parts:
            print(json.dumps(parts(ix, rows, a.rounds)))
            return
        one, batch = [], []
        for _ in range(a.rounds):
            t = time.perf_counter()
            for q in rows:
                ix.query(q, k=10)
            one.append(len(rows) / (time.perf_counter() - t))
            t = time.perf_counter()
            ix.query_batch(Q, k=10)
            batch.append(len(rows) / (time.perf_counter() - t))
        print(json.dumps({"one_per_call": round(float(np.median(one))), "query_batch": round(float(np.median(batch))),
                          "mode": ix.query(rows[0], k=10).mode}))


if __name__ == "__main__":
    main()
