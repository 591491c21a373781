"""The GMM index: GCWS sketches, LSH banding, candidate ranking and exact rerank.

(Skeleton: the public API below is the contract the service and the CLI code
against; bodies land with issue 3.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from index.config import IndexConfig

MODES = ("lsh", "exact", "nrff")


class UnknownIdError(KeyError):
    """No vector is stored under this external id (the service answers 404)."""

    def __init__(self, ext_id: str):
        super().__init__(ext_id)
        self.ext_id = ext_id

    def __str__(self) -> str:
        return f"id: no vector with id {self.ext_id!r}"


@dataclass
class Neighbor:
    id: str
    similarity: float
    metadata: dict | None = None


@dataclass
class QueryResult:
    mode: str
    k: int
    candidates: int  # how many vectors were scored exactly
    neighbors: list[Neighbor] = field(default_factory=list)


@dataclass
class StoredVector:
    id: str
    values: np.ndarray  # dense float32 (storage "dense") or the sparse values
    indices: np.ndarray | None  # sparse indices, or None for dense storage
    metadata: dict | None


class Index:
    """Open with :meth:`open`; one instance per process (never share across fork).

    * ``Index.open(location, config=None, *, prefix="gmmlsh", create=True)``:
      ``location`` is a directory (LMDB) or a ``redis://`` / ``rediss://`` URL
      (``prefix`` names the index inside Redis). ``config=None`` reads the stored
      one (error if there is none and ``create`` needs one); a config that
      conflicts with the stored one raises :class:`index.store.ConfigConflict`.
    * ``upsert(ids, X, metadata=None) -> int``: ``X`` a dense 2-D array (n, dim)
      or a scipy CSR matrix; metadata a list of dicts/None. Validates everything
      first (``core.validate`` errors) and writes nothing if any row is bad.
    * ``delete(ids) -> int``; ``get(id) -> StoredVector`` (UnknownIdError);
      ``contains(id)``; ``count()``.
    * ``query(vector=None, *, id=None, k=10, mode="lsh", min_similarity=0.0,
      candidates=None, bands=None) -> QueryResult``. ``vector`` is a dense 1-D
      array, or a ``(indices, values)`` pair, or a 1-row CSR matrix. By ``id``
      the vector itself is excluded from its neighbours.
    * ``query_batch(X, k=10, ...) -> list[QueryResult]``.
    * ``stats() -> dict``; ``ping()``; ``close()``; usable as a context manager.
    """

    config: IndexConfig

    @classmethod
    def open(cls, location, config: IndexConfig | None = None, *, prefix: str = "gmmlsh",
             create: bool = True, **store_options) -> Index:
        raise NotImplementedError

    def upsert(self, ids: Sequence[str], X, metadata: Sequence[dict | None] | None = None) -> int:
        raise NotImplementedError

    def delete(self, ids: Sequence[str]) -> int:
        raise NotImplementedError

    def get(self, ext_id: str) -> StoredVector:
        raise NotImplementedError

    def contains(self, ext_id: str) -> bool:
        raise NotImplementedError

    def count(self) -> int:
        raise NotImplementedError

    def query(self, vector=None, *, id: str | None = None, k: int = 10, mode: str = "lsh",
              min_similarity: float = 0.0, candidates: int | None = None,
              bands: int | None = None) -> QueryResult:
        raise NotImplementedError

    def query_batch(self, X, *, k: int = 10, mode: str = "lsh", min_similarity: float = 0.0,
                    candidates: int | None = None, bands: int | None = None) -> list[QueryResult]:
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError

    def ping(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
