"""The embedded LMDB backend (the default): one directory, ACID batches, many reader processes.

Layout (named databases of one environment):

* ``config``   — ``b"config"`` → JSON of the index configuration.
* ``ext2iid``  — external id (UTF-8) → internal id as 4-byte big-endian uint32.
* ``iid2ext``  — iid (4-byte big-endian) → external id (UTF-8).
* ``vector``, ``sketch``, ``nrff``, ``meta`` — iid (4-byte big-endian) → blob.
  Big-endian keys make LMDB's byte order equal the numeric order, so a cursor
  walks records in iid order (``scan``).
* ``counters`` — ``b"next_iid"`` and ``b"live"`` as little-endian uint64.
* ``buckets``  — band key → iid, ``dupsort + dupfixed + integerdup`` with the iid
  as a *native-endian* uint32. ``MDB_GET_MULTIPLE`` then returns a bucket's ids
  as one packed page run, so :meth:`LmdbStore.bucket_members` reads every bucket
  of a query in a single C call (``Cursor.getmulti(..., keyfixed=True)``).

Processes and threads. An LMDB environment must be opened **in each process**
(after fork, e.g. in the uvicorn lifespan) and never inherited across fork;
the store refuses to be used from a process other than the one that opened
it, and py-lmdb refuses to open the same environment twice in one process.
Within a process every method may be called from any thread: each call opens
its own short read transaction (never shared between threads), and LMDB
serialises write transactions (across processes too). ``max_spare_txns=0``
keeps no cached reader slot that a fork could duplicate, ``reader_check()`` at
open frees the slots of SIGKILLed processes, and ``map_size`` is set once,
generously, because concurrent resizes from several processes corrupt
databases. A writable open takes the writer lock for a moment (to create the
named databases), so it waits for a write batch in progress elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np
from gmmlsh.index.store.base import (
    FIELDS,
    BandKeysFn,
    RecordBatch,
    StoreError,
    StoreUnavailable,
    decode_names,
)

_CONFIG_KEY = b"config"
_NEXT_IID = b"next_iid"
_LIVE = b"live"
_U64 = struct.Struct("<Q")
_IID_LIMIT = 1 << 32
_BE_U4 = np.dtype(">u4")
_NATIVE_U4 = np.dtype("=u4")
_PUT_CHUNK = 1 << 16


def _be_keys(iids: np.ndarray) -> list[bytes]:
    """4-byte big-endian keys of (already range-checked) iids, built in C."""
    return np.ascontiguousarray(iids, dtype=_BE_U4).view("V4").tolist()


def _iids_of_keys(keys: list[bytes]) -> np.ndarray:
    """Inverse of :func:`_be_keys`, as int64."""
    return np.frombuffer(b"".join(keys), dtype=_BE_U4).astype(np.int64)


def _rows_as_bytes(a: np.ndarray) -> list[bytes]:
    """Each row of a 2-D array as one ``bytes`` (no Python loop; trailing NULs kept)."""
    a = np.ascontiguousarray(a)
    width = a.shape[1] * a.itemsize
    if width == 0:
        return [b""] * a.shape[0]
    return a.view(np.uint8).reshape(a.shape[0], width).view(f"V{width}").ravel().tolist()


def _records(buf: memoryview, key_len: int) -> np.ndarray:
    """A ``getmulti(keyfixed=True)`` result as packed (key, native uint32 iid) records."""
    dtype = np.dtype([("key", f"V{key_len}"), ("iid", _NATIVE_U4)])  # packed, unaligned
    return np.frombuffer(buf, dtype=dtype)


def _members(buf: memoryview, key_len: int) -> np.ndarray:
    """The iids of a ``getmulti(keyfixed=True)`` result (a 4-byte field copy: ~15x
    faster than slicing the bytes as a 2-D uint8 array)."""
    return np.ascontiguousarray(_records(buf, key_len)["iid"])


class LmdbStore:
    """LMDB implementation of :class:`index.store.Store`.

    ``map_size`` is the most the data file may grow to (virtual address space
    only; 1 TiB costs nothing on 64-bit). ``max_readers`` bounds concurrent read
    transactions over *all* processes (workers × threads; only the first process
    to open the environment sets it). ``readonly`` opens an existing index for
    reading; ``lock=False`` disables LMDB's locking (only for a read-only copy
    nobody writes to).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        map_size: int = 1 << 40,
        max_readers: int = 1024,
        readonly: bool = False,
        lock: bool = True,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._map_size = int(map_size)
        self._close_lock = threading.Lock()
        self._env: lmdb.Environment | None = None
        if readonly and not (self.path / "data.mdb").exists():
            raise StoreError(f"no LMDB index at {self.path} (data.mdb missing)")
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        try:
            env = lmdb.open(
                str(self.path),
                map_size=self._map_size,
                subdir=True,
                readonly=readonly,
                lock=lock,
                max_readers=max_readers,
                max_dbs=16,
                max_spare_txns=0,
                create=not readonly,
            )
        except lmdb.Error as e:
            if "already open" in str(e):
                raise StoreError(
                    f"LMDB environment {self.path} is already open in this process; "
                    "share that LmdbStore instead of opening a second one"
                ) from e
            raise StoreUnavailable(f"cannot open LMDB index at {self.path}: {e}") from e
        try:
            #: Reader slots of dead processes freed at open (SIGKILLed workers leave them).
            self.stale_readers_cleared: int = env.reader_check() if lock else 0
            self._open_dbs(env)
            self._key_max = env.max_key_size()
        except BaseException:
            env.close()
            raise
        self._pid = os.getpid()
        self._env = env

    def _open_dbs(self, env: lmdb.Environment) -> None:
        """Open (creating if writable) the named databases in one transaction."""
        specs: dict[str, dict] = {
            "config": {},
            "ext2iid": {},
            "iid2ext": {},
            "counters": {},
            "buckets": {"dupsort": True, "dupfixed": True, "integerdup": True},
        }
        specs.update({f: {} for f in FIELDS})
        dbs = {}
        try:
            if self.readonly:
                for name, flags in specs.items():
                    dbs[name] = env.open_db(name.encode(), create=False, **flags)
            else:
                with env.begin(write=True) as txn:
                    for name, flags in specs.items():
                        dbs[name] = env.open_db(name.encode(), txn=txn, create=True, **flags)
        except lmdb.NotFoundError as e:
            raise StoreError(f"{self.path} holds no gmmlsh index (open it writable once to create it)") from e
        except lmdb.IncompatibleError as e:
            raise StoreError(f"{self.path} is an LMDB environment of another layout: {e}") from e
        except lmdb.Error as e:
            raise StoreUnavailable(f"cannot open LMDB index at {self.path}: {e}") from e
        self._config_db = dbs["config"]
        self._ext2iid = dbs["ext2iid"]
        self._iid2ext = dbs["iid2ext"]
        self._counters = dbs["counters"]
        self._buckets = dbs["buckets"]
        self._fields = {f: dbs[f] for f in FIELDS}

    # --- plumbing ----------------------------------------------------------------
    def _live_env(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise StoreUnavailable(f"LMDB store at {self.path} is closed")
        if os.getpid() != self._pid:
            raise StoreError(
                f"LMDB store at {self.path} was opened in process {self._pid}; "
                "open a new LmdbStore in each process (never share one across fork)"
            )
        return env

    def _wrap(self, e: lmdb.Error) -> StoreError:
        """Translate an LMDB error into the store's exception vocabulary."""
        if isinstance(e, lmdb.MapFullError):
            return StoreError(
                f"LMDB map full at {self.path} (map_size={self._map_size} bytes): "
                "the write was rolled back; reopen with a larger map_size"
            )
        if isinstance(e, lmdb.ReadersFullError):
            return StoreUnavailable(
                f"LMDB reader table full at {self.path}: raise max_readers "
                "(it must cover workers × threads of every process)"
            )
        if isinstance(e, lmdb.ReadonlyError):
            return StoreError(f"LMDB store at {self.path} is read-only: {e}")
        if isinstance(e, lmdb.BadValsizeError):
            return StoreError(f"LMDB rejected a key or value size at {self.path}: {e}")
        return StoreUnavailable(f"LMDB store at {self.path} is unusable: {e}")

    @contextmanager
    def _txn(self, write: bool = False) -> Iterator[lmdb.Transaction]:
        """A fresh transaction per call: committed on success, aborted on error."""
        env = self._live_env()
        try:
            with env.begin(write=write, buffers=False) as txn:
                yield txn
        except lmdb.Error as e:
            raise self._wrap(e) from e

    @staticmethod
    def _get_u64(txn: lmdb.Transaction, db, key: bytes) -> int:
        raw = txn.get(key, db=db)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def _field_db(self, field: str):
        try:
            return self._fields[field]
        except KeyError:
            raise ValueError(f"field: unknown blob field {field!r}; one of {FIELDS}") from None

    def _ext_key(self, ext_id: str) -> bytes:
        key = ext_id.encode("utf-8")
        if not key or len(key) > self._key_max:
            raise ValueError(f"id: {ext_id[:40]!r} must be 1..{self._key_max} bytes of UTF-8 (LMDB key limit)")
        return key

    # --- configuration -------------------------------------------------------------
    def read_config(self) -> dict | None:
        """The stored index configuration, or None for a new (empty) store."""
        with self._txn() as txn:
            raw = txn.get(_CONFIG_KEY, db=self._config_db)
        return json.loads(raw) if raw is not None else None

    def init_config(self, config: dict) -> dict:
        """Store ``config`` if none is stored yet; return what is stored.

        Check-and-set happens inside one write transaction, so two processes
        initialising at once agree on one config. The returned dict is what a
        later :meth:`read_config` gives (it went through JSON).
        """
        stored = self.read_config()  # read-only fast path: no writer lock when it exists
        if stored is not None:
            return stored
        if self.readonly:
            raise StoreError(f"LMDB store at {self.path} is read-only and holds no config")
        raw = json.dumps(config, sort_keys=True).encode()
        with self._txn(write=True) as txn:
            if not txn.put(_CONFIG_KEY, raw, db=self._config_db, overwrite=False):
                raw = txn.get(_CONFIG_KEY, db=self._config_db)
        return json.loads(raw)

    # --- writes --------------------------------------------------------------------
    def upsert(self, batch: RecordBatch, band_keys_of: BandKeysFn) -> None:
        """Insert or replace every record of the batch in ONE write transaction.

        Every written record gets a fresh iid; a replaced id's old iid is retired
        (bucket entries found from its stored sketch via one vectorised
        ``band_keys_of`` call, blobs, reverse id) in the same transaction. So an
        iid's blobs never change and readers may cache them; no reader ever sees
        a mix. Within the batch the last occurrence of an id wins.
        """
        n = len(batch)
        batch.check()
        if n == 0:
            return
        last: dict[str, int] = {}
        for i, ext_id in enumerate(batch.ids):
            last[ext_id] = i
        rows = np.fromiter(sorted(last.values()), dtype=np.int64, count=len(last))
        m = len(rows)

        # Everything that does not depend on the stored state is prepared outside
        # the write transaction, to hold the cross-process writer lock briefly.
        ext_keys = [self._ext_key(batch.ids[i]) for i in rows]
        vectors = [batch.vectors[i] for i in rows]
        sketches = _rows_as_bytes(np.asarray(batch.sketches)[rows])
        band_keys = np.ascontiguousarray(np.asarray(batch.band_keys)[rows])
        n_bands, key_len = band_keys.shape[1], band_keys.shape[2]
        flat_keys = band_keys.reshape(m * n_bands, key_len)
        # Insert bucket entries in key order: far fewer B-tree pages get dirtied.
        order = np.lexsort(flat_keys.T[::-1])
        sorted_keys = flat_keys[order]
        bucket_rows = order // n_bands
        nrff = None
        if batch.has_nrff:
            nrff = _rows_as_bytes(np.asarray(batch.nrff, dtype=np.float32)[rows])
        meta = [batch.meta[i] for i in rows] if batch.meta is not None else [None] * m

        with self._txn(write=True) as txn:
            found = txn.cursor(db=self._ext2iid).getmulti(ext_keys)
            next_iid = self._get_u64(txn, self._counters, _NEXT_IID)
            live = self._get_u64(txn, self._counters, _LIVE)
            if next_iid + m > _IID_LIMIT:
                raise StoreError(f"LMDB store at {self.path}: internal id space (uint32) exhausted")
            if found:  # retire the replaced versions: buckets, blobs, reverse id
                self._retire(txn, [raw for _, raw in found], band_keys_of)
            iids = np.arange(next_iid, next_iid + m, dtype=np.int64)
            be = _be_keys(iids)
            txn.cursor(db=self._ext2iid).putmulti(sorted(zip(ext_keys, be, strict=True)))
            # Fresh iids exceed every stored one: MDB_APPEND writes them in order
            # into completely filled pages.
            self._append(txn, self._iid2ext, be, ext_keys)
            self._append(txn, self._fields["vector"], be, vectors)
            self._append(txn, self._fields["sketch"], be, sketches)
            if nrff is not None:
                self._append(txn, self._fields["nrff"], be, nrff)
            self._append(txn, self._fields["meta"], be, meta)
            # Streamed in bounded chunks: a big build batch must not become
            # millions of Python tuples at once.
            bucket_vals = iids.astype(_NATIVE_U4)[bucket_rows][:, None]
            cur = txn.cursor(db=self._buckets)
            for s in range(0, len(sorted_keys), _PUT_CHUNK):
                chunk = zip(
                    _rows_as_bytes(sorted_keys[s : s + _PUT_CHUNK]),
                    _rows_as_bytes(bucket_vals[s : s + _PUT_CHUNK]),
                    strict=True,
                )
                cur.putmulti(chunk, dupdata=False)
            txn.put(_NEXT_IID, _U64.pack(next_iid + m), db=self._counters)
            txn.put(_LIVE, _U64.pack(live + m - len(found)), db=self._counters)

    def _append(self, txn: lmdb.Transaction, db, be: list[bytes], blobs: Sequence[bytes | None]) -> None:
        """Append blobs under fresh (increasing) iids, skipping None."""
        items = [(k, bytes(b)) for k, b in zip(be, blobs, strict=True) if b is not None]
        if not items:
            return
        consumed, added = txn.cursor(db=db).putmulti(items, append=True)
        if added != consumed:
            raise StoreError(f"LMDB store at {self.path} is inconsistent: the next-iid counter is below a stored iid")

    def _retire(self, txn: lmdb.Transaction, be: list[bytes], band_keys_of: BandKeysFn) -> None:
        """Remove stored iids (big-endian keys) everywhere but ``ext2iid``.

        Their bucket entries are found from their stored sketches with one
        vectorised ``band_keys_of`` call.
        """
        got = dict(txn.cursor(db=self._fields["sketch"]).getmulti(be))
        missing = [int.from_bytes(k, "big") for k in be if k not in got]
        if missing:
            raise StoreError(f"LMDB store at {self.path} is inconsistent: iids {missing[:5]} have no sketch")
        old = np.stack([np.frombuffer(got[k], dtype=np.uint8) for k in be])
        keys = np.asarray(band_keys_of(old))
        if keys.ndim != 3 or keys.shape[0] != len(be):
            raise ValueError(f"band_keys_of returned shape {keys.shape} for {len(be)} sketches")
        flat = keys.reshape(-1, keys.shape[2]).astype(np.uint8, copy=False)
        order = np.lexsort(flat.T[::-1])  # key order: each B-tree page is visited once
        vals = _iids_of_keys(be).astype(_NATIVE_U4)[order // keys.shape[1]][:, None]
        delete, buckets = txn.delete, self._buckets
        for key, val in zip(_rows_as_bytes(flat[order]), _rows_as_bytes(vals), strict=True):
            delete(key, val, db=buckets)
        for k in be:
            txn.delete(k, db=self._iid2ext)
            for db in self._fields.values():
                txn.delete(k, db=db)

    def delete(self, ids: Sequence[str], band_keys_of: BandKeysFn) -> int:
        """Remove these external ids everywhere in one transaction; returns how many existed."""
        keys = []
        for ext_id in dict.fromkeys(ids):
            try:
                keys.append(self._ext_key(ext_id))
            except ValueError:
                continue  # cannot be stored, so it does not exist
        if not keys:
            return 0
        with self._txn(write=True) as txn:
            found = txn.cursor(db=self._ext2iid).getmulti(keys)
            if not found:
                return 0
            self._retire(txn, [raw for _, raw in found], band_keys_of)
            for ext_key, _ in found:
                txn.delete(ext_key, db=self._ext2iid)
            live = self._get_u64(txn, self._counters, _LIVE)
            txn.put(_LIVE, _U64.pack(live - len(found)), db=self._counters)
        return len(found)

    # --- reads -----------------------------------------------------------------------
    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        """Internal ids (int64) of these external ids; -1 where unknown."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids):
            return out
        keys = [s.encode("utf-8") for s in ids]
        ok = [bool(k) and len(k) <= self._key_max for k in keys]
        query = [k for k, good in zip(keys, ok, strict=True) if good]
        with self._txn() as txn:
            found = txn.cursor(db=self._ext2iid).getmulti(query)
        if not found:
            return out
        if len(found) == len(keys):  # the common case: all present, order kept
            return _iids_of_keys([v for _, v in found])
        d = dict(found)
        for p, k in enumerate(keys):
            v = d.get(k) if ok[p] else None
            if v is not None:
                out[p] = int.from_bytes(v, "big")
        return out

    def _get_by_iid(self, db, iids: np.ndarray) -> list[bytes | None]:
        """One ``getmulti`` over big-endian iid keys; None for absent or out-of-range iids."""
        return self._get_by_iid_from((db,), iids)[0]

    def _get_by_iid_from(self, dbs, iids: np.ndarray, txn: lmdb.Transaction | None = None
                         ) -> list[list[bytes | None]]:
        """:meth:`_get_by_iid` for several databases, read in one transaction (one snapshot):
        ``txn``, or a fresh one."""
        a = np.asarray(iids).ravel()
        if a.size == 0:
            return [[] for _ in dbs]
        a = a.astype(np.int64, copy=False)
        valid = (a >= 0) & (a < _IID_LIMIT)
        all_valid = bool(valid.all())
        keys = _be_keys(a if all_valid else a[valid])
        with self._txn() if txn is None else contextlib.nullcontext(txn) as t:
            founds = [t.cursor(db=db).getmulti(keys) for db in dbs]
        out = []
        for found in founds:
            if len(found) == a.size:
                out.append([v for _, v in found])
                continue
            d = dict(found)
            if all_valid:
                out.append([d.get(k) for k in keys])
                continue
            it = iter(keys)
            out.append([d.get(next(it)) if good else None for good in valid.tolist()])
        return out

    def external_ids(self, iids: np.ndarray) -> list[str | None]:
        """External ids of these internal ids; None where the iid is gone."""
        return decode_names(self._get_by_iid(self._iid2ext, iids))

    def fetch(self, iids: np.ndarray, field: str) -> list[bytes | None]:
        """Blob ``field`` of each iid, in order; None where absent. One C-level call."""
        return self._get_by_iid(self._field_db(field), iids)

    def ids_and_fetch(self, iids: np.ndarray, field: str) -> tuple[list[str | None], list[bytes | None]]:
        """:meth:`external_ids` and :meth:`fetch` together, from one snapshot."""
        names, blobs = self._get_by_iid_from((self._iid2ext, self._field_db(field)), iids)
        return decode_names(names), blobs

    def ids_fetch_and_news(self, iids: np.ndarray, field: str, token: object
                           ) -> tuple[list[str | None], list[bytes | None], bool, int]:
        """:meth:`ids_and_fetch`, whether the iid counter moved past ``token``, and the
        snapshot's transaction id as the epoch: all from one snapshot."""
        with self._txn() as txn:
            names, blobs = self._get_by_iid_from((self._iid2ext, self._field_db(field)), iids, txn)
            bound = self._get_u64(txn, self._counters, _NEXT_IID)
            epoch = txn.id()
        return decode_names(names), blobs, bound > (0 if token is None else int(token)), epoch

    def news_and_epoch(self, token: object) -> tuple[bool, int]:
        """Whether the iid counter moved past ``token``, and the epoch: LMDB's transaction
        id, which grows with every committed write, so with every retirement."""
        with self._txn() as txn:
            return self._get_u64(txn, self._counters, _NEXT_IID) > (0 if token is None else int(token)), txn.id()

    def bucket_members(self, keys: Sequence[bytes] | np.ndarray) -> np.ndarray:
        """Members (uint32) of all these buckets concatenated, one entry per bucket hit.

        ``keys`` may also be a 2-D uint8 array with one band key per row. Missing
        keys contribute nothing. Band keys of one index share one length, so a
        single ``getmulti(keyfixed=True)`` returns packed (key, iid) records that
        numpy slices without a Python loop over members.
        """
        if isinstance(keys, np.ndarray):
            if keys.ndim != 2:
                raise ValueError(f"keys: need a (n, key_bytes) array, got shape {keys.shape}")
            keys = _rows_as_bytes(keys.astype(np.uint8, copy=False))
        if not len(keys):
            return np.empty(0, dtype=np.uint32)
        lengths = set(map(len, keys))
        if len(lengths) == 1:
            (key_len,) = lengths
            groups = [(key_len, keys)] if 0 < key_len <= self._key_max else []
        else:  # not produced by one index; handled for robustness, not speed
            groups = [(n, [k for k in keys if len(k) == n]) for n in sorted(lengths) if 0 < n <= self._key_max]
        env = self._live_env()
        out = []
        try:
            with env.begin(buffers=False) as txn:
                cur = txn.cursor(db=self._buckets)
                for key_len, group in groups:
                    buf = cur.getmulti(group, dupdata=True, dupfixed_bytes=4, keyfixed=True)
                    out.append(_members(buf, key_len))
        except lmdb.Error as e:
            raise self._wrap(e) from e
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else np.empty(0, dtype=np.uint32)

    def scan(self, field: str, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, list[bytes]]]:
        """Every record holding ``field``, in iid order, as (iids int64, blobs) chunks.

        Reads one snapshot (one read transaction held until the generator ends or
        is closed). Records without an optional field (``nrff``/``meta``) are skipped.
        """
        db = self._field_db(field)
        if batch_size < 1:
            raise ValueError(f"batch_size: must be ≥ 1, got {batch_size}")
        with self._snapshot_txn() as txn:
            it = txn.cursor(db=db).iternext(keys=True, values=True)
            while True:
                try:
                    chunk = []
                    for item in it:
                        chunk.append(item)
                        if len(chunk) == batch_size:
                            break
                except lmdb.Error as e:
                    raise self._wrap(e) from e
                if not chunk:
                    return
                yield _iids_of_keys([k for k, _ in chunk]), [v for _, v in chunk]
                if len(chunk) < batch_size:
                    return

    @contextlib.contextmanager
    def _snapshot_txn(self) -> Iterator[lmdb.Transaction]:
        """One read transaction a scan may hold across its yields; always released."""
        env = self._live_env()
        try:
            txn = env.begin(buffers=False)
        except lmdb.Error as e:
            raise self._wrap(e) from e
        try:
            yield txn
        finally:
            try:
                txn.abort()
            except lmdb.Error:
                pass  # the environment was closed under us: nothing left to release

    def scan_buckets(self, chunk: int = 1024) -> Iterator[tuple[bytes, np.ndarray]]:
        """Every bucket as (band key, member iids uint32), in key order, from one snapshot."""
        with self._snapshot_txn() as txn:
            keys_it = txn.cursor(db=self._buckets).iternext_nodup(keys=True, values=False)
            reader = txn.cursor(db=self._buckets)
            while True:
                try:
                    batch: list[bytes] = []
                    for key in keys_it:
                        batch.append(key)
                        if len(batch) == chunk:
                            break
                    parts = []
                    for key_len in sorted(set(map(len, batch))):
                        group = [k for k in batch if len(k) == key_len]
                        buf = reader.getmulti(group, dupdata=True, dupfixed_bytes=4, keyfixed=True)
                        parts.append((key_len, group, buf))
                except lmdb.Error as e:
                    raise self._wrap(e) from e
                for key_len, group, buf in parts:
                    rec = _records(buf, key_len)
                    kb = rec["key"]
                    cuts = np.flatnonzero(kb[1:] != kb[:-1]) + 1
                    starts = np.concatenate(([0], cuts))
                    ends = np.concatenate((cuts, [len(rec)]))
                    vals = np.ascontiguousarray(rec["iid"])
                    for key, s, e in zip(group, starts.tolist(), ends.tolist(), strict=True):
                        yield key, vals[s:e].copy()
                if len(batch) < chunk:
                    return

    def count(self) -> int:
        """Number of live vectors (exact: maintained inside every write transaction)."""
        with self._txn() as txn:
            return self._get_u64(txn, self._counters, _LIVE)

    def iid_bound(self) -> int:
        """An exclusive upper bound on every live iid (the next iid to be allocated)."""
        with self._txn() as txn:
            return self._get_u64(txn, self._counters, _NEXT_IID)

    def allocated_since(self, token: object | None) -> tuple[np.ndarray, object]:
        """iids allocated since ``token`` (the counter then): one range, LMDB allocates in order."""
        bound = self.iid_bound()
        start = 0 if token is None else int(token)
        return np.arange(start, max(start, bound), dtype=np.int64), bound

    # --- housekeeping --------------------------------------------------------------------
    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` if the environment is closed or unreadable."""
        if not (self.path / "data.mdb").exists():
            raise StoreUnavailable(f"LMDB data file {self.path / 'data.mdb'} has vanished")
        with self._txn() as txn:
            txn.get(_LIVE, db=self._counters)

    def info(self) -> dict:
        """Backend facts for /stats and ``gmmlsh info``.

        ``bytes`` is the data file's size on disk, ``entries`` the number of
        key/value entries over all named databases (bucket entries included),
        ``vectors`` the live count.
        """
        env = self._live_env()
        try:
            with env.begin() as txn:
                per_db = {name: txn.stat(db)["entries"] for name, db in self._all_dbs().items()}
                live = self._get_u64(txn, self._counters, _LIVE)
            map_size = env.info()["map_size"]
            max_readers = env.max_readers()
        except lmdb.Error as e:
            raise self._wrap(e) from e
        try:
            size = (self.path / "data.mdb").stat().st_size
        except OSError:
            size = None
        return {
            "kind": "lmdb",
            "path": str(self.path),
            "bytes": size,
            "map_size": map_size,
            "entries": sum(per_db.values()),
            "vectors": live,
            "bucket_entries": per_db["buckets"],
            "max_readers": max_readers,
            "readonly": self.readonly,
        }

    def scan_ids(self, batch_size: int = 4096) -> Iterator[tuple[list[str], np.ndarray]]:
        """Every (external id, iid) of the id map, from one snapshot: for the integrity check,
        which must also find ids whose vector is gone (a scan of vectors cannot)."""
        with self._snapshot_txn() as txn:
            it = txn.cursor(db=self._ext2iid).iternext(keys=True, values=True)
            while True:
                try:
                    chunk = [item for _, item in zip(range(batch_size), it, strict=False)]
                except lmdb.Error as e:
                    raise self._wrap(e) from e
                if not chunk:
                    return
                names = [k.decode("utf-8", errors="replace") for k, _ in chunk]
                iids = np.array([int.from_bytes(v, "big") if len(v) == 4 else -1 for _, v in chunk], dtype=np.int64)
                yield names, iids

    def snapshot(self, dest: str | os.PathLike) -> Path:
        """A consistent hot copy of the environment in the new directory ``dest``.

        Runs in one read transaction, so writers (in any process) go on meanwhile
        and the copy holds exactly the batches committed when it started. Written
        to a hidden sibling directory first and renamed into place, so ``dest``
        either does not exist or holds a complete index. Restore: stop the
        server, then serve (or move) ``dest`` as the index directory.

        Not LMDB's compacting copy (``MDB_CP_COMPACT``): with the bundled LMDB it
        segfaults on our large ``dupsort`` bucket database (reproduced at 60,000
        vectors, with or without concurrent writers). The plain copy keeps free
        pages, so the copy is as large as ``data.mdb``'s used part.
        """
        dest = Path(dest)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise StoreError(f"snapshot destination {dest} exists and is not an empty directory")
        env = self._live_env()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
        if tmp.exists():
            for f in tmp.iterdir():
                f.unlink()
        else:
            tmp.mkdir()
        try:
            env.copy(str(tmp), compact=False)
            fd = os.open(tmp / "data.mdb", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if dest.exists():
                dest.rmdir()
            os.rename(tmp, dest)
        except lmdb.Error as e:
            raise self._wrap(e) from e
        finally:
            if tmp.exists():
                for f in tmp.iterdir():
                    f.unlink()
                tmp.rmdir()
        return dest

    def _all_dbs(self) -> dict:
        return {
            "config": self._config_db,
            "ext2iid": self._ext2iid,
            "iid2ext": self._iid2ext,
            "counters": self._counters,
            "buckets": self._buckets,
            **self._fields,
        }

    def close(self) -> None:
        """Close the environment (idempotent). In a forked child it only drops the reference."""
        with self._close_lock:
            env, self._env = self._env, None
        if env is not None and os.getpid() == self._pid:
            env.close()

    def __enter__(self) -> LmdbStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._env is None else ("ro" if self.readonly else "rw")
        return f"LmdbStore({str(self.path)!r}, {state})"
