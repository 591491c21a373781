"""Queries/s of one fixed search on an index, for before/after comparisons of the query path.

    python -m bench.bench_fixed_search INDEX ../shared/data/fashion-mnist.npz [--queries 1000] [--rounds 3]

Opens ``INDEX`` (built by the version under test) with the same search forced on it
(``probes`` 8, ``shortlist`` 250, 4 rank bits, 100 candidates: the tuner's choice, which
varies run to run, taken out of the comparison), one thread, and times the first test images
of the ``.npz`` one per call and as one ``query_batch``; prints the median round as JSON. It
imports nothing of the repository but the API every version has (``Index.open(search=...)``,
``query``, ``query_batch``), so the same file times an older checkout: run it from outside the
repository with that checkout's package first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gmmlsh.core import parallel
from gmmlsh.index.index import Index

SEARCH = {"probes": 8, "shortlist": 250, "rank_bits": 4, "candidates": 100}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("index")
    p.add_argument("data", help="an .npz holding the queries as 'test'")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if hasattr(parallel, "set_threads"):
        parallel.set_threads(1)
    else:  # a checkout from before core.parallel's thread setting
        import numba

        numba.set_num_threads(1)
    Q = np.load(a.data)["test"].astype(np.float32)[:a.queries]
    with Index.open(a.index, maintain=False, search=SEARCH) as ix:
        ix.warm()
        for q in Q[:200]:
            ix.query(q, k=10)
        one, batch = [], []
        for _ in range(a.rounds):
            t = time.perf_counter()
            for q in Q:
                ix.query(q, k=10)
            one.append(len(Q) / (time.perf_counter() - t))
            t = time.perf_counter()
            ix.query_batch(Q, k=10)
            batch.append(len(Q) / (time.perf_counter() - t))
        print(json.dumps({"one_per_call": round(float(np.median(one))), "query_batch": round(float(np.median(batch))),
                          "mode": ix.query(Q[0], k=10).mode}))


if __name__ == "__main__":
    main()
