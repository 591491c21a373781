"""The storage protocol: what an index keeps in its backend, and nothing more.

A store holds *records* and the map from external ids to them; it knows nothing
of sketches' meaning or of the search structure. Two backends implement it —
:mod:`gmmlsh.index.store.lmdb` (embedded, the default) and
:mod:`gmmlsh.index.store.redis` (shared by many API replicas) — and both pass the
same contract tests (``tests/store_contract.py``) against the real thing.

Vocabulary
----------
* **external id** (``str``): the user's id, 1 to :data:`MAX_ID_BYTES` bytes of UTF-8.
* **internal id** (``iid``, < 2³²): the store's handle for one *version* of a
  vector. A record under an iid never changes once written and an iid is never
  reused: an upsert of an existing id writes a fresh iid and *retires* the old
  one (its record goes). So any reader may cache what it read under an iid.
* **record fields**: ``name`` (the external id, UTF-8), ``vector`` (see
  :mod:`gmmlsh.index.records`), ``sketch`` (packed b-bit codes), ``nrff``
  (float32 features, optional) and ``meta`` (JSON, optional).
* **the feed**: the store numbers its changes. :meth:`Store.token` is a cheap
  read of where the feed stands; :meth:`Store.changes` lists the iids added and
  retired since an earlier token. Each process's search mirror
  (:mod:`gmmlsh.index.mirror`) follows the feed instead of scanning the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

#: Record fields, in the order :meth:`Store.read` and :meth:`Store.scan` accept them.
FIELDS = ("name", "vector", "sketch", "nrff", "meta")
#: Largest external id in bytes of UTF-8 (LMDB's key limit): one limit for every backend.
MAX_ID_BYTES = 511
#: Internal ids are unsigned 32-bit integers.
IID_LIMIT = 1 << 32

#: Where a store's feed stands: a tuple of counters, equal only if nothing changed.
Token = tuple[int, ...]


class StoreError(RuntimeError):
    """Base class of storage failures. ``stored``: ids of the failed write that were stored all
    the same (only where a store cannot write a batch as one: a Redis Cluster's id shards)."""

    stored: tuple[str, ...] = ()


class StoreUnavailable(StoreError):
    """The backend cannot be reached (Redis down, LMDB unreadable): the service answers 503."""


class DiskFull(StoreError):
    """No space left where the index writes (its disk, or Redis' memory): nothing was written.

    Reads go on; writes succeed again once space is freed.
    """


class ConfigConflict(StoreError):
    """The stored index configuration differs from the one asked for."""


@dataclass
class RecordBatch:
    """Records to upsert, column by column; row ``v`` of every column belongs together.

    Made by :meth:`gmmlsh.index.index.Index.prepare`, which validates everything;
    stores trust it. If an external id appears more than once, its last row wins.
    """

    ids: list[str]
    vectors: list[bytes]
    sketches: np.ndarray  # (n, sketch_bytes) uint8
    nrff: np.ndarray | None = None  # (n, m) float32, or None when the index keeps no NRFF features
    meta: list[bytes | None] | None = None  # JSON objects, or None for all rows

    def __len__(self) -> int:
        return len(self.ids)

    def stored(self, row: int) -> dict[str, bytes | None]:
        """Row ``row``'s fields as :meth:`Store.read` gives them back (None: a field not stored)."""
        return {"name": self.ids[row].encode(), "vector": self.vectors[row], "sketch": self.sketches[row].tobytes(),
                "nrff": self.nrff[row].tobytes() if self.nrff is not None else None,
                "meta": self.meta[row] if self.meta is not None else None}

    def last_rows(self) -> np.ndarray:
        """Rows that survive "the last occurrence of an id wins", ascending."""
        last = {ext_id: i for i, ext_id in enumerate(self.ids)}
        return np.fromiter(sorted(last.values()), dtype=np.int64, count=len(last))


class Written(NamedTuple):
    """What a write did: ``vectors`` ids written (an id given twice in a batch counts once: its
    last row wins), ``replaced`` of them held a vector before (which the write replaced); where
    the store says, ``iids``: the iid each row of the batch was stored under (-1 for a row a later
    one of the same id overrode), so this process can put its own write into its search mirror
    without reading it back (:meth:`gmmlsh.index.mirror.Mirror.sync`)."""

    vectors: int
    replaced: int
    iids: np.ndarray | None = None


@dataclass(frozen=True)
class Changes:
    """What happened in a store between two tokens.

    ``added``: iids handed out since, ascending; each names a record that was
    committed with it, unless it has been retired again since (then reading it
    gives None). ``retired``: iids retired since (their records are gone).
    """

    added: np.ndarray
    retired: np.ndarray
    token: Token


class Store(Protocol):
    """A backend. Every method may be called from several threads of one process."""

    kind: str  # "lmdb" or "redis"
    #: Every writer of the store is on this machine and keeps the one search mirror it has (an
    #: LMDB directory holds its mirror): a write is applied to the mirror before it is
    #: acknowledged, so a query never applies writes itself (see ``Index.write``).
    local: bool

    # --- configuration --------------------------------------------------------------
    def read_config(self) -> dict | None:
        """The stored index configuration, or None for a new (empty) store."""

    def init_config(self, config: dict) -> dict:
        """Store ``config`` if none is stored yet; return what is stored (atomically)."""

    # --- writes --------------------------------------------------------------------
    def write(self, batch: RecordBatch) -> Written:
        """Insert or replace every record of the batch; a replaced id's old iid is retired.
        Returns how many ids were written, and how many of them replaced a vector.

        A reader never sees half a record: LMDB commits the batch as one
        transaction; Redis makes each record visible atomically.
        """

    def delete(self, ids: Sequence[str], expect: np.ndarray | None = None) -> int:
        """Retire these external ids; returns how many existed (each counted once). With ``expect``
        (an iid per id), an id is retired only if it still has that iid (a vector replaced since
        it was read stays), in the same atomic step."""

    # --- reads -----------------------------------------------------------------------
    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        """Internal ids (int64) of these external ids; -1 where unknown."""

    def read(self, iids: np.ndarray, fields: Sequence[str]) -> dict[str, list[bytes | None]]:
        """These fields of these iids, from one snapshot; None where absent (retired, unknown, -1)."""

    def token(self) -> Token:
        """Where the feed stands: one cheap read. Equal tokens mean no write in between."""

    def token_later(self) -> Callable[[], Token]:
        """:meth:`token`, asked for now and read when the returned function is called (a
        network store sends the request at once: the caller works while it travels). The
        function must be called exactly once."""

    def changes(self, since: Token | None) -> Changes:
        """iids added and retired after ``since`` (None: every iid ever added, none retired)."""

    def scan(self, fields: Sequence[str], batch_size: int = 4096
             ) -> Iterator[tuple[np.ndarray, dict[str, list[bytes | None]]]]:
        """Every iid that holds any of ``fields`` (orphaned leftovers included), in iid order,
        as ``(iids, {field: blobs})`` chunks. For rebuilds and integrity checks."""

    def scan_ids(self, batch_size: int = 4096) -> Iterator[tuple[list[str], np.ndarray]]:
        """Every (external id, iid) pair of the id map, as ``(ids, iids)`` chunks."""

    def count(self) -> int:
        """Number of live vectors (exact)."""

    # --- housekeeping -------------------------------------------------------------------
    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` if the backend cannot be reached."""

    def write_problem(self) -> str | None:
        """Why a write would be refused now (a full disk or Redis, an evicting Redis), or None."""

    def info(self) -> dict:
        """Backend facts for /stats and ``gmmlsh info``: kind, location, bytes used."""

    def close(self) -> None:
        """Release connections / the environment (idempotent)."""


def read_through(store: Store, written: tuple[np.ndarray, RecordBatch] | None
                 ) -> Callable[[np.ndarray, Sequence[str]], dict[str, list[bytes | None]]]:
    """``store.read``, for a process that has just written a batch (``written``: the iid of each of
    its rows, as :attr:`Written.iids` says, and the batch): the records it holds are taken from
    the batch, the rest read. A record never changes under its iid, so the two agree; one retired
    since comes back all the same, and the feed's retirement of it clears it where it is used."""
    if written is None or written[0] is None:
        return store.read
    row_of = {i: r for r, i in enumerate(written[0].tolist()) if i >= 0}
    batch = written[1]

    def read(iids: np.ndarray, fields: Sequence[str]) -> dict[str, list[bytes | None]]:
        a = np.asarray(iids, dtype=np.int64).tolist()
        out: dict[str, list[bytes | None]] = {f: [None] * len(a) for f in fields}
        miss = [p for p, i in enumerate(a) if i not in row_of]
        if miss:
            got = store.read(np.asarray(iids)[miss], fields)
            for f in fields:
                for p, v in zip(miss, got[f], strict=True):
                    out[f][p] = v
        for p, i in enumerate(a):
            if i in row_of:
                rec = batch.stored(row_of[i])
                for f in fields:
                    out[f][p] = rec[f]
        return out

    return read
