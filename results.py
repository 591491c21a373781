"""What a query and a read-back answer: the result types of the index and of the HTTP client.

One definition serves both :class:`gmmlsh.Index` and :class:`gmmlsh.Client`, so an answer has
the same shape in process and over HTTP. The module needs numpy alone: the client imports it
without loading numba, the index or the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Neighbor(NamedTuple):
    """One hit: its id, its exact similarity to the query under the answer's mode, its metadata.

    Immutable, and a named tuple rather than a frozen dataclass: an answer makes ``k`` of them,
    and a frozen dataclass takes four times as long to make (2.0 against 0.5 µs: ~15 µs a query
    at k = 10, 3 % of a query at 60,000 rows)."""

    id: str
    similarity: float
    metadata: dict | None = None


class QueryResult(NamedTuple):
    """An answer: the search that produced it (``mode``: ``sketch``, ``postings``, ``exact`` or
    ``nrff``), the ``k`` asked for, how many vectors it scored exactly (``candidates``) and the
    neighbours, best first."""

    mode: str
    k: int
    candidates: int
    neighbors: tuple[Neighbor, ...] = ()


@dataclass(frozen=True, eq=False)
class StoredVector:
    """A vector read back, in the shape it was sent in: dense ``values`` (``indices`` None) or
    sparse ``indices`` (int64) + ``values``; values are float32, the precision the index stores.
    (Not comparable with ``==``: compare the arrays, e.g. with ``np.array_equal``.)"""

    id: str
    values: np.ndarray
    indices: np.ndarray | None
    metadata: dict | None

    def toarray(self, dim: int) -> np.ndarray:
        """The vector as a dense float32 array of ``dim`` values (the index's dimension)."""
        if self.indices is None:
            return self.values.copy()
        out = np.zeros(dim, dtype=np.float32)
        out[self.indices] = self.values
        return out
