"""Fashion-MNIST grown to any size, deterministically, and its exact top-10 (cached on disk).

Rows ``0 … 59,999`` are the training images; row ``i ≥ 60,000`` is training image
``i mod 60,000`` shifted by ``(dx, dy) ∈ [−2, 2]²`` (zero fill) and scaled by a
factor in ``[0.8, 1.2]``, clipped to 0–255 (float32). The shift and factor of a row
come from a generator seeded by its block of 60,000 rows, so every size is a
prefix of every larger one (:mod:`bench.grown`). Queries are the first test images;
the truth is the exact GMM top 10 of each against the first ``n`` rows.

    python -m bench.scale_data 1000000       # writes the data and the truth, prints where
"""

from __future__ import annotations

from functools import cache

import numpy as np

from bench import exact
from bench.common import DATA, data_main
from bench.grown import CACHE, Grown

BASE = 60_000

__all__ = ["BASE", "CACHE", "FASHION", "block", "data", "data_path", "extra", "queries", "train", "truth"]


@cache
def train() -> np.ndarray:
    """The 60,000 training images (uint8, 60,000 × 784)."""
    return np.load(DATA / "fashion-mnist.npz")["train"]


def block(b: int) -> np.ndarray:
    """Block ``b`` (rows ``b·60,000 …``): the training images, or their shifted, scaled copies."""
    images = train()
    if b == 0:
        return images.astype(np.float32)
    rng = np.random.default_rng([20261125, b])
    shift = rng.integers(-2, 3, size=(BASE, 2))
    scale = rng.uniform(0.8, 1.2, size=BASE).astype(np.float32)
    frames = images.reshape(BASE, 28, 28).astype(np.float32)
    out = np.zeros_like(frames)
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            sel = np.flatnonzero((shift[:, 0] == dx) & (shift[:, 1] == dy))
            src = frames[sel]
            dst = np.zeros_like(src)
            ys, yd = (slice(0, 28 - dy), slice(dy, 28)) if dy >= 0 else (slice(-dy, 28), slice(0, 28 + dy))
            xs, xd = (slice(0, 28 - dx), slice(dx, 28)) if dx >= 0 else (slice(-dx, 28), slice(0, 28 + dx))
            dst[:, yd, xd] = src[:, ys, xs]
            out[sel] = dst
    out *= scale[:, None, None]
    np.clip(out, 0, 255, out=out)
    out = out.reshape(BASE, 784)
    empty = ~out.any(axis=1)  # a shift can push a small image out of the frame: keep the original
    out[empty] = images[empty]
    return out


FASHION = Grown("fmnist", BASE, 784, sparse=False, block=block)


def data_path(n: int):
    return FASHION.path(n)


def data(n: int) -> np.ndarray:
    """The first ``n`` rows (float32, memory-mapped), written on first use."""
    return FASHION.data(n)


def extra(count: int, n: int) -> np.ndarray:
    """``count`` rows that follow the first ``n`` (for inserts into an index of ``n``)."""
    return FASHION.rows(n, n + count)


def queries(nq: int) -> np.ndarray:
    return np.load(DATA / "fashion-mnist.npz")["test"][:nq].astype(np.float32)


def truth(n: int, nq: int, k: int = 10) -> np.ndarray:
    """Row numbers of each query's exact top ``k`` among the first ``n`` rows (cached)."""
    path = CACHE / f"fmnist-{n}-truth-{nq}x{k}.npy"
    if path.exists():
        return np.load(path)
    out = exact.top_k(queries(nq), [(np.arange(n), data(n))], k)[0]
    np.save(path, out)
    return out


if __name__ == "__main__":
    data_main(__doc__, data, truth, data_path, queries=1000)
