"""A data set grown block by block to any size, deterministically, and cached on disk.

A :class:`Grown` set is a function ``block(b)`` giving rows ``b·base … (b+1)·base − 1``
(each block made from its own seeded generator), so the first ``n`` rows are the same
whatever size is asked for: every size is a prefix of every larger one. The first ``n``
rows are written once to ``GMMLSH_BENCH_CACHE`` (dense: a float32 ``.npy``, memory-mapped
when read; sparse: a CSR ``.npz`` as ``scipy.sparse.save_npz`` writes it), the formats
``gmmlsh build`` reads. The generators of :mod:`bench.scale_data`, :mod:`bench.sparse_data`
and :mod:`bench.zoo` are each a block function and a name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

CACHE = Path(os.environ.get("GMMLSH_BENCH_CACHE", Path.home() / ".cache" / "gmmlsh-bench"))

Rows = np.ndarray | sp.csr_matrix


@dataclass(frozen=True)
class Grown:
    """Rows made ``base`` at a time by ``block(b)``; ``name`` names the cache files."""

    name: str
    base: int
    dim: int
    sparse: bool
    block: Callable[[int], Rows]

    def rows(self, lo: int, hi: int) -> Rows:
        """Rows ``lo … hi − 1``, made from their blocks (not cached)."""
        parts = [self.block(b)[max(lo - b * self.base, 0):hi - b * self.base]
                 for b in range(lo // self.base, -(-hi // self.base))]
        if self.sparse:
            return sp.vstack(parts, format="csr") if parts else sp.csr_matrix((0, self.dim), dtype=np.float32)
        return np.concatenate(parts) if parts else np.zeros((0, self.dim), np.float32)

    def path(self, n: int) -> Path:
        return CACHE / f"{self.name}-{n}.{'npz' if self.sparse else 'npy'}"

    def data(self, n: int) -> Rows:
        """The first ``n`` rows (dense: float32, memory-mapped; sparse: CSR float32), written on first use."""
        path = self.path(n)
        if not path.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # several writers may race
            if self.sparse:
                sp.save_npz(tmp, self.rows(0, n), compressed=False)
            else:
                out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, self.dim))
                for b in range(-(-n // self.base)):
                    lo, hi = b * self.base, min(n, (b + 1) * self.base)
                    out[lo:hi] = self.block(b)[:hi - lo]
                out.flush()
                del out
            os.replace(tmp, path)
        if self.sparse:
            return sp.load_npz(path).tocsr()
        return np.load(path, mmap_mode="r")
