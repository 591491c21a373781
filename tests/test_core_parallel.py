"""Serial kernels stay serial when numba's on-disk cache is warm.

numba names its cache files after a function's qualified name and keys entries by
signature only. Two ``njit`` wrappers of one function (one ``parallel=True``)
therefore share a file, and a later process can load the *parallel* machine code
for the serial wrapper: one query then starts an OpenMP region whose threads spin
afterwards (measured: twice the CPU per query in the server). The probe below
runs every small-work path in a process whose cache already holds both twins,
and checks that numba never started its thread pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gmmlsh.core.parallel import twin_kernels

REPO = Path(__file__).resolve().parents[1]

_WARM = textwrap.dedent("""
    import numpy as np, scipy.sparse as sp
    from gmmlsh.core.gcws import sketch
    from gmmlsh.core.gmm import gmm_many, l1_norms
    rng = np.random.default_rng(0)
    X = rng.random((3000, 784)).astype(np.float32)
    S = sp.random(3000, 5000, density=0.02, format="csr", dtype=np.float64, random_state=1)
    S.data += 0.5
    for path in ("direct", "table"):
        sketch(X, 256, path=path); sketch(X[:1], 256, path=path)
        sketch(S, 256, path=path); sketch(S[:1], 256, path=path)
    Y = np.tile(X, (2, 1))
    gmm_many(X[0], Y, x_norms=l1_norms(Y)); gmm_many(X[0], Y[:10], x_norms=l1_norms(Y[:10]))
    gmm_many(S[0], S, x_norms=l1_norms(S)); gmm_many(X[0], Y[:10])
""")

_PROBE = textwrap.dedent("""
    import numpy as np, scipy.sparse as sp
    import numba.np.ufunc.parallel as pool
    from gmmlsh.core.gcws import sketch
    from gmmlsh.core.gmm import gmm_many, l1_norms
    x = np.zeros((1, 784), np.float32); x[0, :20] = 1.0
    sketch(x, 256, path="direct")
    s = sp.csr_matrix(([1.0, 2.0, 3.0], [5, 70, 4000], [0, 3]), shape=(1, 5000))
    sketch(s, 256, path="direct")
    Y = np.tile(x, (10, 1))
    gmm_many(x[0], Y, x_norms=l1_norms(Y))
    print("pool started" if pool._is_initialized else "pool idle")
""")


def _run(code: str, cache: Path) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_small_work_never_starts_the_thread_pool_with_a_warm_cache(tmp_path):
    _run(_WARM, tmp_path)  # compiles and caches both twins of every kernel
    assert _run(_PROBE, tmp_path) == "pool idle"


def test_twins_are_cached_under_their_own_names():
    def kernel(x):
        return x + 1

    par, ser = twin_kernels(kernel, cache=True)
    assert par.py_func.__qualname__ != ser.py_func.__qualname__
    assert par.targetoptions.get("parallel") and not ser.targetoptions.get("parallel")
    assert par(1) == ser(1) == 2
