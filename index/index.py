"""The GMM index: one object to open an index, write to it and query it.

Writes go to the store (:mod:`gmmlsh.index.store`: LMDB or Redis), the truth.
Queries read the search mirror (:mod:`gmmlsh.index.mirror`), a memory-mapped copy
shared by every process of the machine; before answering, a query compares the
store's feed token with the mirror's (one LMDB ``get``, or one Redis round trip)
and brings the mirror up to date if another process or replica wrote. So a write
acknowledged anywhere is seen by the next query everywhere. Inverted lists grow in
segments, and the search is re-tuned, beside the queries as the index grows
(:mod:`gmmlsh.index.upkeep`); a query never waits for that.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson
import scipy.sparse as sp

from gmmlsh.core.validate import VectorError
from gmmlsh.index import monitor, tuner
from gmmlsh.index.config import DEFAULT_K, MAX_SCROLL_LIMIT, IndexConfig, SearchParams
from gmmlsh.index.filtered import NameOrder, matching, run_filtered, scroll
from gmmlsh.index.filters import Filter, FilterError, MetaColumns
from gmmlsh.index.mirror import Mirror, View, ahead, mirror_dir
from gmmlsh.index.plan import Untuned, as_filter, check_options, search_of, tuned_params
from gmmlsh.index.records import (
    SparseRow,
    as_given,
    as_stored,
    check_id,
    decode_rows,
    prepare,
    prepare_rows,
    query_rows,
)
from gmmlsh.index.search import (
    answer,
    check_codes,
    found_by,
    prepare_row,
    prepare_vectors,
    sparse_query,
)
from gmmlsh.index.served import Flusher, QuerySample, SharedSample
from gmmlsh.index.store.base import ConfigConflict, DiskFull, RecordBatch, Store, StoreUnavailable, Written
from gmmlsh.index.store.location import DEFAULT_PREFIX, is_redis, open_store
from gmmlsh.index.upkeep import Upkeep
from gmmlsh.results import QueryResult, StoredVector

log = logging.getLogger("gmmlsh.index")
_T = TypeVar("_T")

#: Queries of a batch prepared at once (each holds a float64 buffer of the full dimension).
_BATCH_CHUNK = 256

class _MirrorBehind(Exception):
    """A stored id whose record this process's mirror does not hold yet."""


class MirrorFull(DiskFull):
    """A query needs a vector this machine's search mirror cannot take yet (its disk is full)."""


class UnknownIdError(KeyError):
    """No vector is stored under this external id (the service answers 404)."""

    def __init__(self, ext_id: str):
        super().__init__(ext_id)
        self.ext_id = ext_id

    def __str__(self) -> str:
        return f"id: no vector with id {self.ext_id!r}"


