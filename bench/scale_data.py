"""Fashion-MNIST grown to any size, deterministically, and its exact top-10 (cached on disk).

Rows ``0 … 59,999`` are the training images; row ``i ≥ 60,000`` is training image
``i mod 60,000`` shifted by ``(dx, dy) ∈ [−2, 2]²`` (zero fill) and scaled by a
factor in ``[0.8, 1.2]``, clipped to 0–255 (float32). The shift and factor of a row
come from a generator seeded by its block of 60,000 rows, so every size is a
prefix of every larger one. Queries are the first test images; the truth is the
exact GMM top 10 of each against the first ``n`` rows.

    python -m bench.scale_data 1000000       # writes the data and the truth, prints where
"""

from __future__ import annotations

import os
from pathlib import Path

import numba
import numpy as np

from bench.common import DATA, data_main
from gmmlsh.core.gmm import gmm_matrix, l1_norms

BASE = 60_000
CACHE = Path(os.environ.get("GMMLSH_BENCH_CACHE", Path.home() / ".cache" / "gmmlsh-bench"))


def _block(train: np.ndarray, b: int) -> np.ndarray:
    """Block ``b`` (rows ``b·60,000 …``): the training images, or their shifted, scaled copies."""
    if b == 0:
        return train.astype(np.float32)
    rng = np.random.default_rng([20261125, b])
    shift = rng.integers(-2, 3, size=(BASE, 2))
    scale = rng.uniform(0.8, 1.2, size=BASE).astype(np.float32)
    images = train.reshape(BASE, 28, 28).astype(np.float32)
    out = np.zeros_like(images)
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            sel = np.flatnonzero((shift[:, 0] == dx) & (shift[:, 1] == dy))
            src = images[sel]
            dst = np.zeros_like(src)
            ys, yd = (slice(0, 28 - dy), slice(dy, 28)) if dy >= 0 else (slice(-dy, 28), slice(0, 28 + dy))
            xs, xd = (slice(0, 28 - dx), slice(dx, 28)) if dx >= 0 else (slice(-dx, 28), slice(0, 28 + dx))
            dst[:, yd, xd] = src[:, ys, xs]
            out[sel] = dst
    out *= scale[:, None, None]
    np.clip(out, 0, 255, out=out)
    out = out.reshape(BASE, 784)
    empty = ~out.any(axis=1)  # a shift can push a small image out of the frame: keep the original
    out[empty] = train[empty]
    return out


def data_path(n: int) -> Path:
    return CACHE / f"fmnist-{n}.npy"


def data(n: int) -> np.ndarray:
    """The first ``n`` rows (float32, memory-mapped), written on first use."""
    path = data_path(n)
    if not path.exists():
        train = np.load(DATA / "fashion-mnist.npz")["train"]
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, 784))
        for b in range(-(-n // BASE)):
            lo, hi = b * BASE, min(n, (b + 1) * BASE)
            out[lo:hi] = _block(train, b)[: hi - lo]
        out.flush()
        del out
        os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def extra(count: int, n: int) -> np.ndarray:
    """``count`` rows that follow the first ``n`` (for inserts into an index of ``n``)."""
    train = np.load(DATA / "fashion-mnist.npz")["train"]
    rows, b = [], n // BASE
    while sum(r.shape[0] for r in rows) < count:
        lo = max(n - b * BASE, 0)
        rows.append(_block(train, b)[lo:])
        b += 1
    return np.concatenate(rows)[:count]


def queries(nq: int) -> np.ndarray:
    return np.load(DATA / "fashion-mnist.npz")["test"][:nq].astype(np.float32)


def truth(n: int, nq: int, k: int = 10) -> np.ndarray:
    """Row numbers of each query's exact top ``k`` among the first ``n`` rows (cached)."""
    path = CACHE / f"fmnist-{n}-truth-{nq}x{k}.npy"
    if path.exists():
        return np.load(path)
    X, Q = data(n), queries(nq)
    qn = l1_norms(Q)
    best_s = np.full((nq, k), -1.0)
    best_i = np.zeros((nq, k), np.int64)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    step = 20_000
    for lo in range(0, n, step):
        block = np.ascontiguousarray(X[lo:lo + step])
        S = gmm_matrix(Q, block, qn, l1_norms(block))
        s = np.concatenate([best_s, S], axis=1)
        i = np.concatenate([best_i, np.arange(lo, lo + block.shape[0])[None, :].repeat(nq, 0)], axis=1)
        top = np.argpartition(-s, k - 1, axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(s, top, 1), np.take_along_axis(i, top, 1)
    order = np.argsort(-best_s, axis=1, kind="stable")
    out = np.take_along_axis(best_i, order, 1)
    np.save(path, out)
    return out


if __name__ == "__main__":
    data_main(__doc__, data, truth, data_path, queries=1000)
