"""The storage interface: what the index needs from a backend, and nothing more.

The LSH logic (hashing, banding, ranking, rerank) lives in :mod:`index.index`;
a backend only keeps bytes under names and answers bulk reads. Two backends
implement it — :mod:`index.lmdb_store` (embedded, the default) and
:mod:`index.redis_store` (shared by many API replicas) — and both pass the same
contract tests (``tests/store_contract.py``).

Vocabulary
----------
* **external id** (``str``): the user's id.
* **internal id** (``iid``, ``uint32``): the store's handle for one *version* of
  a vector. A record under an iid never changes once written, and an iid is
  never reused: an upsert of an existing id allocates a fresh iid and retires
  the old one (its blobs and bucket entries go). So a reader may cache
  ``iid → blob`` forever: a retired iid simply stops appearing in buckets.
* **blob fields**: ``vector`` (encoded by :mod:`index.codec`, norm included),
  ``sketch`` (packed b-bit codes), ``nrff`` (float32 features, optional),
  ``meta`` (JSON bytes, optional).
* **band key** (``bytes``): 2-byte big-endian band number + packed codes of
  that band. A bucket holds the iids of every vector with that band key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

FIELDS = ("vector", "sketch", "nrff", "meta")

#: ``band_keys_of(sketches)`` maps packed sketches ``(n, sketch_bytes) uint8`` to
#: band keys ``(n, L, key_bytes) uint8``; the store calls it to find the bucket
#: entries of a record it is about to replace or delete.
BandKeysFn = Callable[[np.ndarray], np.ndarray]


class StoreError(RuntimeError):
    """Base class of storage failures."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached (Redis down, LMDB unreadable): the service answers 503."""


class ConfigConflict(StoreError):
    """The stored index configuration differs from the one asked for."""


