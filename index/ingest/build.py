"""The streaming batch build: chunks from a :class:`~gmmlsh.index.ingest.readers.Reader` into an index.

Memory is bounded by the chunk size, in a pipeline: a reader thread parses the
next chunks (at most ``prefetch`` wait), hashing workers check and hash the chunks
after the one being written (``Index.prepare``; one chunk per core, each on its
core), the calling thread writes one chunk at a time (``Index.write``, one
transaction), and a follower thread copies what was written into the search
mirror. Writes stay in input order, so the last occurrence of an id wins as in one
big upsert. At the end the index builds its search lists and tunes its search
(``Index.maintain``).

Interrupting is safe, and running the same build again finishes the job:

* every chunk is one ``upsert``, which writes all or nothing (one LMDB
  transaction; on Redis each vector becomes visible atomically);
* Ctrl-C / SIGTERM asks the build to stop *after* the chunk being written
  (a second Ctrl-C aborts at once, still leaving only whole vectors);
* on a re-run, a chunk whose rows are all stored exactly as in the input
  (same ids, vectors at stored precision, metadata) is skipped
  (``resume=True``); any other chunk is upserted again, which is idempotent
  by id. So a re-run of an interrupted or killed build ends with the same
  ids, vectors and sketches as an uninterrupted one, and rows that changed
  in the input since are written again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp

from gmmlsh.core import parallel
from gmmlsh.core.validate import VectorError, first_bad_row
from gmmlsh.index.ingest.readers import Chunk, InputFormatError, Reader
from gmmlsh.index.records import as_stored
from gmmlsh.index.store.base import RecordBatch
from gmmlsh.index.tuner import sample_queries

_logger = logging.getLogger(__name__)

#: Most chunks hashed at once (each is held in memory, with its records, until it is written).
MAX_HASHERS = 8


@dataclass
class BuildSummary:
    """What a build did. ``vectors`` were written by this run; ``skipped`` were already there."""

    rows: int = 0
    vectors: int = 0
    #: Of the vectors written, those whose id held a vector before (replaced by this run).
    replaced: int = 0
    skipped: int = 0
    invalid: int = 0
    seconds: float = 0.0
    count: int = 0
    index_bytes: int | None = None
    index_bytes_kind: str = "data file"
    interrupted: bool = False
    #: What :meth:`Index.maintain` did at the end (search lists built, search tuned).
    upkeep: dict | None = None

    @property
    def vectors_per_s(self) -> float:
        return self.vectors / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["vectors_per_s"] = round(self.vectors_per_s, 1)
        d["seconds"] = round(self.seconds, 3)
        return d

    def describe(self) -> str:
        """One human line for the end of ``gmmlsh build``."""
        parts = [f"{self.vectors:,} vectors written in {self.seconds:.1f} s ({self.vectors_per_s:,.0f} vectors/s)"]
        if self.replaced:
            parts.append(f"{self.replaced:,} of them replaced vectors stored under the same ids (to add rows instead, "
                         "give them other ids: --id-prefix or --id-start)")
        if self.skipped:
            parts.append(f"{self.skipped:,} already in the index (skipped)")
        if self.invalid:
            parts.append(f"{self.invalid:,} invalid rows left out")
        size = ""
        if self.index_bytes is not None:
            size = f", {human_bytes(self.index_bytes)}"
            if self.index_bytes_kind != "data file":
                size += f" ({self.index_bytes_kind})"
        parts.append(f"index now holds {self.count:,} vectors{size}")
        line = "; ".join(parts)
        if self.interrupted:
            line = "interrupted: " + line + ". Run the same command again to finish."
        return line


def human_bytes(n: int | None) -> str:
    """``n`` bytes for people: B, KB, MB, GB, TB (powers of 1,000), one decimal."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def index_size(index) -> tuple[int | None, str]:
    """(bytes, what they measure): LMDB's data file, or the whole Redis server's memory."""
    try:
        info = index.stats()["store"]
    except Exception:  # noqa: BLE001 - a size is nice to have, never worth failing a build
        return None, "size unknown"
    if isinstance(info.get("bytes"), int):
        return int(info["bytes"]), "data file"
    if isinstance(info.get("used_memory"), int):
        return int(info["used_memory"]), "Redis server memory, all keys"
    return None, "size unknown"


