"""Work spread over the cores (core/parallel.py): the same answers whatever the split, and no
numba parallel region anywhere (each kernel is compiled once, serial)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numba
import numpy as np
import pytest
import scipy.sparse as sp

from gmmlsh.core import parallel
from gmmlsh.core.gcws import sketch
from gmmlsh.core.gmm import gmm_many, gmm_matrix, l1_norms
from gmmlsh.core.parallel import chunks, spread

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n, parts", [(0, 2), (1, 2), (5, 2), (7, 3), (100, 16), (3, 8)])
def test_chunks_cover_the_range_once_in_order(n, parts):
    spans = chunks(n, parts)
    assert all(lo < hi for lo, hi in spans) and len(spans) <= max(1, min(parts, n))
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(n))


def test_spread_answers_as_one_thread_and_never_nests():
    """A batch spread over the cores gives what one thread gives, bit for bit; a chunk that itself
    spreads (it runs on a pool thread) runs on that thread, so nothing waits on a full pool."""
    rng = np.random.default_rng(0)
    X = (rng.random((3000, 300)) * (rng.random((3000, 300)) < 0.4)).astype(np.float32)
    X[:, 0] += 0.5
    S = sp.csr_matrix(X)
    spread_out = (sketch(X, 128, path="direct"), sketch(S, 128), gmm_many(X[3], X), l1_norms(X),
                  gmm_matrix(X[:5], X))
    parallel.set_threads(1)  # this thread's setting: everything on it
    try:
        one = (sketch(X, 128, path="direct"), sketch(S, 128), gmm_many(X[3], X), l1_norms(X), gmm_matrix(X[:5], X))
    finally:
        parallel.set_threads(numba.config.NUMBA_NUM_THREADS)
    for a, b in zip(spread_out, one, strict=True):
        np.testing.assert_array_equal(a, b)
    threads = set()

    def inner(lo: int, hi: int) -> int:
        threads.add(threading.current_thread().name)
        return hi - lo

    outer = spread(lambda lo, hi: sum(spread(inner, hi - lo, 1 << 30)), 1000, 1 << 30)
    assert sum(outer) == 1000
    if parallel.threads() > 1:
        assert all(t.startswith("gmmlsh-core") for t in threads)


def test_no_kernel_starts_a_numba_parallel_region_or_compiles_for_a_literal(tmp_path):
    """Hashing, exact GMM, an index's build, lists, tuning and queries of every mode, on a process
    allowed two threads and a cache of its own (so every kernel is compiled, callees too): numba's
    own thread pool is never started (its default layer aborts a process when two threads enter
    parallel regions at once), and no kernel was compiled for a constant's literal value (a
    kernel passing a Python int constant to another compiles the callee once more for it:
    seconds of a first start, docs/tuning.md)."""
    code = textwrap.dedent("""
        import sys
        import numba.np.ufunc.parallel as pool
        from numba.core.registry import CPUDispatcher
        from gmmlsh.index.compile import compile_kernels
        compile_kernels()
        kernels = {id(v): v for m in list(sys.modules.values()) if m.__name__.startswith("gmmlsh.")
                   for v in vars(m).values() if isinstance(v, CPUDispatcher)}
        for v in kernels.values():
            for sig in v.signatures:
                if "Literal" in str(sig):
                    print("literal:", v.py_func.__qualname__, sig)
        print("pool started" if pool._is_initialized else "pool idle")
    """)
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "pool idle"
    assert [line for line in lines if line.startswith("literal:")] == []
