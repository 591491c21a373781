"""CPU time of one query's parts, for before/after comparisons of the query path.

    python bench/query_stages.py INDEX ../shared/data/fashion-mnist.npz [--rounds 8]

Opens ``INDEX`` with one search forced (as :mod:`bench.bench_fixed_search` does), one thread,
and answers the first 1,000 test images of the ``.npz`` one per call in rounds of 250, timing
with the thread's CPU clock the whole query and three parts — preparing it
(``prepare_vectors``: validation, hashing, bit planes), the search kernel, building the answer
— by wrapping those functions; "rest" is the query less the three. Prints, as JSON, each
part's minimum over the rounds (µs a query): the least disturbed round of a noisy machine.
Like ``bench_fixed_search`` it imports nothing of the repository but what every version has,
so the same file times an older checkout (its package first on ``PYTHONPATH``). Compare two
versions in ABBA order (old, new, new, old): on a shared machine the second of two processes
run back to back is often the slower.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import gmmlsh.index.index as index_module
import gmmlsh.index.search as search_module
from gmmlsh.core import parallel
from gmmlsh.index.index import Index

SEARCH = {"probes": 8, "shortlist": 250, "rank_bits": 4, "candidates": 100}
ROUND = 250


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("index")
    p.add_argument("data", help="an .npz holding the queries as 'test'")
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    if hasattr(parallel, "set_threads"):
        parallel.set_threads(1)
    else:  # a checkout from before core.parallel's thread setting
        import numba

        numba.set_num_threads(1)
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
    Q = np.load(a.data)["test"].astype(np.float32)[:4 * ROUND]
    best: dict[str, float] = {}
    with Index.open(a.index, maintain=False, search=SEARCH) as ix:
        ix.warm()
        for q in Q[:300]:
            ix.query(q, k=10)
        for r in range(a.rounds):
            part = Q[(r % 4) * ROUND:(r % 4 + 1) * ROUND]
            spent.clear()
            t = time.thread_time_ns()
            for q in part:
                ix.query(q, k=10)
            spent["total"] = time.thread_time_ns() - t
            for label, ns in spent.items():
                best[label] = min(best.get(label, float("inf")), ns / len(part) / 1000)
    best["rest"] = best["total"] - best["prepare"] - best["kernel"] - best["answer"]
    print(json.dumps({label: round(us, 1) for label, us in best.items()}))


if __name__ == "__main__":
    main()
