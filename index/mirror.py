"""The search mirror: everything a query reads, memory-mapped, once per machine.

The store (LMDB or Redis) is the truth; the mirror is a copy laid out for search and
derived from it, so it can always be rebuilt. It lives in a directory — inside an LMDB
index, or in a cache directory for a Redis one — shared by every process of the machine:
its columns (:mod:`gmmlsh.index.columns`) are memory-mapped, so a second worker adds no
second copy.

A mirror *row* is one stored vector, numbered in the order the mirror learned of it:
row-indexed columns hold its iid, a live flag, the L1 norm (float64, and float32 for
ranking) and payload of the vector as GMM sees it (centred, if the index has a centre), the
bit planes of its sketch and its first-stage row (:mod:`gmmlsh.core.ivf`), its name and
metadata, its NRFF features, and a coarse copy of its vector (one int8 level a value,
:mod:`gmmlsh.core.coarse`); an iid-indexed column maps iids back to rows. Inverted lists
over the rows come in *segments* (:mod:`gmmlsh.index.segments`); rows after the last
segment form the *tail*, which a query scans whole.

**State.** ``state.json`` says what a reader may use: the store's feed token the rows are
current at, the row count, the fit of the lists and its segments, the tuned search. It is
written aside and renamed, under the directory's ``sync`` lock, which is only ever held for
short work: applying the store's changes, publishing a segment or a tuning, reserving room
in the arenas. Upkeep (building segments, re-fitting, tuning) takes its own locks and works
beside the queries, so a query never waits for it.

Keeping up: a process that finds the store's token moved takes the ``sync`` lock, applies
:meth:`Store.changes` (reads the added records, appends them as new rows; an added record a
later write retired meanwhile sends it round again for that write) and publishes a new state,
which names the rows it retires; then it clears their live flags. Each view holds its
own copy of the flags as of its state (:meth:`Mirror._load`), so a query never sees a replaced
id in neither row, nor in both. A crash of the process before the rename leaves rows past the
published count that the next sync overwrites; one after it leaves flags to clear, which the
next holder of the lock clears.

**Durability.** A query never waits for the disk: nothing on its path is fsynced (at 2,000
writes a second the fsyncs of each sync, queued behind upkeep's, made the syncs a query waits
for take 95 ms at the median and seconds at worst). What a killed process wrote is in the page
cache and stays; only a crash of the machine loses it. So the state names the boot it was
written in, and upkeep *checkpoints* now and then (:meth:`Mirror.checkpoint`: every file
fsynced, then a copy of the state as ``durable.json``); a state from an earlier boot is
replaced by the last checkpoint, and what came after it is read from the store again.

A mirror made for another index (its ``uid``), by another format, or ahead of its store (a
restored backup) is discarded and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gmmlsh import CACHE_DIR
from gmmlsh.core.bundles import Lists, Postings, Rows, frozen
from gmmlsh.core.coarse import coarse_encode, coarse_sizes
from gmmlsh.core.codes import bit_planes, plane_words, unpack_codes
from gmmlsh.core.ivf import FIRST_WORDS, first_rows
from gmmlsh.index import segments
from gmmlsh.index.columns import Blobs, Column, gather, make_durable, populate
from gmmlsh.index.config import RANK_BITS_MAX, IndexConfig, SearchParams
from gmmlsh.index.locks import DirectoryLocks
from gmmlsh.index.records import stored_payloads
from gmmlsh.index.segments import Arenas, Fit
from gmmlsh.index.store.base import RecordBatch, Store, read_through
from gmmlsh.index.store.location import is_redis

#: Rounds of the store's changes one sync applies while the records it reads keep turning out
#: retired by later writes (each round takes in those writes; see :meth:`Mirror._follow`).
_FOLLOW_ROUNDS = 8

#: Where mirrors of Redis indexes live unless ``cache_dir`` says otherwise.
DEFAULT_CACHE_DIR = CACHE_DIR


def mirror_dir(location, prefix: str, uid: str, cache_dir: str | os.PathLike | None = None,
               group: tuple[int, int] | None = None) -> Path:
    """Where the search mirror of an index lives on this machine: inside an LMDB index's
    directory; for a Redis one, under ``cache_dir``, named by its URL, prefix and uid, and by
    its group of id-shards (``-g{g}of{G}``) on a search node that follows one."""
    loc = str(location)
    if not is_redis(loc):
        return Path(loc) / "mirror"
    tag = hashlib.sha256(f"{loc}|{prefix}|{uid}".encode()).hexdigest()[:16]
    suffix = f"-g{group[0]}of{group[1]}" if group is not None else ""
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"redis-{prefix}-{tag}{suffix}"

#: Bump when the mirror's files change: an older mirror is rebuilt.
MIRROR_FORMAT = 5
#: Records read from the store per round trip while syncing.
_READ_BATCH = 4096


def _boot_id() -> str:
    """This boot of the machine (Linux), or "": a state from another boot may name data the
    page cache lost."""
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return ""


BOOT = _boot_id()


class Stale(Exception):
    """What an upkeep task built no longer fits the published state (another task moved it)."""


@dataclass(frozen=True)
class View:
    """An immutable snapshot of the mirror for one query: rows ``< rows`` of every column, and
    the bundles the kernels read (:mod:`gmmlsh.core.bundles`)."""

    rows: int
    live: int  # rows that are live
    dim: int
    token: tuple | None
    iid: np.ndarray
    alive: np.ndarray
    norms: np.ndarray
    planes: np.ndarray
    first: np.ndarray
    voff: np.ndarray
    vi: np.ndarray
    vf: np.ndarray
    names: tuple[np.ndarray, np.ndarray]
    meta: tuple[np.ndarray, np.ndarray]
    nrff: np.ndarray | None
    rowof: np.ndarray
    row_bundle: Rows
    lists: Lists
    postings: Postings
    fit: Fit | None
    segments: tuple[dict, ...]
    garbage: int  # values of the fit's arenas no segment uses any more
    search: SearchParams
    tuned_rows: int
    tuned_lists: int
    tuned_on_queries: bool

    def row_of(self, iid: int) -> int:
        """Mirror row of an iid, or −1."""
        r = int(self.rowof[iid]) - 1 if 0 <= iid < self.rowof.shape[0] else -1
        return r if r < self.rows else -1

    def name(self, row: int) -> str:
        return self.names_of([row])[0]

    def metadata(self, row: int) -> bytes | None:
        return self.metadata_of([row])[0]

    def names_of(self, rows: list[int]) -> list[str]:
        return [b.decode("utf-8") for b in gather(*self.names, rows)]

    def metadata_of(self, rows: list[int]) -> list[bytes | None]:
        if not self.meta[1].shape[0]:  # no row holds metadata: nothing to gather
            return [None] * len(rows)
        return [b or None for b in gather(*self.meta, rows)]

    def restricted(self, alive: np.ndarray, live: int) -> View:
        """The view with other live flags (a filter's: live *and* passing): every search of it
        reads only the rows they flag."""
        return replace(self, alive=alive, live=live, row_bundle=self.row_bundle._replace(alive=frozen(alive)))

    def live_rows(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The rows in ``[lo, hi)`` (default: all the view's) live in this view."""
        hi = self.rows if hi is None else hi
        return lo + np.flatnonzero(self.alive[lo:hi])

    @property
    def tail_start(self) -> int:
        """The first row no segment holds."""
        return self.lists.tail_lo

    @property
    def list_count(self) -> int:
        return self.fit.lists if self.fit is not None else 0

    @property
    def postings_search(self) -> bool:
        """Whether the postings search applies: the fit has head columns (most rows are sparse
        and text-like)."""
        return self.fit is not None and self.fit.head_bytes + self.fit.head_nibbles > 0

    @property
    def has_postings(self) -> bool:
        """Whether any segment holds postings (sparse rows)."""
        return any(s["np"] for s in self.segments)


class Mirror:
    """The search mirror of one index in ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, config: IndexConfig):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._state_file = str(self._state_path)  # stat()ed by every query: no Path arithmetic there
        self.config = config
        self.words = plane_words(config.samples)
        self._locks = DirectoryLocks(self.dir)
        self._load_lock = threading.Lock()
        self._arenas: Arenas | None = None
        #: When this process last checkpointed (monotonic), and whether it wrote since.
        self.checkpointed = time.monotonic()
        self.written = False
        self._open_columns()
        self.view: View = self._load()

    def _open_columns(self) -> None:
        config, d = self.config, self.dir
        self._iid = Column(d / "iid.u4", np.uint32)
        self._alive = Column(d / "alive.u1", np.uint8)
        self._norms = Column(d / "norm.f8", np.float64)
        self._norms32 = Column(d / "norm.f4", np.float32)
        self._planes = Column(d / "planes.u8", np.uint64, config.bits * self.words)
        self._first = Column(d / "first.u8", np.uint64, FIRST_WORDS)
        self._nrff = Column(d / "nrff.f4", np.float32, config.nrff_k) if config.nrff_k else None
        self._rowof = Column(d / "rowof.u4", np.uint32)
        self._vectors = Blobs(d, "vectors", np.uint32)
        self._coarse = Blobs(d, "coarse", np.uint8)
        self._names = Blobs(d, "names")
        self._meta = Blobs(d, "meta")
        self._state_stamp: tuple | None = None

    def _columns(self) -> tuple:
        return (self._iid, self._alive, self._norms, self._norms32, self._planes, self._first, self._rowof,
                self._vectors, self._coarse, self._names, self._meta, *((self._nrff,) if self._nrff else ()))

    # --- state ---------------------------------------------------------------------------
    @property
    def _state_path(self) -> Path:
        return self.dir / "state.json"

    def _read_state(self) -> dict:
        state = self._state_in(self._state_path)
        if state is not None and state.get("boot") != BOOT:  # written before the machine restarted
            state = self._state_in(self.dir / "durable.json")
        if state is None:
            return {"format": MIRROR_FORMAT, "uid": self.config.uid, "token": None, "rows": 0, "live": 0,
                    "lists": None, "search": None, "tuned_rows": 0, "tuned_lists": 0, "tuned_on_queries": False}
        return state

    def _state_in(self, path: Path) -> dict | None:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if state.get("format") != MIRROR_FORMAT or state.get("uid") != self.config.uid:
            return None
        return state

    def _write_state(self, state: dict, path: Path | None = None, durable: bool = False) -> None:
        state["boot"] = BOOT
        path = path or self._state_path
        tmp = self.dir / f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def checkpoint(self) -> None:
        """Put everything the state names on disk, then keep a copy of it as the state a restart
        of the machine starts from (see the module docstring). Upkeep calls it now and then.

        It takes no lock: the state read names rows and segments already written (both are
        only appended after), so fsyncing the files afterwards puts all of it on disk, whatever
        is written meanwhile; a fit replaced meanwhile is the case a restart already handles (a
        checkpoint naming a fit that is gone: no lists until upkeep makes some). Under the
        ``sync`` lock, the fsyncs stalled every query that met the checkpoint: ~0.6 s every 30 s
        at 2,000 writes a second. Each file is written back a piece at a time before its fsync
        (:func:`~gmmlsh.index.columns.make_durable`): the writes of 30 s sent at once held up
        other processes' small writes behind them."""
        self.written = False  # before the state is read: what is written meanwhile sets it again
        try:
            state = self._read_state()
            lists = state.get("lists")
            paths = [p for col in self._columns() for p in col.paths()]
            if lists:
                paths += list((self.dir / lists["fit"]).glob("*"))
            for path in paths:
                make_durable(path)
            self._write_state(dict(state), self.dir / "durable.json", durable=True)
        except BaseException:
            self.written = True
            raise
        self.checkpointed = time.monotonic()

    def _stamp(self) -> tuple | None:
        try:
            st = os.stat(self._state_file)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def locked(self, name: str = "sync", blocking: bool = True) -> contextlib.AbstractContextManager[bool]:
        """The directory's lock ``name`` (:class:`~gmmlsh.index.locks.DirectoryLocks`): ``sync``
        for short work on the state; upkeep's lanes and tasks take names of their own."""
        return self._locks.locked(name, blocking)

    def refresh(self) -> View:
        """The current view, reloaded first if another process or thread published a new state."""
        if self._stamp() != self._state_stamp:
            with self._load_lock:
                if self._stamp() != self._state_stamp:
                    self.view = self._load()
        return self.view

    def _fit(self, name: str) -> Arenas:
        """The arenas of the fit ``name`` (kept mapped while it stays the published one)."""
        if self._arenas is None or self._arenas.fit.name != name:
            self._arenas = Arenas(self.dir / name, Fit.load(self.dir / name), self.words)
        return self._arenas

    def _load(self) -> View:
        while True:
            stamp = self._stamp()
            state = self._read_state()
            lists = state.get("lists")
            try:
                arenas = self._fit(lists["fit"]) if lists else None
                list_bundle, post_bundle = segments.bundles(arenas, lists, state["rows"], self.words)
            except FileNotFoundError:
                # Another process published a newer fit and removed this one between our reading
                # the state and opening its files: the state has moved on, read it again.
                # Unchanged, the state names a fit that is not there (a checkpoint older than the
                # fit's replacement, after the machine restarted): no lists, until upkeep makes some.
                if self._stamp() != stamp:
                    continue
                arenas = lists = None
                list_bundle, post_bundle = segments.bundles(None, None, state["rows"], self.words)
            # The view's own copy of the live flags, as of this state: the rows it retires are
            # cleared here, whether its sync has cleared them in the mapped column yet or not, and
            # a newer state (whose sync may clear its rows while we copy) means reading again.
            alive = np.array(self._alive.rows(state["rows"]))
            alive[np.asarray(state.get("retiring", ()), np.int64)] = 0
            if self._stamp() == stamp:
                break
        n = state["rows"]
        voff, vdata = self._vectors.views(n)
        coff, cdata = self._coarse.views(n)
        norms, planes, first = self._norms.rows(n), self._planes.rows(n), self._first.rows(n)
        vi, vf = vdata.view(np.uint32), vdata.view(np.float32)
        row_bundle = Rows(frozen(alive), frozen(norms), frozen(self._norms32.rows(n)), frozen(planes), frozen(first),
                          frozen(voff), frozen(vi), frozen(vf), frozen(coff), frozen(cdata), self.config.dim)
        self._state_stamp = stamp
        return View(
            rows=n, live=state["live"], dim=self.config.dim,
            token=tuple(state["token"]) if state["token"] is not None else None,
            iid=self._iid.rows(n), alive=alive, norms=norms, planes=planes, first=first, voff=voff, vi=vi, vf=vf,
            names=self._names.views(n), meta=self._meta.views(n),
            nrff=self._nrff.rows(n) if self._nrff is not None else None,
            rowof=self._rowof.whole(), row_bundle=row_bundle, lists=list_bundle, postings=post_bundle,
            fit=arenas.fit if arenas is not None else None,
            segments=tuple(lists["segments"]) if lists else (), garbage=lists.get("garbage", 0) if lists else 0,
            search=SearchParams.from_dict(state["search"]) if state.get("search") else
            SearchParams(rank_bits=min(RANK_BITS_MAX, self.config.bits)),
            tuned_rows=state.get("tuned_rows", 0), tuned_lists=state.get("tuned_lists", 0),
            tuned_on_queries=state.get("tuned_on_queries", False),
        )

    # --- following the store ------------------------------------------------------------
    def sync(self, store: Store, wait: bool = True, written: tuple[np.ndarray, RecordBatch] | None = None) -> View:
        """Bring the mirror up to the store's current token (no-op if it is there); ``wait``
        False: the current view at once if another thread or process is syncing it. ``written``:
        a batch this process has just written, with its iids (:attr:`Written.iids`), taken from
        here rather than read back (:func:`read_through`)."""
        with self.locked(blocking=wait) as mine:
            if not mine:
                return self.refresh()
            state = self._read_state()
            self._settle(state)
            now = store.token()
            if state["token"] is not None and tuple(state["token"]) != now and _behind(now, state["token"]):
                fresh = getattr(store, "token_fresh", None)  # a cached token older than the mirror?
                now = fresh() if fresh is not None else now
            if state["token"] is not None and tuple(state["token"]) != now and _behind(now, state["token"]):
                state, written = self._went_back(store, state, now), None
            if state["token"] is None or tuple(state["token"]) != now:
                for _ in range(_FOLLOW_ROUNDS):
                    state, missed = self._follow(store, state, written)
                    if not missed:
                        break
                self._write_state(state)
                self.written = True
                self._settle(state)
            with self._load_lock:
                self.view = self._load()
        return self.view

    def _follow(self, store: Store, state: dict, written: tuple[np.ndarray, RecordBatch] | None
                ) -> tuple[dict, bool]:
        """Apply to ``state`` the store's changes since its token: the added records appended as
        rows, the rows of the retired ones added to its ``retiring``. Returns the state and
        whether some added records were gone when read: a write after the token retired them,
        and the caller follows on to take in their successors before it publishes (on Redis,
        whose writers do not wait for a sync, a state would else name neither the old row of
        a replaced id nor its new one)."""
        changes = store.changes(None if state["token"] is None else tuple(state["token"]))
        if state["token"] is not None and _behind(changes.token, state["token"]):
            return state, False  # went back since the last round: the next sync resyncs
        state, kept = self._lost_tails(store, state, changes)
        read = read_through(store, written if kept is changes else None)  # lost writes: all read again
        rows = self._append(read, kept.added, state["rows"])
        prior = np.asarray(state.get("retiring", ()), np.int64)  # earlier rounds', a resync's
        retiring = np.setdiff1d(self._retiring(kept.retired, rows), prior)
        missed = rows - state["rows"] < kept.added.shape[0]
        state.update(rows=rows, token=list(kept.token), retiring=np.union1d(prior, retiring).tolist(),
                     live=state["live"] + rows - state["rows"] - retiring.shape[0])
        return state, missed

    def _went_back(self, store: Store, state: dict, now: tuple) -> dict:
        """The store is behind the mirror: only its id-shards that went back are copied again
        where the store can say which (:mod:`gmmlsh.index.resync`), else everything."""
        from gmmlsh.index.resync import went_back

        resynced = went_back(self, store, state, now)
        if resynced is None:
            return self._reset()
        self._write_state(resynced)
        self.written = True
        self._settle(resynced)
        return resynced

    def _lost_tails(self, store: Store, state: dict, changes):
        """Shards whose newest records the mirror holds were lost and written over since (see
        :func:`gmmlsh.index.resync.lost_tails`) are copied again; (state, changes) to go on with."""
        from gmmlsh.index.resync import lost_tails, went_back

        lost = lost_tails(self, store, state, changes.token, changes.retired)
        if not lost:
            return state, changes
        resynced = went_back(self, store, state, changes.token, lost)
        if resynced is None:
            return self._reset(), store.changes(None)
        return resynced, store.changes(tuple(resynced["token"]))

    def _reset(self) -> dict:
        """Forget everything (the store went back in time, e.g. a restored backup)."""
        for path in self.dir.iterdir():
            if path.name.endswith(".lock"):
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        self._open_columns()
        self._arenas = None
        return self._read_state()

    def _append(self, read: Callable[[np.ndarray, Sequence[str]], dict], iids: np.ndarray, rows: int) -> int:
        """Read the records of ``iids`` (``read``: a store's :meth:`~Store.read`) and append those
        still stored; returns the new row count."""
        cfg = self.config
        fields = ["name", "vector", "sketch", "meta"] + (["nrff"] if cfg.nrff_k else [])
        for lo in range(0, iids.shape[0], _READ_BATCH):
            part = iids[lo:lo + _READ_BATCH]
            rec = read(part, fields)
            keep = [i for i, v in enumerate(rec["vector"]) if v is not None]
            if not keep:
                continue
            m = len(keep)
            new_iids = part[keep]
            sk = np.frombuffer(b"".join(rec["sketch"][i] for i in keep), np.uint8).reshape(m, -1)
            norms, payloads = stored_payloads([rec["vector"][i] for i in keep], cfg)
            end = rows + m
            self._iid.write(rows, new_iids)
            self._alive.write(rows, np.ones(m, np.uint8))
            self._norms.write(rows, norms)
            self._norms32.write(rows, norms.astype(np.float32))
            planes = bit_planes(unpack_codes(sk, cfg.samples, cfg.bits), cfg.bits)
            self._planes.write(rows, planes)
            self._first.write(rows, first_rows(planes, self.words, cfg.bits))
            self._vectors.append(rows, payloads)
            self._append_coarse(rows, end)
            self._names.append(rows, [rec["name"][i] for i in keep])
            self._meta.append(rows, [rec["meta"][i] or b"" for i in keep])
            if self._nrff is not None:
                self._nrff.write(rows, np.frombuffer(b"".join(rec["nrff"][i] for i in keep), np.float32
                                                     ).reshape(m, cfg.nrff_k))
            rowof = self._rowof.reserve(int(new_iids.max()) + 1)
            rowof[new_iids] = np.arange(rows + 1, end + 1, dtype=np.uint32)
            rows = end
        return rows

    def _append_coarse(self, lo: int, hi: int) -> None:
        """The coarse rows of mirror rows ``[lo, hi)``, from their vectors just written."""
        voff, vdata = self._vectors.views(hi)
        vi = vdata.view(np.uint32)
        sizes = coarse_sizes(voff, vi, lo, hi)
        data = np.empty(int(sizes.sum()), np.uint8)
        coarse_encode(voff, vi, vdata.view(np.float32), self._norms.rows(hi), lo, hi, data)
        self._coarse.append_flat(lo, data, sizes)

    def _retiring(self, iids: np.ndarray, rows: int) -> np.ndarray:
        """The live rows of these iids, ascending: those a sync retires."""
        if not iids.shape[0]:
            return np.zeros(0, np.int64)
        rowof = self._rowof.whole()
        known = iids[iids < rowof.shape[0]]
        r = rowof[known].astype(np.int64) - 1
        r = np.unique(r[(r >= 0) & (r < rows)])
        return r[self._alive.rows(rows)[r] != 0]

    def _settle(self, state: dict) -> None:
        """Clear in the mapped live flags the rows ``state`` retires (``retiring``, dropped from
        it). A sync writes them into the state it publishes and clears them after: a view read
        before that state keeps them, one read after clears them in its own copy (:meth:`_load`),
        so no view sees a replaced id in neither row. The next holder of the ``sync`` lock settles
        the state it finds too, in case the process that wrote it died before it could."""
        retiring = state.pop("retiring", None)
        if retiring:
            self._alive.reserve(state["rows"])[np.asarray(retiring, np.int64)] = 0

    # --- derived structures -----------------------------------------------------------------
    def publish(self, change: Callable[[dict], None]) -> View:
        """Apply ``change`` to the state under the ``sync`` lock and publish it (``change`` raises
        :class:`Stale` to publish nothing); returns the new view."""
        with self.locked():
            state = self._read_state()
            self._settle(state)
            old = (state.get("lists") or {}).get("fit")
            change(state)
            self._write_state(state)
            self.written = True
            with self._load_lock:
                self.view = self._load()
        new = (state.get("lists") or {}).get("fit")
        if old and old != new:
            segments.retire_fit(self.dir / old)  # mapped elsewhere: stays readable there
        return self.view

    def reserve(self, fit: str, sizes: dict[str, int]) -> dict[str, int]:
        """Room for ``sizes`` values at the ends of the published fit's arenas: their offsets.
        Raises :class:`Stale` when ``fit`` is no longer the published fit."""
        out: dict[str, int] = {}

        def take(state: dict) -> None:
            lists = state.get("lists")
            if not lists or lists["fit"] != fit:
                raise Stale(f"{fit} is no longer the published fit")
            for name, size in sizes.items():
                out[name] = lists["ends"].get(name, 0)
                lists["ends"][name] = out[name] + int(size)

        self.publish(take)
        return out

    def populate(self, vectors: bool = True) -> float:
        """Map the columns a query reads into this process ahead of the queries (one worker's
        first queries would otherwise each take page faults); returns the seconds it took.
        ``vectors`` False leaves the vectors column (most of the mirror; an answer reads the
        few rows it reranks) mapped but on disk: only the hot set is brought into RAM."""
        t0 = time.perf_counter()
        view = self.refresh()
        hot = list(view.row_bundle[:-1]) + list(view.lists[:6]) + list(view.postings[1:7])
        if not vectors:
            hot = [a for a in hot if a is not view.row_bundle.vi and a is not view.row_bundle.vf]
        for array in hot:
            populate(array)
        return time.perf_counter() - t0

    def disk_bytes(self) -> int:
        """Bytes of disk the mirror takes."""
        return sum(p.stat().st_blocks * 512 for p in self.dir.rglob("*") if p.is_file())


def ahead(now: tuple, mirrored: tuple | list | None) -> bool:
    """Whether the store's token ``now`` only adds to the mirror's ``mirrored``: writes the
    mirror lacks, nothing of what it holds undone (it has a token, and the store is not behind it)."""
    return mirrored is not None and not _behind(now, mirrored)


def _behind(now: tuple, mirrored: list) -> bool:
    """Whether the store's token is behind the mirror's (a restored backup, a flushed Redis)."""
    return len(now) != len(mirrored) or any(a < b for a, b in zip(now, mirrored, strict=True))
