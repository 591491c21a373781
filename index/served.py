"""The queries an index has served: a uniform sample kept with the index, for the tuner.

Every process that serves queries keeps its own reservoir of the queries it served since it
last *flushed* (:class:`QuerySample`), and now and then merges it into the index's shared one,
a file of the search mirror (``served.npz``, under a lock): the merge keeps a uniform sample of
everything served, by every worker and every ``gmmlsh query`` run, across restarts. The tuner
(in whichever process runs upkeep) reads the shared sample.

Merging two uniform samples: each slot of the merged sample comes from the first with
probability ``N₁ / (N₁ + N₂)`` (``N``: how many queries each sample was drawn from), drawn
without replacement within each — the merge of two reservoirs is a reservoir of their union.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from gmmlsh.index.records import SparseRow

#: Most queries a sample keeps.
SIZE = 256
#: A process merges its queries into the shared sample after this many, or this many seconds.
FLUSH_QUERIES = 64
FLUSH_SECONDS = 30.0


class QuerySample:
    """A uniform sample (reservoir) of query rows at stored precision (dense 1-row arrays or
    1-row sparse matrices, as given); thread-safe. ``seen``: how many it was drawn from."""

    def __init__(self, size: int = SIZE, seed: int | None = None):
        self.size = size
        self.seen = 0
        self.rows: list = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.flushed_at = time.monotonic()

    def add(self, X32, own: bool = False) -> None:
        """Offer each row of a validated query batch; ``own``: the batch is one row nobody else
        holds (a query's own copy), kept as it is rather than copied."""
        with self._lock:
            for i in range(X32.shape[0]):
                self.seen += 1
                at = len(self.rows) if len(self.rows) < self.size else self._rng.randrange(self.seen)
                if at < self.size:
                    row = X32 if own and X32.shape[0] == 1 else X32[i:i + 1].copy()
                    if at == len(self.rows):
                        self.rows.append(row)
                    else:
                        self.rows[at] = row

    def due(self, eager: bool) -> bool:
        """Whether to merge into the shared sample now: every :data:`FLUSH_SECONDS`, or every
        :data:`FLUSH_QUERIES` while ``eager`` (the shared sample still too small to tune on)."""
        return bool(self.seen) and (time.monotonic() - self.flushed_at > FLUSH_SECONDS
                                    or eager and self.seen >= FLUSH_QUERIES)

    def drain(self) -> tuple[int, list]:
        """(seen, rows) so far, the sample emptied."""
        with self._lock:
            out = self.seen, self.rows
            self.seen, self.rows, self.flushed_at = 0, [], time.monotonic()
        return out


class Flusher:
    """Runs the flushes that are due on a thread of its own, never a query's time: ``due()``
    says which of ``flushes`` are; one hand-off at a time, again while more came due, and a
    query finding one under way leaves it be (it looks again once done)."""

    def __init__(self, due: Callable[[], tuple[bool, ...]], flushes: tuple[Callable[[], None], ...]):
        self._due, self._flushes = due, flushes
        self._pool, self._lock = ThreadPoolExecutor(1, thread_name_prefix="gmmlsh-flush"), threading.Lock()

    def poke(self) -> None:
        """Hand off the flushes if any is due."""
        if any(self._due()) and self._lock.acquire(blocking=False):
            try:
                self._pool.submit(self._run)
            except RuntimeError:  # shut down: the closer flushes what there was
                self._lock.release()

    def _run(self) -> None:
        while True:
            due = self._due()
            try:
                for flush, now in zip(self._flushes, due, strict=True):
                    if now:
                        flush()
            finally:
                self._lock.release()
            if not any(self._due()) or not self._lock.acquire(blocking=False):
                return

    def wait(self, timeout: float | None = None) -> None:
        """Return once the hand-off under way, if any, is done."""
        self._pool.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        """Wait for a hand-off under way; none starts after."""
        self._pool.shutdown(wait=True)


def merge(a: tuple[int, list], b: tuple[int, list], size: int = SIZE, rng: random.Random | None = None
          ) -> tuple[int, list]:
    """The uniform sample of the union of two uniform samples ``(seen, rows)``."""
    rng = rng or random.Random()
    (na, ra), (nb, rb) = a, b
    ra, rb = list(ra), list(rb)
    rng.shuffle(ra)
    rng.shuffle(rb)
    out = []
    while len(out) < size and (ra or rb):
        pick_a = bool(ra) and (not rb or rng.random() < na / max(na + nb, 1))
        out.append(ra.pop() if pick_a else rb.pop())
    return na + nb, out


class SharedSample:
    """The index's shared sample of served queries, in a mirror directory."""

    def __init__(self, directory: str | os.PathLike, dim: int):
        self.dir = Path(directory)
        self.dim = dim
        self._path = self.dir / "served.npz"
        self._meta = self.dir / "served.json"
        #: Queries the shared sample held when this process last looked.
        self.held = self.count()

    def count(self) -> int:
        """Queries the shared sample holds (a small file read)."""
        try:
            return int(json.loads(self._meta.read_text())["rows"])
        except (OSError, ValueError, KeyError):
            return 0

    def summary(self) -> dict:
        """What ``stats()`` shows: queries the shared sample holds and how many it was drawn from
        (every query served and merged, by every process, across restarts)."""
        try:
            meta = json.loads(self._meta.read_text())
            return {"queries": int(meta["rows"]), "seen": int(meta["seen"])}
        except (OSError, ValueError, KeyError):
            return {"queries": 0, "seen": 0}

    def load(self) -> tuple[int, list]:
        """(seen, rows): each row a 1-row CSR matrix at stored precision."""
        seen, X = self._matrix()
        return seen, [X[i:i + 1] for i in range(X.shape[0])]

    def _matrix(self) -> tuple[int, sp.csr_matrix]:
        """(seen, the sampled queries as one CSR matrix)."""
        try:
            with np.load(self._path) as d:
                seen, shape = int(d["seen"]), (int(d["rows"]), self.dim)
                return seen, sp.csr_matrix((d["data"], d["indices"], d["indptr"]), shape=shape)
        except (OSError, ValueError, KeyError):
            return 0, sp.csr_matrix((0, self.dim), dtype=np.float32)

    def rows(self, n: int) -> list:
        """Up to ``n`` of the sampled queries, 1-row batches (CSR)."""
        return self.load()[1][:n]

    def add(self, sample: QuerySample, lock) -> None:
        """Merge what ``sample`` holds into the shared sample (``lock``: the mirror's, held across
        the read and the write, so that two processes' merges do not lose each other's)."""
        mine = sample.drain()
        if not mine[0]:
            return
        with lock("served"):  # the stored rows kept by position and stacked once: no per-row matrices
            held, stored = self._matrix()
            seen, picked = merge((held, [(True, i) for i in range(stored.shape[0])]),
                                 (mine[0], [(False, r) for r in mine[1]]))
            X = sp.vstack([stored[[i for old, i in picked if old]], *_stacked([r for old, r in picked if not old])],
                          format="csr")
            tmp = self.dir / f"served.{os.getpid()}.{threading.get_ident()}.tmp.npz"
            np.savez(tmp, seen=seen, rows=X.shape[0], data=X.data, indices=X.indices, indptr=X.indptr)
            os.replace(tmp, self._path)
            meta = self.dir / f"served.{os.getpid()}.{threading.get_ident()}.tmp.json"
            meta.write_text(json.dumps({"seen": seen, "rows": X.shape[0]}))
            os.replace(meta, self._meta)
            self.held = X.shape[0]


def _stacked(rows: list) -> list[sp.csr_matrix]:
    """Sampled query rows as CSR blocks: the dense ones stacked into one, each other one its own."""
    dense = [r for r in rows if isinstance(r, np.ndarray)]
    blocks = [sp.csr_matrix(np.vstack(dense).astype(np.float32, copy=False))] if dense else []
    return blocks + [_csr(r) for r in rows if not isinstance(r, np.ndarray)]


def _csr(row) -> sp.csr_matrix:
    """A sampled query (a dense 1-row array, a 1-row sparse matrix or a :class:`SparseRow`) as CSR."""
    if isinstance(row, SparseRow):
        return row.csr()
    return sp.csr_matrix(row, dtype=np.float32)
