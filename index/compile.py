"""Compile numba's kernels ahead of the first request (or find them in numba's cache).

numba compiles a kernel on its first call and keeps the machine code on disk
(``~/.cache/gmmlsh/numba``, or ``NUMBA_CACHE_DIR``: see ``gmmlsh/__init__.py``): the first build or
server start on a machine spends 10–20 s there in silence, and every uvicorn worker
would do it again. :func:`compile_kernels` runs every path once on tiny indexes
(dense and sparse, every mode, lists and tuning), so a server compiles once before
its workers start and an image compiles at build time:

    python -m gmmlsh.index.compile
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import scipy.sparse as sp

from gmmlsh.core.gcws import _sample_dense, _sample_split
from gmmlsh.core.postings import exact_postings
from gmmlsh.core.search import search
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index

#: Kernels whose on-disk cache says whether this machine compiled them already.
_WITNESSES = (search, exact_postings, _sample_dense, _sample_split)


def kernels_cached() -> bool:
    """Whether numba's cache holds the kernels (an approximation: it looks for the cache
    index files of a few of them, not for every signature)."""
    try:
        return all(os.path.exists(k._cache._cache_file._index_path) for k in _WITNESSES)
    except AttributeError:  # numba's cache layout changed: assume compiled, say nothing
        return True


def compile_kernels() -> float:
    """Run every kernel once on tiny throwaway indexes; returns the seconds it took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    X = (rng.random((3000, 32)) * (rng.random((3000, 32)) < 0.5)).astype(np.float32)
    X[:, 0] += 0.5
    S = sp.random(2500, 50_000, density=0.002, random_state=1, format="csr", dtype=np.float32)  # lists, postings
    S.data += 1.0
    S = S[np.diff(S.indptr) > 0]
    with tempfile.TemporaryDirectory(prefix="gmmlsh-compile-") as d:
        for name, data, config in (("dense", X, IndexConfig(dim=32, nrff_k=16)),
                                   ("sparse", S, IndexConfig(dim=50_000, samples=64))):
            with Index.open(os.path.join(d, name), config, maintain=False) as ix:
                ix.upsert([str(i) for i in range(data.shape[0])], data)
                ix.maintain()
                for mode in ("auto", "sketch", "exact") + (("nrff",) if config.nrff_k else ("postings",)):
                    ix.query(data[:1] if name == "sparse" else data[0], k=3, mode=mode)
                    ix.query(id="1", k=3, mode=mode)
                ix.query(data[0], k=3, candidates=20, probes=2)
                ix.query_batch(data[:4], k=3)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"kernels compiled (or loaded from numba's cache) in {compile_kernels():.1f} s")