# --- validation -------------------------------------------------------------------


def invalid_rows(X) -> list[tuple[int, str]]:
    """(row, problem) for each row ``Index.upsert`` would refuse: non-finite values, all zeros."""
    bad: dict[int, str] = {}
    if sp.issparse(X):
        X = sp.csr_matrix(X)
        row_of = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
        nonfinite = ~np.isfinite(X.data)
        for r in np.unique(row_of[nonfinite]).tolist():
            bad[r] = "values must be finite (found NaN or infinity)"
        live = np.bincount(row_of[(X.data != 0) & ~nonfinite], minlength=X.shape[0])
        for r in np.flatnonzero(live == 0).tolist():
            bad.setdefault(r, "all-zero vector (no nonzero feature): GMM is undefined for it")
    else:
        if X.dtype in (np.float32, np.float64) and first_bad_row(np.ascontiguousarray(X))[1] == 0:
            return []  # the common case, in one compiled pass
        finite = np.isfinite(X).all(axis=1)
        for r in np.flatnonzero(~finite).tolist():
            bad[r] = "values must be finite (found NaN or infinity)"
        zero = ~(X != 0).any(axis=1)
        for r in np.flatnonzero(zero).tolist():
            bad.setdefault(r, "all-zero vector: GMM is undefined for it")
    return sorted(bad.items())


def _take(chunk: Chunk, keep: np.ndarray) -> tuple[list[str], object, list | None]:
    ids = [chunk.ids[i] for i in keep.tolist()]
    X = chunk.X[keep]
    meta = [chunk.metadata[i] for i in keep.tolist()] if chunk.metadata is not None else None
    return ids, X, meta


def _located(chunk: Chunk, kept: np.ndarray | None, exc: VectorError) -> Exception:
    """A refused row reported at its place in the input file (``kept``: the chunk's rows the
    index was given, when invalid rows were left out)."""
    if exc.row is None:
        return InputFormatError(chunk.source, str(exc))
    return chunk.error(int(kept[exc.row]) if kept is not None else exc.row, exc.reason)


@dataclass
class _Staged:
    """A chunk ready to write: its invalid rows (left out) and the records of the others."""

    bad: list[tuple[int, str]]
    batch: RecordBatch


def _stage(index, chunk: Chunk, on_invalid: str) -> _Staged:
    """Check a chunk's rows and hash them (``Index.prepare``): all the CPU work before the
    store write. Runs on a hashing worker for the chunks after the one being written."""
    ids, X, meta = chunk.ids, chunk.X, chunk.metadata
    bad = invalid_rows(X)
    kept = None
    if bad:
        if on_invalid == "error":
            i, problem = bad[0]
            raise chunk.error(i, problem)
        kept = np.setdiff1d(np.arange(len(chunk)), [i for i, _ in bad])
        ids, X, meta = _take(chunk, kept)
    try:
        return _Staged(bad, index.prepare(ids, X, meta))
    except VectorError as exc:
        raise _located(chunk, kept, exc) from None


# --- resume -------------------------------------------------------------------------


def _equal_rows(stored, X, dim: int) -> bool:
    """Whether ``stored`` rows (``Index.stored_rows``) are exactly the rows of ``X`` at stored precision."""
    try:
        want = sp.csr_matrix(as_stored(X, dim))
    except VectorError:  # a row the index refuses was never stored: the chunk is not done
        return False
    got = sp.csr_matrix(stored)
    for m in (got, want):
        m.eliminate_zeros()
        m.sort_indices()
    return (got.shape == want.shape and np.array_equal(got.indptr, want.indptr)
            and np.array_equal(got.indices, want.indices) and np.array_equal(got.data, want.data))