@dataclass
class RecordBatch:
    """Columnar batch of records to upsert. Row ``v`` of every field belongs together.

    If an external id appears more than once, the last occurrence wins.
    """

    ids: list[str]
    vectors: list[bytes]
    sketches: np.ndarray  # (n, sketch_bytes) uint8
    band_keys: np.ndarray  # (n, L, key_bytes) uint8
    nrff: np.ndarray | None = None  # (n, m) float32
    meta: list[bytes | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def has_nrff(self) -> bool:
        """Whether the records carry NRFF features (an index with ``nrff_k`` > 0)."""
        return self.nrff is not None and self.nrff.shape[1] > 0

    def check(self) -> None:
        """Reject a malformed batch (ValueError naming each problem) before a store writes any of it."""
        n = len(self.ids)
        problems = []
        if len(self.vectors) != n:
            problems.append(f"vectors: {len(self.vectors)} rows for {n} ids")
        sk, bk = np.asarray(self.sketches), np.asarray(self.band_keys)
        if sk.dtype != np.uint8 or sk.ndim != 2 or sk.shape[0] != n:
            problems.append(f"sketches: need ({n}, bytes) uint8, got {sk.shape} {sk.dtype}")
        elif n and sk.shape[1] == 0:
            problems.append("sketches: empty sketches")
        if bk.dtype != np.uint8 or bk.ndim != 3 or bk.shape[0] != n:
            problems.append(f"band_keys: need ({n}, L, key_bytes) uint8, got {bk.shape} {bk.dtype}")
        elif n and (bk.shape[1] == 0 or bk.shape[2] == 0):
            problems.append(f"band_keys: empty band keys {bk.shape}")
        if self.nrff is not None and (self.nrff.ndim != 2 or self.nrff.shape[0] != n):
            problems.append(f"nrff: need ({n}, m) float32, got {self.nrff.shape}")
        if self.meta is not None and len(self.meta) != n:
            problems.append(f"meta: {len(self.meta)} rows for {n} ids")
        bad = next((i for i, e in enumerate(self.ids) if not isinstance(e, str)), None)
        if bad is not None:
            problems.append(f"ids[{bad}]: must be a string, got {type(self.ids[bad]).__name__}")
        if problems:
            raise ValueError("; ".join(problems))


def decode_names(blobs: list[bytes | None]) -> list[str | None]:
    """External-id blobs as stored (UTF-8) → strings; None stays None."""
    return [b.decode("utf-8") if b is not None else None for b in blobs]


class Store(Protocol):
    """A backend. All methods are safe to call from several threads of one process."""

    # --- configuration ---------------------------------------------------------
    def read_config(self) -> dict | None:
        """The stored index configuration, or None for a new (empty) store."""

    def init_config(self, config: dict) -> dict:
        """Store ``config`` if none is stored yet; return what is stored (atomically)."""

    # --- writes ----------------------------------------------------------------
    def upsert(self, batch: RecordBatch, band_keys_of: BandKeysFn) -> None:
        """Insert or replace every record of the batch.

        Replacing removes the old record's bucket entries. A reader never sees a
        half-written vector: LMDB commits the batch as one transaction; Redis
        makes each vector visible atomically and a retried batch completes it.
        """

    def delete(self, ids: Sequence[str], band_keys_of: BandKeysFn) -> int:
        """Remove these external ids everywhere; returns how many existed."""

    # --- reads -----------------------------------------------------------------
    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        """Internal ids (int64) of these external ids; -1 where unknown."""

    def external_ids(self, iids: np.ndarray) -> list[str | None]:
        """External ids of these internal ids; None where the iid is gone."""

    def bucket_members(self, keys: Sequence[bytes]) -> np.ndarray:
        """Members of all these buckets concatenated (uint32), one entry per bucket hit.

        One round trip / one C-level call for all keys: this is the query hot path.
        """

    def fetch(self, iids: np.ndarray, field: str) -> list[bytes | None]:
        """Blob ``field`` of each iid, in order; None where absent. One round trip."""

    def ids_and_fetch(self, iids: np.ndarray, field: str) -> tuple[list[str | None], list[bytes | None]]:
        """``(external_ids(iids), fetch(iids, field))`` read together: one round trip, one snapshot.

        A query's answer needs both (names and metadata of its neighbours).
        """

    def ids_fetch_and_news(self, iids: np.ndarray, field: str, token: object
                           ) -> tuple[list[str | None], list[bytes | None], bool, int | None]:
        """:meth:`ids_and_fetch`, plus whether any iid was allocated since ``token``
        (from :meth:`allocated_since`) and the epoch (see :meth:`news_and_epoch`), in
        the same round trip and snapshot.

        Lets a reader answer from its sketch cache first and confirm it was
        current with the answer's own read, instead of a round trip before it.
        """

    def news_and_epoch(self, token: object) -> tuple[bool, int | None]:
        """Whether any iid was allocated since ``token``, and the epoch: an integer that
        grows whenever a live iid is retired (it may grow at other writes too), or None
        where the store cannot tell. One cheap read.

        While the epoch stands still, every name a reader has seen is still live: a
        reader may then answer from its cache of names and metadata.
        """

    def scan(self, field: str, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, list[bytes]]]:
        """Every live record's ``field`` in internal-id order, as (iids, blobs) chunks."""

    def scan_buckets(self) -> Iterator[tuple[bytes, np.ndarray]]:
        """Every bucket as (band key, member iids); for integrity checks."""

    def count(self) -> int:
        """Number of live vectors (exact)."""

    def iid_bound(self) -> int:
        """An upper bound (exclusive) on every live internal id, for sizing arrays."""

    def allocated_since(self, token: object | None) -> tuple[np.ndarray, object]:
        """Internal ids handed out since ``token`` (None: since the start), and a new token.

        How a reader keeps an in-memory copy of every sketch current without a
        full scan. Some returned iids may hold no record (yet, or any more): a
        writer may still be committing, or the vector was retired since.
        """

    # --- housekeeping ------------------------------------------------------------
    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` if the backend cannot be reached."""

    def info(self) -> dict:
        """Backend facts for /stats and `gmmlsh info`: kind, location, bytes used."""

    def close(self) -> None:
        """Release connections / the environment."""
