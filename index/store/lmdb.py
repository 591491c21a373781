"""The embedded LMDB backend (the default): one directory, ACID batches, many reader processes.

Named databases of one environment:

* ``config`` — ``b"config"`` → JSON of the index configuration.
* ``ext2iid`` — external id (UTF-8) → iid (4 bytes, big-endian).
* ``record`` — iid (4 bytes, big-endian) → the record's fields in one value:
  their five lengths (``<u4`` each, in :data:`FIELDS` order; ``0xFFFFFFFF`` for a
  field not stored), then their bytes. Big-endian keys make LMDB's byte order the
  numeric order: cursors walk records in iid order, and fresh iids (always the
  largest) are appended into full pages (``MDB_APPEND``). One value per record
  keeps a retirement to one page of this tree: a replaced or deleted record sits
  anywhere in it, and a commit writes (and syncs) every page it touched.
* ``counters`` — ``b"state"`` → next iid, live count and retirements so far (3 × u64).
* ``retired`` — retirement number (8 bytes, big-endian) → the retired iid: the
  feed's second half (its first half is the iid counter: iids are handed out in order).

A write is one transaction, so readers see whole batches; the state key moves
with every write, so :meth:`LmdbStore.token` is one ``get`` (none while no commit happened).

Processes and threads: an environment must be opened **in each process** (after
fork, e.g. in the uvicorn lifespan) and never inherited; the store refuses use
from another process than its opener. ``max_spare_txns=0`` keeps no reader slot a
fork could duplicate, ``reader_check()`` at open frees slots of SIGKILLed
processes, and ``map_size`` is set once, generously (concurrent resizes from
several processes corrupt databases). Write transactions are short: records are
encoded before the writer lock is taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np

from gmmlsh.index.store.base import (
    FIELDS,
    IID_LIMIT,
    Changes,
    DiskFull,
    RecordBatch,
    StoreError,
    StoreUnavailable,
    Token,
    Written,
)

_CONFIG_KEY = b"config"
_STATE_KEY = b"state"
_STATE = struct.Struct("<QQQ")  # next iid, live count, retirements
_BE_U4 = np.dtype(">u4")
_BE_U8 = np.dtype(">u8")
_LENGTHS = struct.Struct(f"<{len(FIELDS)}I")
_ABSENT = 0xFFFFFFFF
#: Free bytes under which a failed write is put down to a full disk.
_FULL_BELOW = 16 << 20
#: Free bytes under which (or above a refusal's by less than which) the disk counts as full.
_NO_ROOM = 1 << 20


def _be_keys(iids: np.ndarray) -> list[bytes]:
    """4-byte big-endian keys of iids (already range-checked), built in C."""
    return np.ascontiguousarray(iids, dtype=_BE_U4).view("V4").tolist()


def _iids_of_keys(keys: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype=_BE_U4).astype(np.int64)


def pack_record(fields: dict[str, bytes | None]) -> bytes:
    """A record's value: the lengths of its :data:`FIELDS` (absent: ``0xFFFFFFFF``), then their bytes."""
    parts = [fields.get(f) for f in FIELDS]
    head = _LENGTHS.pack(*(_ABSENT if b is None else len(b) for b in parts))
    return head + b"".join(b for b in parts if b is not None)


def unpack_record(raw: bytes | None) -> dict[str, bytes | None]:
    """:func:`pack_record` undone (None: no record, every field absent)."""
    if raw is None:
        return dict.fromkeys(FIELDS)
    out: dict[str, bytes | None] = {}
    at = _LENGTHS.size
    for f, size in zip(FIELDS, _LENGTHS.unpack_from(raw), strict=True):
        if size == _ABSENT:
            out[f] = None
        else:
            out[f] = raw[at:at + size]
            at += size
    return out