def chunk_done(index, chunk: Chunk) -> bool:
    """True when every row of this chunk is already stored exactly as read (vector and metadata).

    Cheap on a fresh build (one id looked up per chunk); on a re-run, three bulk
    store reads per chunk (ids, vectors, metadata) — far less than hashing and
    writing it again. Any difference means the chunk is written again.
    """
    if len(chunk.ids) == 0:
        return True
    try:
        if not index.contains(chunk.ids[-1]):
            return False
    except VectorError:  # an id the index refuses: staging the chunk reports it where it is
        return False
    stored = index.stored_rows(chunk.ids)
    if stored is None or not _equal_rows(stored[0], chunk.X, index.config.dim):
        return False
    return stored[1] == (list(chunk.metadata) if chunk.metadata is not None else [None] * len(chunk.ids))


# --- signals ------------------------------------------------------------------------


class _StopRequest:
    """Turns the first SIGINT/SIGTERM into a request to stop between chunks.

    A second SIGINT raises KeyboardInterrupt at once (the chunk being written is
    then rolled back, never half-written). Only the main thread can own signals;
    elsewhere this does nothing.
    """

    def __init__(self, log):
        self.requested = 0
        self.log = log
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = signum
        if self.log is not None:
            name = signal.Signals(signum).name
            print(f"\n{name}: stopping after the chunk being written (Ctrl-C again to abort now)",
                  file=self.log, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# --- prefetch -----------------------------------------------------------------------

_END = object()


def _prefetched(chunks: Iterator[Chunk], depth: int, stop: threading.Event) -> Iterator[Chunk]:
    """Iterate ``chunks`` in a background thread, keeping at most ``depth`` ready.

    Parsing (numba, GIL released) and file I/O then overlap hashing and writing.
    """
    if depth <= 0:
        yield from chunks
        return
    q: queue.Queue = queue.Queue(maxsize=depth)

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for c in chunks:
                if not put(c):
                    return
            put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer thread
            put(exc)

    t = threading.Thread(target=work, name="gmmlsh-reader", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while True:  # unblock the producer so it can see the stop flag
            try:
                q.get_nowait()
            except queue.Empty:
                break
        t.join(timeout=5)


# --- the search mirror ----------------------------------------------------------------


class _MirrorFollower:
    """Brings the index's search mirror up to the chunks written so far, in a background thread.

    The mirror copies every written record from the store (:meth:`Mirror.sync`). Done once at
    the end, that copy is a pass over the whole index after the last chunk; done here, it
    runs while the next chunks are read and hashed, and the end has only the last chunk left.
    Each sync takes all the chunks written since the previous one. A failure only stops the
    following: the sync at the end (``Index.maintain``) does the rest and reports it.
    """

    def __init__(self, index):
        self._index = index
        self._written = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._follow, name="gmmlsh-mirror", daemon=True)
        self._thread.start()

    def written(self) -> None:
        """A chunk was written: catch up."""
        self._written.set()

    def close(self) -> None:
        self._done = True
        self._written.set()
        self._thread.join()

    def _follow(self) -> None:
        while True:
            self._written.wait()
            self._written.clear()
            if self._done:
                return
            try:
                self._index.catch_up()
            except Exception:  # noqa: BLE001 - the final sync does the rest and reports it
                _logger.debug("the search mirror stopped following the build", exc_info=True)
                return


# --- the build ----------------------------------------------------------------------


def _hashing_workers() -> tuple[int, int]:
    """(workers, numba threads each): a chunk per core, each hashed on one core. Whole chunks
    side by side keep every core busy through all of a chunk's work (checks, encoding, its
    hashing), where one chunk's hashing spread over the cores (a parallel region) waits for
    its slowest thread, and any thread the writer, the reader or the mirror's follower
    preempts is the slowest."""
    cores = parallel.threads()
    workers = max(1, min(cores, MAX_HASHERS))
    return workers, 1 if workers > 1 else cores


def _progress_bar(reader: Reader, progress: bool | None, log):
    from tqdm import tqdm

    disable = (not progress) if progress is not None else None
    return tqdm(total=reader.rows, unit=" vectors", unit_scale=True, dynamic_ncols=True, file=log,
                disable=disable, smoothing=0.1, mininterval=0.5,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")


def build(index, reader: Reader, *, chunk_rows: int | None = None, progress: bool | None = None,
          resume: bool = True, on_invalid: str = "error", prefetch: int = 2, log=None,
          handle_signals: bool = True, tune_queries=None) -> BuildSummary:
    """Stream ``reader`` into ``index``; returns what was done.

    ``progress``: True/False, or None for "when stderr is a terminal".
    ``resume``: skip chunks already stored exactly as read (see module doc);
    False upserts everything. ``on_invalid``: ``"error"`` stops at the first
    row the index would refuse (naming file and line/row), ``"skip"`` leaves
    such rows out and counts them. Raises :class:`InputFormatError` for bad
    input and whatever the store raises for storage failures; an interrupt
    (SIGINT/SIGTERM) ends the build early with ``interrupted=True``.
    ``tune_queries`` (dense 2-D or CSR): sample queries the search is tuned on at the end
    (see :meth:`Index.maintain`), checked before anything is read.
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid: expected 'error' or 'skip', got {on_invalid!r}")
    log = sys.stderr if log is None else log
    if chunk_rows is not None:
        reader.chunk_rows = chunk_rows
    dim = index.config.dim
    if reader.dim is None:
        reader.dim = dim  # svmlight without a given dimension: the index's
    elif reader.dim != dim:
        raise InputFormatError(reader.paths[0] if len(reader.paths) == 1 else None,
                               f"input has dimension {reader.dim}, the index has {dim}")
    if tune_queries is not None:
        sample_queries(tune_queries, dim)  # bad sample queries fail now, not after the build
    summary = BuildSummary()
    t0 = time.perf_counter()
    stop = threading.Event()
    bar = _progress_bar(reader, progress, log)
    shown_invalid = 0
    workers, threads = _hashing_workers()
    hasher = ThreadPoolExecutor(workers, thread_name_prefix="gmmlsh-hash", initializer=parallel.set_threads,
                                initargs=(threads,))
    follower = _MirrorFollower(index)
    chunks = _prefetched(reader.chunks(), prefetch, stop)
    try:
        with _StopRequest(log) if handle_signals else contextlib.nullcontext() as req:
            ahead: deque[tuple[Chunk, Future]] = deque()  # the next chunks, hashing in input order
            while True:
                chunk, hashing = ahead.popleft() if ahead else (next(chunks, None), None)
                if chunk is None:
                    break
                n = len(chunk)
                summary.rows += n
                if resume and chunk_done(index, chunk):  # after the previous chunk is written
                    summary.skipped += n  # (its hashing, if begun, is dropped)
                else:
                    if hashing is None:  # the first chunk, or the first after skipped ones
                        hashing = hasher.submit(_stage, index, chunk, on_invalid)
                    while len(ahead) < workers:  # the next chunks hash while this one is written
                        following = next(chunks, None)
                        if following is None:
                            break
                        ahead.append((following, hasher.submit(_stage, index, following, on_invalid)))
                    staged = hashing.result()
                    for i, problem in staged.bad[: max(0, 5 - shown_invalid)]:
                        bar.write(f"skipped: {chunk.error(i, problem)}", file=log)
                        shown_invalid += 1
                    summary.invalid += len(staged.bad)
                    written = index.write(staged.batch, searchable=False)
                    summary.vectors += written.vectors
                    summary.replaced += written.replaced
                    follower.written()
                bar.update(n)
                if reader.rows is None and chunk.end_byte > 0:
                    bar.total = max(summary.rows, int(summary.rows * reader.size_bytes / chunk.end_byte))
                if summary.skipped:
                    bar.set_postfix_str(f"{summary.skipped:,} skipped", refresh=False)
                if req is not None and req.requested:
                    summary.interrupted = True
                    break
        follower.close()
        if not summary.interrupted:
            bar.set_postfix_str("building search lists and tuning the search", refresh=True)
            summary.upkeep = index.maintain(queries=tune_queries)
    finally:
        stop.set()
        follower.close()
        hasher.shutdown(wait=True, cancel_futures=True)
        chunks.close()
        bar.close()
        summary.seconds = time.perf_counter() - t0
    try:
        summary.count = index.count()
    except Exception:  # noqa: BLE001 - the build itself succeeded
        summary.count = -1
    summary.index_bytes, summary.index_bytes_kind = index_size(index)
    return summary