class Index:
    """An opened index; thread-safe. Open one per process (never share one across fork)."""

    def __init__(self, store: Store, config: IndexConfig, mirror_dir: str | os.PathLike, *,
                 search: dict | None = None, maintain: bool = True, monitor_budget: float = monitor.BUDGET):
        self.store = store
        self.config = config
        self.mirror = Mirror(mirror_dir, config)
        #: Search parameters given by the operator; they override the tuned ones.
        self.overrides = {k: v for k, v in (search or {}).items() if v is not None}
        self._params_of: tuple | None = None  # (tuned search, (lists, tuned lists), params): see params()
        self._auto = maintain
        self._tune_tried = False
        self.last_tuning: dict | None = None
        #: Queries served since last merged into the shared sample the tuner re-tunes on (index.served).
        self.served = QuerySample()
        self.shared = SharedSample(self.mirror.dir, config.dim)
        #: The recall monitor's share of this process's served queries (:mod:`gmmlsh.index.monitor`).
        self.recorder = monitor.Recorder(self.mirror.dir, monitor_budget)
        self._flusher = Flusher(self._flush_due, (self.flush_served, self.flush_recorded))
        #: How to open this index again (a worker process running its upkeep does).
        self.open_args: dict = {}
        #: Metadata fields filters read (built as they are first used; ``indexed`` ones at once).
        self.columns = MetaColumns()
        self._names = NameOrder()
        #: The collection this index is (:mod:`gmmlsh.index.collections`); "default": the location's own.
        self.collection = "default"
        #: Why the mirror could not take the store's last changes (a full disk), or None.
        self._mirror_problem: str | None = None
        self.upkeep = Upkeep(self)

    def declare_indexed(self, fields: Sequence[str]) -> None:
        """Metadata fields to keep indexed (value → rows lists; a collection declares them)."""
        self.columns = MetaColumns(tuple(fields))

    @property
    def indexed(self) -> tuple[str, ...]:
        return self.columns.indexed

    @classmethod
    def open(cls, location, config: IndexConfig | None = None, *, prefix: str = DEFAULT_PREFIX, create: bool = True,
             cache_dir: str | os.PathLike | None = None, search: dict | None = None, maintain: bool = True,
             monitor_budget: float = monitor.BUDGET, monitor_share: float | None = None,
             **store_options) -> Index:
        """Open (or create, given a ``config``) the index at a directory or Redis URL.

        ``cache_dir``: where the search mirror of a Redis index lives on this machine;
        ``search``: :class:`SearchParams` fields that override the tuned ones;
        ``maintain``: keep the lists and the tuning up in the background as the index grows;
        ``monitor_budget``: the share of the served searches' CPU time the recall monitor's exact
        re-runs may take (:mod:`gmmlsh.index.monitor`; 0: no monitor); ``monitor_share``: the
        share of served queries it checks, fixed instead (None: derived from the budget).
        """
        loc = str(location)
        group = store_options.get("group")
        if group is not None and not is_redis(loc):
            raise ValueError("group: only an index in Redis is served in groups of id-shards")
        monitor_budget = monitor.check_budget(monitor_budget)
        if monitor_share is not None:
            monitor.check_budget(monitor_share, "monitor_share")
        if not is_redis(loc) and config is None and not (Path(loc) / "data.mdb").exists():
            raise FileNotFoundError(f"index: no index at {loc}; create one by giving its parameters (dim, ...)")
        store = open_store(loc, prefix=prefix, **store_options)
        try:
            stored = store.read_config()
            if stored is None:
                if config is None or not create:
                    raise FileNotFoundError(f"index: no index at {store.info().get('url', loc)} (prefix {prefix!r})")
                stored = store.init_config(config.to_dict())
            found = IndexConfig.from_dict(stored)
            if config is not None:
                diffs = config.conflicts(found)
                if diffs:
                    raise ConfigConflict("index has other parameters: " + "; ".join(diffs))
            index = cls(store, found, mirror_dir(loc, prefix, found.uid, cache_dir,
                                                 tuple(group) if group is not None else None),
                        search=search, maintain=maintain, monitor_budget=monitor_budget)
            index.recorder.fixed_share = monitor_share
            index.open_args = {"location": loc, "prefix": prefix, "cache_dir": cache_dir and str(cache_dir),
                               "search": search, "monitor_budget": monitor_budget, **store_options}
            return index
        except BaseException:
            store.close()
            raise

    # --- writes ----------------------------------------------------------------------------
    def prepare(self, ids: Sequence[str], X, metadata: Sequence[dict | None] | None = None) -> RecordBatch:
        """Validate and hash rows into records (touches no store); see :meth:`write`."""
        return prepare(self.config, ids, X, metadata)

    def prepare_rows(self, ids: Sequence[str], rows: Sequence, metadata: Sequence[dict | None] | None = None
                     ) -> RecordBatch:
        """:meth:`prepare` for rows each dense (numbers) or sparse (an ``(indices, values)`` pair),
        each stored in the shape it came in (:func:`~gmmlsh.index.records.prepare_rows`)."""
        return prepare_rows(self.config, ids, rows, metadata)

    def write(self, batch: RecordBatch, *, searchable: bool = True) -> Written:
        """Store a batch made by this index's :meth:`prepare` (all or nothing; Redis writes a
        batch over 4 MiB in parts, see :meth:`RedisStore.write`); returns how many ids it wrote (an
        id given twice counts once: its last row wins) and how many of them replaced a stored vector.

        ``searchable``: return once the rows are in this machine's search mirror (:meth:`_acknowledged`);
        a bulk load, which brings the mirror up at its own pace, says False. Split from :meth:`prepare`
        so a bulk load can hash the next batch while this one is written."""
        return self._acknowledged(lambda: self.store.write(batch), batch, searchable)

    def upsert(self, ids: Sequence[str], X, metadata: Sequence[dict | None] | None = None) -> Written:
        """Insert or replace vectors by id: all rows are validated first, then written all or
        nothing; returns what :meth:`write` does."""
        return self.write(self.prepare(ids, X, metadata))

    def delete(self, ids: Sequence[str]) -> int:
        """Remove these ids everywhere; returns how many existed."""
        ids = [check_id(i, "ids", n) for n, i in enumerate(ids)]
        if not ids:
            return 0
        return self._acknowledged(lambda: self.store.delete(ids))

    def _acknowledged(self, write: Callable[[], _T], batch: RecordBatch | None = None, searchable: bool = True) -> _T:
        """``write()``, returned once this machine's search mirror holds it, put there from
        ``batch`` (:func:`read_through`), not read back. LMDB: the mirror's ``sync`` lock is held
        from before the write until it is applied, so a query that sees the store ahead of the
        mirror finds the lock held: a write not acknowledged yet, which it need not wait for
        (:meth:`view`). Redis has writers on other machines, whose writes queries apply; this
        process applies its own after it, where its mirror is in use (a process that only writes
        keeps none): a query here waits for that at most (issue 30)."""
        if not searchable:
            return write()

        def own(done):  # what the mirror takes from the batch held here (a delete has none)
            return (done.iids, batch) if batch is not None else None

        if self.store.local:
            with self.mirror.locked():
                done = write()
                self._sync(written=own(done))
                return done
        done = write()
        if self.mirror.view.token is not None:
            try:
                self._sync(written=own(done))
            except StoreUnavailable as exc:  # the write is stored: a query applies it once Redis answers
                log.warning("a write was stored but not put into the search mirror: %s", exc)
        return done

    # --- reads -------------------------------------------------------------------------------
    def count(self) -> int:
        return self.store.count()

    def contains(self, ext_id: str) -> bool:
        return bool(self.store.lookup([check_id(ext_id)])[0] >= 0)

    def get(self, ext_id: str) -> StoredVector:
        """The stored vector (float32, in the shape it was given in) and metadata of an id."""
        check_id(ext_id)
        for _ in range(8):  # the id may be replaced between the two reads: read again
            iid = int(self.store.lookup([ext_id])[0])
            if iid < 0:
                raise UnknownIdError(ext_id)
            rec = self.store.read(np.array([iid]), ["vector", "meta"])
            if rec["vector"][0] is not None:
                return as_given(ext_id, rec["vector"][0], self.config.dim, rec["meta"][0])
        raise UnknownIdError(ext_id)

    def stored_rows(self, ids: Sequence[str]) -> tuple[np.ndarray | sp.csr_matrix, list[dict | None]] | None:
        """The stored vectors of ``ids`` at stored precision (a dense float32 array when all are
        stored dense, else CSR) and their metadata, in order; None when any id is not stored. A
        bulk load compares them with its input to skip what an earlier run stored."""
        iids = np.asarray(self.store.lookup(ids), dtype=np.int64)
        if (iids < 0).any():
            return None
        rec = self.store.read(iids, ["vector", "meta"])
        if any(b is None for b in rec["vector"]):  # replaced between the two reads
            return None
        return (decode_rows(rec["vector"], self.config.dim)[0],
                [orjson.loads(m) if m else None for m in rec["meta"]])

    @property
    def mirror_path(self) -> Path:
        """The directory of this machine's search mirror of the index (derived data)."""
        return self.mirror.dir

    def view(self) -> View:
        """The mirror, brought up to the store's current state first (where it can take it:
        see :meth:`read_problem`). Where the store is local and another thread or process is
        applying writes to the mirror, the view as it is: those writes are not acknowledged
        until they are applied (:meth:`write`), so a query never waits for their sync."""
        view = self.mirror.refresh()
        if view.token != self.store.token():
            view = self._sync(wait=not self.store.local)[0]
        if self._auto:
            self.upkeep.poke(view)
        return view

    def catch_up(self) -> View:
        """This machine's search mirror brought up to the store, without starting upkeep: what a
        bulk load calls between chunks (:func:`gmmlsh.index.ingest.build.build`), which leaves the
        lists and the tuning to its end; an upkeep worker started meanwhile by :meth:`view` would
        build and re-tune them over and over while the load runs, on the cores it hashes on."""
        return self._sync()[0]

    def _sync(self, wait: bool = True, written: tuple[np.ndarray, RecordBatch] | None = None) -> tuple[View, bool]:
        """(the mirror brought up to the store, True); or, where it cannot take the changes (its
        disk is full), (the mirror as it is, False): reads go on from what it holds, and
        :meth:`read_problem` says so. ``wait`` False: the mirror as it is if another is syncing it;
        ``written``: see :meth:`Mirror.sync`."""
        try:
            view = self.mirror.sync(self.store, wait=wait, written=written)
        except (DiskFull, OSError) as exc:
            if not isinstance(exc, DiskFull) and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("search mirror not brought up to date: %s", exc)
            self._mirror_problem = ("this machine's search mirror is behind the store: no space left on its disk for "
                                    "the vectors written since it filled up, so answers miss them (it catches up by "
                                    "itself once space is freed)")
            return self.mirror.refresh(), False
        self._mirror_problem = None
        return view, True

    def read_problem(self) -> str | None:
        """Why answers may miss acknowledged writes now (the search mirror could not take them
        at this process's last try: a full disk), or None; tries again first, if so."""
        if self._mirror_problem is not None:
            self._sync()
        return self._mirror_problem

    def warm(self, vectors: bool = True) -> View:
        """Bring the search mirror up to date and map its hot columns into this process, so
        that the first queries take no page faults (a server does it at start); ``vectors``
        False leaves the vectors column on disk (see :meth:`Mirror.populate`)."""
        view = self.view()
        self.mirror.populate(vectors)
        return view

    def params(self, view: View, **given) -> SearchParams:
        """The search parameters of a query (:func:`~gmmlsh.index.plan.tuned_params`, then the
        query's ``given``): the tuned and the operator's are worked out once per published
        tuning and fit, so a query costs a lookup."""
        made = self._params_of
        if made is None or made[0] is not view.search or made[1] != (view.list_count, view.tuned_lists):
            made = self._params_of = (view.search, (view.list_count, view.tuned_lists),
                                      tuned_params(view, self.overrides))
        params = made[2]
        return params.with_overrides(**given) if any(v is not None for v in given.values()) else params

    # --- queries -------------------------------------------------------------------------------
    def query(self, vector=None, *, id: str | None = None, k: int = DEFAULT_K, mode: str = "auto",
              min_similarity: float = 0.0, candidates: int | None = None, probes: int | None = None,
              filter: dict | Filter | None = None, codes: np.ndarray | None = None) -> QueryResult:
        """Nearest neighbours of a vector (dense, ``(indices, values)`` or a 1-row CSR) or of a
        stored id (which is then left out); with a ``filter`` (:mod:`gmmlsh.index.filters`),
        the nearest of the vectors whose metadata pass it. ``mode``: ``auto`` (the search the index
        tuned for itself), or ``sketch``, ``postings``, ``exact``, ``nrff`` (see :data:`MODES`).
        ``codes``: the vector's codes ``(1, samples)`` when the caller hashed it already
        (:func:`~gmmlsh.index.search.query_codes`: a router hashes a query once for all groups)."""
        if (vector is None) == (id is None):
            raise VectorError("vector", "give exactly one of a vector or an id")
        k, mode, min_similarity = check_options(k, mode, min_similarity, candidates, probes)
        flt = as_filter(filter)
        X32 = query_rows(vector, self.config.dim) if vector is not None else None
        if codes is not None:
            codes = check_codes(codes, 1, self.config)
        if X32 is not None:
            self.served.add(X32, own=True)
        if id is not None:
            check_id(id)

        watched = mode == "auto" and candidates is None and probes is None and flt is None

        def on(view: View) -> QueryResult:
            params, how = self._plan(view, mode, candidates, probes)
            if id is not None:
                iid = int(self.store.lookup([id])[0])
                if iid < 0:
                    raise UnknownIdError(id)
                row = view.row_of(iid)
                if row < 0:
                    raise _MirrorBehind(id)
                q = prepare_row(view, row, self.config)
            elif isinstance(X32, SparseRow) and how in ("postings", "exact") and self.config.center is None:
                with sparse_query(X32, self.config) as q:
                    return self._answer(view, [q], k, how, min_similarity, params, flt, watched)[0]
            else:
                q = prepare_vectors(X32, self.config, sketch=how == "sketch", codes=codes)[0]
            return self._answer(view, [q], k, how, min_similarity, params, flt, watched)[0]

        return self._current(on)

    def query_batch(self, X, *, k: int = DEFAULT_K, mode: str = "auto", min_similarity: float = 0.0,
                    candidates: int | None = None, probes: int | None = None,
                    filter: dict | Filter | None = None, codes: np.ndarray | None = None) -> list[QueryResult]:
        """One query per row of ``X`` (dense 2-D or CSR), answered together (in parallel where numba
        has threads); ``codes``: the rows' codes when the caller hashed them (see :meth:`query`)."""
        k, mode, min_similarity = check_options(k, mode, min_similarity, candidates, probes)
        flt = as_filter(filter)
        X32 = as_stored(X, self.config.dim, "vectors")
        if codes is not None:
            codes = check_codes(codes, X32.shape[0], self.config)
        self.served.add(X32)
        watched = mode == "auto" and candidates is None and probes is None and flt is None

        def on(view: View) -> list[QueryResult]:
            params, how = self._plan(view, mode, candidates, probes)
            out: list[QueryResult] = []
            for lo in range(0, X32.shape[0], _BATCH_CHUNK):  # each query holds a dense buffer of the full dimension
                qs = prepare_vectors(X32[lo:lo + _BATCH_CHUNK], self.config, sketch=how == "sketch",
                                     codes=codes[lo:lo + _BATCH_CHUNK] if codes is not None else None)
                out += self._answer(view, qs, k, how, min_similarity, params, flt, watched)
            return out

        return self._current(on)

    def _current(self, answer_on: Callable[[View], Any]) -> Any:
        """``answer_on(view)`` on a mirror as current as the store when the call began: the
        store's token is asked for first, the answer is worked out on this process's mirror
        while the request travels (a Redis round trip, hidden behind the search), and worked
        out again on a synced mirror if the token shows a write the mirror lacks — so an
        answer never misses a write acknowledged before the query, as if the token had been
        read first. A local store's writes are acknowledged once applied (:meth:`write`): one
        being applied elsewhere, or applied since the view was read, is not waited for."""
        pending = self.store.token_later()
        view = self.mirror.refresh()
        refused: FilterError | None = None
        missing: str | None = None  # a stored id the mirror does not hold yet
        untuned = False
        try:
            out = answer_on(view)
        except _MirrorBehind as exc:
            out, missing = None, exc.args[0]
        except Untuned:  # no tuning yet: tuned below, before the first answer
            out, untuned = None, True
        except FilterError as exc:  # judged on the stored values: again below if the mirror was behind
            out, refused = None, exc
        finally:
            now = pending()
        if refused is not None and now == view.token:
            raise refused
        if missing is not None or untuned or now != view.token:
            wait = missing is not None or untuned or not self.store.local
            fresh, synced = self._sync(wait=wait)
            if not synced and not untuned:  # the mirror cannot take the writes: answer from what it holds
                if missing is not None:
                    raise MirrorFull(f"id: the vector of {missing!r} was written after this machine's search mirror "
                                     "filled up; it cannot be searched from until space is freed")
                if refused is not None:
                    raise refused
                return out
            if fresh is view or (self.store.local and missing is None and not untuned and ahead(now, view.token)):
                # a local store acknowledges a write once the mirror has it: one the view lacks came later
                if refused is not None:
                    raise refused
                return self._served(view, out)
            view = fresh
            try:
                out = answer_on(view)
            except _MirrorBehind as exc:  # replaced or deleted again between lookup and sync
                raise UnknownIdError(exc.args[0]) from None
            except Untuned:  # tuned now, before the first answer (the lists built first, if due)
                try:
                    self.upkeep.run_now()
                finally:
                    self._tune_tried = True  # if that failed, exact search answers meanwhile
                out = answer_on(self._sync()[0])
        return self._served(view, out)

    def _served(self, view: View, out: Any) -> Any:
        """After an answer: upkeep told of the view, the served and recorded queries handed on when due."""
        if self._auto:
            self.upkeep.poke(view)
        self._flusher.poke()
        return out

    def _flush_due(self) -> tuple[bool, bool]:  # (the served sample, the recorded queries)
        return self.served.due(eager=self.shared.held < tuner.MIN_QUERIES), self.recorder.due()

    def flush_served(self) -> None:
        """Merge the queries this process served into the index's shared sample."""
        try:
            self.shared.add(self.served, self.mirror.locked)
        except OSError as exc:  # a full disk: the sample waits, the queries go on
            log.warning("served queries not saved: %s", exc)

    def flush_recorded(self) -> None:
        """Hand the queries recorded for the recall monitor to its inbox."""
        try:
            self.recorder.flush()
        except OSError as exc:  # a full disk: those records are lost, the queries go on
            log.warning("queries recorded for the recall monitor not saved: %s", exc)

    def _plan(self, view: View, mode: str, candidates: int | None, probes: int | None) -> tuple[SearchParams, str]:
        """The search parameters and the search that answers (:mod:`gmmlsh.index.plan`)."""
        params = self.params(view, candidates=candidates, probes=probes)
        knobs = candidates is not None or probes is not None
        return params, search_of(view, params, mode, knobs, probes, self._tune_tried)

    def _answer(self, view, qs, k, mode, min_similarity, params, flt=None, watched=False) -> list[QueryResult]:
        """Answers by the search ``mode`` names; ``watched``: the index's own choice (``auto``, no
        knobs, no filter), so a share of those the tuned search answers go to the recall monitor."""
        if flt is not None:
            return run_filtered(view, qs, k, mode, min_similarity, params, self.config, flt, self.columns)
        watched = watched and mode in ("sketch", "postings") and self.recorder.active
        t0 = time.thread_time() if watched else 0.0
        found = found_by(view, qs, k, mode, params, self.config)
        if watched:
            self.recorder.offer(view, qs, found, time.thread_time() - t0, self.overrides)
        return [answer(view, mode, k, rows, sims, scored, min_similarity) for rows, sims, scored in found]

    # --- by metadata ---------------------------------------------------------------------------
    def scroll(self, cursor: str | None = None, limit: int = 100, filter: dict | Filter | None = None
               ) -> tuple[list[tuple[str, dict | None]], str | None]:
        """A page of stored ``(id, metadata)`` in id order after ``cursor`` (the last id of the
        previous page; None: from the start), those passing ``filter`` only, and the next
        page's cursor (None at the end). Every id stored throughout comes exactly once."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SCROLL_LIMIT:
            raise VectorError("limit", f"must be an integer between 1 and {MAX_SCROLL_LIMIT}, got {limit!r}")
        if cursor is not None:
            check_id(cursor, "cursor")
        return scroll(self.view(), self._names, self.columns, as_filter(filter), cursor, limit)

    def delete_where(self, filter: dict | Filter) -> int:
        """Delete every vector whose metadata pass ``filter``; returns how many went. A vector
        replaced meanwhile by a version that no longer matches is left alone."""
        flt = as_filter(filter)
        if flt is None or not (flt.must or flt.should or flt.must_not):
            raise FilterError("filter", "give a condition (to delete everything, delete the collection)")
        view = self.view()
        rows = matching(view, flt, self.columns)[1]
        if not rows.shape[0]:
            return 0
        names = view.names_of(rows.tolist())
        return self._acknowledged(lambda: self.store.delete(names, expect=view.iid[rows].astype(np.int64)))

    # --- upkeep --------------------------------------------------------------------------------------
    def maintain(self, queries=None) -> dict:
        """Do now, in this thread, the upkeep that is due (:mod:`gmmlsh.index.upkeep`): absorb the
        tail into segments, merge them, make a new fit of the lists, tune the search. The
        background lanes do it on their own (``maintain=True``); a bulk load calls this at its
        end. Waits for upkeep under way elsewhere. Returns what was done, task by task.

        ``queries`` (dense 2-D or CSR, at least :data:`tuner.MIN_QUERIES` rows; the tuner takes
        :data:`tuner.MAX_QUERIES` of them, spread evenly): queries like those the index will
        serve, to tune on now, as if it had served them. Without them an index tunes on stored
        vectors until it has served enough queries, and stored vectors can be much easier
        queries than new ones where the data hold near-copies.
        """
        given = tuner.sample_queries(queries, self.config.dim) if queries is not None else None
        return self.upkeep.run_now(given)

    # --- housekeeping ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        view = self.mirror.refresh()
        return {
            "collection": self.collection,
            "count": self.count(),
            "config": self.config.to_dict(),
            "search": {**self.params(view).to_dict(), "tuned_at_rows": view.tuned_rows,
                       "tuned_on": "queries" if view.tuned_on_queries else "stored vectors",
                       "overrides": self.overrides},
            "mirror": {"rows": view.rows, "lists": view.list_count, "segments": len(view.segments),
                       "listed_rows": view.tail_start, "tail_rows": view.rows - view.tail_start,
                       "disk_bytes": self.mirror.disk_bytes()},
            "upkeep": self.upkeep.report(),
            "recall": monitor.report(self.mirror.dir, self.recorder.budget, self.recorder.share),
            "served": self.shared.summary(),
            "store": self.store.info(),
            "filters": {"indexed_fields": list(self.indexed)},
        }

    def check(self):
        """Full integrity check (see :mod:`gmmlsh.index.check`); returns a report with ``.ok``."""
        from gmmlsh.index.check import check_index

        return check_index(self.store, self.config, self.mirror.refresh)

    def snapshot(self, dest) -> Path:
        """A consistent hot copy of an LMDB index in a new directory (its mirror is rebuilt on first use)."""
        snap = getattr(self.store, "snapshot", None)
        if snap is None:
            raise NotImplementedError(
                "snapshot: this backend keeps its own backups; for Redis run BGSAVE and copy "
                "dump.rdb (or copy the AOF directory), see the README's 'Backups' section")
        return snap(dest)

    def ping(self) -> None:
        self.store.ping()

    def write_problem(self) -> str | None:
        """Why writes are refused now (full disk or memory, an evicting Redis), or None."""
        return self.store.write_problem()

    def close(self) -> None:
        """Close the store; what this process wrote to the search mirror is put on disk first."""
        try:
            self._flusher.shutdown()  # a hand-off under way ends before the last flush
            self.flush_served()
            self.flush_recorded()
            if self.mirror.written:
                self.mirror.checkpoint()
        except OSError as exc:  # a full disk: the mirror is derived data, rebuilt if a restart needs it
            log.warning("mirror checkpoint at close failed: %s", exc)
        finally:
            self.store.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