class LmdbStore:
    """LMDB implementation of :class:`gmmlsh.index.store.base.Store`.

    ``map_size``: the most the data file may grow to (address space only: 1 TiB
    costs nothing on 64-bit). ``max_readers``: concurrent read transactions over
    *all* processes (workers × threads; set by the first process to open).
    ``readonly`` opens an existing index for reading only.
    """

    kind = "lmdb"
    local = True

    def __init__(self, path: str | os.PathLike, *, map_size: int = 1 << 40, max_readers: int = 1024,
                 readonly: bool = False) -> None:
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
            env = lmdb.open(str(self.path), map_size=self._map_size, subdir=True, readonly=readonly,
                            max_readers=max_readers, max_dbs=16, max_spare_txns=0, create=not readonly)
        except lmdb.Error as e:
            if "already open" in str(e):
                raise StoreError(f"LMDB environment {self.path} is already open in this process; "
                                 "share that store instead of opening a second one") from e
            raise StoreUnavailable(f"cannot open LMDB index at {self.path}: {e}") from e
        try:
            #: Reader slots of dead processes freed at open (SIGKILLed workers leave them).
            self.stale_readers_cleared: int = env.reader_check()
            self._open_dbs(env)
        except BaseException:
            env.close()
            raise
        self._pid = os.getpid()
        self._refused_at: int | None = None  # free bytes when a write was last refused for a full disk
        self._token_seen: tuple[int, Token] | None = None  # (transaction id, token read in it)
        self._env = env

    def _open_dbs(self, env: lmdb.Environment) -> None:
        names = ("config", "ext2iid", "counters", "retired", "record")
        try:
            if self.readonly:
                dbs = {n: env.open_db(n.encode(), create=False) for n in names}
            else:
                with env.begin(write=True) as txn:
                    dbs = {n: env.open_db(n.encode(), txn=txn, create=True) for n in names}
        except lmdb.NotFoundError as e:
            raise StoreError(f"{self.path} holds no gmmlsh index of this release: {e}") from e
        except lmdb.Error as e:
            raise StoreUnavailable(f"cannot open LMDB index at {self.path}: {e}") from e
        self._db = dbs

    # --- plumbing ----------------------------------------------------------------------
    def _live_env(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise StoreUnavailable(f"LMDB store at {self.path} is closed")
        if os.getpid() != self._pid:
            raise StoreError(f"LMDB store at {self.path} was opened in process {self._pid}; "
                             "open a new store in each process (never share one across fork)")
        return env

    def _wrap(self, e: lmdb.Error) -> StoreError:
        """An LMDB error in the store's vocabulary (a full disk reads as an I/O error from LMDB)."""
        free = self._free_bytes()
        if free is not None and free < _FULL_BELOW:
            self._refused_at = free  # write_problem() reports the disk full until it gains room
            return DiskFull(f"no space left on the disk of the LMDB index at {self.path}: the write was "
                            "rolled back; free space and retry")
        if isinstance(e, lmdb.MapFullError):
            return StoreError(f"LMDB map full at {self.path} (map_size={self._map_size} bytes): "
                              "the write was rolled back; reopen with a larger map_size")
        if isinstance(e, lmdb.ReadersFullError):
            return StoreUnavailable(f"LMDB reader table full at {self.path}: raise max_readers "
                                    "(it must cover workers × threads of every process)")
        if isinstance(e, lmdb.ReadonlyError):
            return StoreError(f"LMDB store at {self.path} is read-only: {e}")
        return StoreUnavailable(f"LMDB store at {self.path} is unusable: {e}")

    def write_problem(self) -> str | None:
        """A full disk: almost no free space, or no more than when this process's last write
        was refused for want of it (cleared by the next write that succeeds)."""
        free = self._free_bytes()
        refused = self._refused_at is not None and free is not None and free < self._refused_at + _NO_ROOM
        if refused or (free is not None and free < _NO_ROOM):
            return (f"no space left on the disk of the LMDB index at {self.path}: writes are refused until "
                    "space is freed")
        return None

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


    @contextlib.contextmanager
    def _txn(self, write: bool = False) -> Iterator[lmdb.Transaction]:
        """A fresh transaction: committed on success, aborted on error."""
        env = self._live_env()
        try:
            with env.begin(write=write) as txn:
                yield txn
        except lmdb.Error as e:
            raise self._wrap(e) from e
        if write:
            self._refused_at = None

    def _state(self, txn: lmdb.Transaction) -> tuple[int, int, int]:
        raw = txn.get(_STATE_KEY, db=self._db["counters"])
        return _STATE.unpack(raw) if raw is not None else (0, 0, 0)

    # --- configuration -------------------------------------------------------------------
    def read_config(self) -> dict | None:
        with self._txn() as txn:
            raw = txn.get(_CONFIG_KEY, db=self._db["config"])
        return json.loads(raw) if raw is not None else None

    def init_config(self, config: dict) -> dict:
        """Check-and-set inside one write transaction, so two processes agree on one config."""
        stored = self.read_config()  # no writer lock when it exists
        if stored is not None:
            return stored
        if self.readonly:
            raise StoreError(f"LMDB store at {self.path} is read-only and holds no config")
        raw = json.dumps(config, sort_keys=True).encode()
        with self._txn(write=True) as txn:
            if not txn.put(_CONFIG_KEY, raw, db=self._db["config"], overwrite=False):
                raw = txn.get(_CONFIG_KEY, db=self._db["config"])
        return json.loads(raw)

    # --- writes -----------------------------------------------------------------------
    def write(self, batch: RecordBatch) -> Written:
        """Insert or replace the batch's records in one write transaction; the last row of an id
        is stored under the next iid, in the batch's order (:attr:`Written.iids`)."""
        rows = batch.last_rows()
        m = rows.shape[0]
        if m == 0:
            return Written(0, 0)
        stored = [batch.stored(i) for i in rows.tolist()]
        names = [rec["name"] for rec in stored]
        records = [pack_record(rec) for rec in stored]
        with self._txn(write=True) as txn:
            next_iid, live, retired = self._state(txn)
            if next_iid + m > IID_LIMIT:
                raise StoreError(f"LMDB store at {self.path}: internal id space (uint32) exhausted")
            old = [raw for _, raw in txn.cursor(db=self._db["ext2iid"]).getmulti(names)]
            retired = self._retire(txn, old, retired)
            keys = _be_keys(np.arange(next_iid, next_iid + m))
            txn.cursor(db=self._db["ext2iid"]).putmulti(sorted(zip(names, keys, strict=True)))
            consumed, added = txn.cursor(db=self._db["record"]).putmulti(zip(keys, records, strict=True), append=True)
            if added != consumed:
                raise StoreError(f"LMDB store at {self.path} is inconsistent: a stored iid is past the counter")
            txn.put(_STATE_KEY, _STATE.pack(next_iid + m, live + m - len(old), retired), db=self._db["counters"])
        iids = np.full(len(batch), -1, dtype=np.int64)
        iids[rows] = np.arange(next_iid, next_iid + m)
        return Written(m, len(old), iids)

    def _retire(self, txn: lmdb.Transaction, iid_keys: list[bytes], retired: int) -> int:
        """Remove these records and log them on the feed; returns the new retirement count."""
        for k in iid_keys:
            txn.delete(k, db=self._db["record"])
            txn.put(struct.pack(">Q", retired), k, db=self._db["retired"], append=True)
            retired += 1
        return retired

    def delete(self, ids: Sequence[str], expect: np.ndarray | None = None) -> int:
        want = dict(zip(ids, _be_keys(expect) if expect is not None else [None] * len(ids), strict=True))
        keys = [e.encode("utf-8") for e in want]
        if not keys:
            return 0
        with self._txn(write=True) as txn:
            found = txn.cursor(db=self._db["ext2iid"]).getmulti(keys)
            if expect is not None:
                found = [(k, raw) for k, raw in found if want[k.decode("utf-8")] == raw]
            if not found:
                return 0
            next_iid, live, retired = self._state(txn)
            retired = self._retire(txn, [raw for _, raw in found], retired)
            for ext_key, _ in found:
                txn.delete(ext_key, db=self._db["ext2iid"])
            txn.put(_STATE_KEY, _STATE.pack(next_iid, live - len(found), retired), db=self._db["counters"])
        return len(found)

    # --- reads --------------------------------------------------------------------------
    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        out = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids):
            return out
        keys = [s.encode("utf-8") for s in ids]
        with self._txn() as txn:
            found = dict(txn.cursor(db=self._db["ext2iid"]).getmulti(keys))
        for p, k in enumerate(keys):
            v = found.get(k)
            if v is not None:
                out[p] = int.from_bytes(v, "big")
        return out

    def read(self, iids: np.ndarray, fields: Sequence[str]) -> dict[str, list[bytes | None]]:
        a = np.asarray(iids, dtype=np.int64).ravel()
        valid = (a >= 0) & (a < IID_LIMIT)
        keys = _be_keys(a[valid])
        with self._txn() as txn:
            found = txn.cursor(db=self._db["record"]).getmulti(keys)
        if len(found) == a.shape[0]:
            records = [unpack_record(v) for _, v in found]
        else:
            got = dict(found)
            it = iter(keys)
            records = [unpack_record(got.get(next(it)) if ok else None) for ok in valid.tolist()]
        return {f: [rec[f] for rec in records] for f in fields}

    def token(self) -> Token:
        """Where the feed stands: the token last read, while the environment's last transaction
        id shows no commit since (any process's commit moves it: one look at the meta page), else
        one ``get`` — a query asks for it every time, and nearly always nothing changed."""
        env = self._live_env()
        seen = self._token_seen
        if seen is not None and env.info()["last_txnid"] == seen[0]:
            return seen[1]
        with self._txn() as txn:
            next_iid, _, retired = self._state(txn)
            self._token_seen = (txn.id(), (next_iid, retired))
        return (next_iid, retired)

    def token_later(self) -> Callable[[], Token]:
        now = self.token()  # a local read: nothing to overlap
        return lambda: now

    def changes(self, since: Token | None) -> Changes:
        with self._txn() as txn:
            next_iid, _, retired = self._state(txn)
            start, retired_from = (0, retired) if since is None else since
            gone: list[bytes] = []
            if retired_from < retired:
                cur = txn.cursor(db=self._db["retired"])
                if cur.set_key(struct.pack(">Q", retired_from)):
                    for _, v in cur:
                        gone.append(v)
        return Changes(added=np.arange(start, max(start, next_iid), dtype=np.int64),
                       retired=_iids_of_keys(gone), token=(next_iid, retired))

    def scan(self, fields: Sequence[str], batch_size: int = 4096
             ) -> Iterator[tuple[np.ndarray, dict[str, list[bytes | None]]]]:
        """Every iid holding any of ``fields``, in iid order, from one snapshot."""
        if batch_size < 1:
            raise ValueError(f"batch_size: must be ≥ 1, got {batch_size}")
        with self._snapshot_txn() as txn:
            it = txn.cursor(db=self._db["record"]).iternext()
            while True:
                iids: list[int] = []
                cols: dict[str, list[bytes | None]] = {f: [] for f in fields}
                for key, raw in it:
                    rec = unpack_record(raw)
                    if all(rec[f] is None for f in fields):
                        continue
                    iids.append(int.from_bytes(key, "big"))
                    for f in fields:
                        cols[f].append(rec[f])
                    if len(iids) == batch_size:
                        break
                if not iids:
                    return
                yield np.array(iids, dtype=np.int64), cols

    def scan_ids(self, batch_size: int = 4096) -> Iterator[tuple[list[str], np.ndarray]]:
        with self._snapshot_txn() as txn:
            it = txn.cursor(db=self._db["ext2iid"]).iternext()
            while True:
                chunk = [item for _, item in zip(range(batch_size), it, strict=False)]
                if not chunk:
                    return
                yield ([k.decode("utf-8", errors="replace") for k, _ in chunk],
                       np.array([int.from_bytes(v, "big") if len(v) == 4 else -1 for _, v in chunk], dtype=np.int64))

    @contextlib.contextmanager
    def _snapshot_txn(self) -> Iterator[lmdb.Transaction]:
        """One read transaction a scan may hold across its yields; always released."""
        env = self._live_env()
        try:
            txn = env.begin()
        except lmdb.Error as e:
            raise self._wrap(e) from e
        try:
            yield txn
        except lmdb.Error as e:
            raise self._wrap(e) from e
        finally:
            with contextlib.suppress(lmdb.Error):
                txn.abort()

    def count(self) -> int:
        with self._txn() as txn:
            return self._state(txn)[1]

    # --- housekeeping -----------------------------------------------------------------------
    def ping(self) -> None:
        if not (self.path / "data.mdb").exists():
            raise StoreUnavailable(f"LMDB data file {self.path / 'data.mdb'} has vanished")
        self.count()  # a real read, not the token's cached one

    def info(self) -> dict:
        env = self._live_env()
        try:
            with env.begin() as txn:
                entries = {name: txn.stat(db)["entries"] for name, db in self._db.items()}
                next_iid, live, retired = self._state(txn)
            map_size, max_readers = env.info()["map_size"], env.max_readers()
        except lmdb.Error as e:
            raise self._wrap(e) from e
        try:
            size = (self.path / "data.mdb").stat().st_size
        except OSError:
            size = None
        return {"kind": "lmdb", "path": str(self.path), "bytes": size, "map_size": map_size,
                "vectors": live, "iids_handed_out": next_iid, "retired": retired,
                "entries": sum(entries.values()), "max_readers": max_readers, "readonly": self.readonly}

    def snapshot(self, dest: str | os.PathLike) -> Path:
        """A consistent hot copy of the environment in the new directory ``dest``.

        One read transaction: writers go on, and the copy holds exactly the batches
        committed when it started. Written to a hidden sibling and renamed, so
        ``dest`` is complete or absent. (Not LMDB's compacting copy: the plain copy
        keeps free pages.)
        """
        dest = Path(dest)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise StoreError(f"snapshot destination {dest} exists and is not an empty directory")
        env = self._live_env()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
        tmp.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            f.unlink()
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
