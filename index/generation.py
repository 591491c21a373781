"""Generations of inverted lists over a mirror's rows: built aside, published whole.

A generation covers mirror rows ``[0, rows)`` in lists (:mod:`gmmlsh.core.ivf`): k-modes
over the first-stage rows of a sample (~:data:`SAMPLE_PER_LIST` rows a list) gives each
list its sample members, their 2-bit modes over every sample are the list's *profile*, and
every row goes to the list whose profile it agrees with best — the list a query that is
this row probes first. Queries choose lists by the same profiles. Each list keeps copies of
what the search reads of its rows, in list order: their first-stage rows laid out for a
vectorised scan (a probed list is one contiguous read), and the low :data:`RANK_BITS_MAX` bit
planes of their sketches, so that the rank pass reads its rows from the few lists just
scanned rather than from anywhere in the mirror (measured at 1M rows: 3.6× faster).
Rows added after it form the mirror's tail. When the tail grows past
:func:`tail_limit`, a new generation is built in the background: the tail's rows
are assigned to the existing profiles and merged into the lists (retired rows
dropped); when the index has doubled since the profiles were fit, they are fit
again (~``LIST_ROWS`` rows a list). A generation also carries the
*postings* of its sparse rows (coordinate → rows and values, for exact search in
proportion to the postings a query touches; where most rows are sparse, also the head
columns of the postings search, :mod:`gmmlsh.core.postings`) and the list of its dense rows
(which exact search scans). A generation's files never change; a new one is written to its own
directory and then named in the mirror's state.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gmmlsh.core.ivf import assign, assign_profiles, kmodes, list_layout, profiles
from gmmlsh.core.postings import head_columns, postings_count, postings_fill
from gmmlsh.index.columns import huge_pages, refold
from gmmlsh.index.config import RANK_BITS_MAX

#: Rows per inverted list the profiles aim for.
LIST_ROWS = 512
#: Below this many rows there are no lists: the whole index is the tail (a scan is as fast).
MIN_ROWS = 2048
#: Most rows the tail grows to before a new generation is built.
TAIL_MAX = 16384
_ARRAYS = ("profiles", "starts", "lrows", "lfirst", "lplanes", "post_starts", "post_rows", "post_vals",
           "dense_rows", "head_slot", "head_bytes", "head_nibbles", "head_scale", "norms32")
#: Listed rows copied into the list-order files at a time (the build's memory stays bounded).
_COPY_ROWS = 1 << 16
#: Rows of the k-modes sample per list (capped by :data:`SAMPLE_MAX`).
SAMPLE_PER_LIST = 64
SAMPLE_MAX = 1 << 18


@dataclass(frozen=True)
class Generation:
    """The inverted lists of mirror rows ``[0, rows)`` (arrays memory-mapped read-only)."""

    number: int
    rows: int
    clustered_rows: int
    profiles: np.ndarray  # (2 · words, lists) uint64: what rows are assigned and lists chosen by
    starts: np.ndarray  # (lists + 1,) int64
    lrows: np.ndarray  # (entries,) uint32: mirror rows, list by list
    lfirst: np.ndarray  # (entries · first-stage words,) uint64: their first-stage rows, list by list, word-major
    lplanes: np.ndarray  # (entries, RANK_BITS_MAX · words) uint64: their low bit planes, list by list
    post_starts: np.ndarray  # (dim + 1,) int64: coordinate c's postings are [post_starts[c], post_starts[c+1])
    post_rows: np.ndarray  # (postings,) uint32: the sparse rows holding each coordinate
    post_vals: np.ndarray  # (postings,) float32: their values there
    dense_rows: np.ndarray  # (dense rows,) uint32: the live dense rows
    head_slot: np.ndarray  # (dim,) int32: a coordinate's head column, or -1 (see core.postings)
    head_bytes: np.ndarray  # (columns, rows) uint8: levels of the commonest coordinates, a byte a row
    head_nibbles: np.ndarray  # (columns, ⌈rows/2⌉) uint8: those whose levels fit in 4 bits, two rows a byte
    head_scale: np.ndarray  # (1,) float32: the value of one level
    norms32: np.ndarray  # (rows,) float32 where there are postings: the rows' L1 norms, as the postings search ranks

    @property
    def postings_search(self) -> bool:
        """Whether the postings search applies: most of the generation's rows are sparse
        (text), so it has head columns."""
        return self.head_bytes.shape[0] + self.head_nibbles.shape[0] > 0

    @property
    def lists(self) -> int:
        return self.profiles.shape[1]

    @classmethod
    def load(cls, directory: Path) -> Generation:
        meta = json.loads((directory / "meta.json").read_text())
        arrays = {name: huge_pages(np.load(directory / f"{name}.npy", mmap_mode="r")) for name in _ARRAYS}
        return cls(number=meta["number"], rows=meta["rows"], clustered_rows=meta["clustered_rows"], **arrays)


def tail_limit(rows: int) -> int:
    """Tail rows past which a new generation is due."""
    return min(TAIL_MAX, max(MIN_ROWS // 2, rows // 16))


def due(rows: int, tail: int) -> bool:
    """Whether an index of ``rows`` rows with ``tail`` of them unlisted wants a new generation."""
    return rows >= MIN_ROWS and tail >= tail_limit(rows)


def build(directory: Path, view, previous: Generation | None, dim: int, bits: int, seed: int = 0) -> str:
    """Write the generation after ``previous`` for the rows of the mirror ``view`` (of vectors of
    ``dim`` dimensions sketched with ``bits``-bit codes) into a new subdirectory of
    ``directory``; returns its name (to publish in the mirror's state)."""
    alive, rows = view.alive, view.rows
    words = view.planes.shape[1] // bits
    refit = previous is None or rows >= 2 * previous.clustered_rows
    if refit:
        members = np.flatnonzero(alive[:rows])
        nlist = max(1, members.shape[0] // LIST_ROWS)
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(members, min(members.shape[0], SAMPLE_PER_LIST * nlist, SAMPLE_MAX),
                                    replace=False))
        F = np.ascontiguousarray(view.first[sample])
        P = profiles(view.planes, sample, assign(F, kmodes(F, nlist, seed=seed)), nlist, words, bits)
        del F
        labels = assign_profiles(view.planes, members, P, words, bits)
        clustered = rows
    else:
        P = previous.profiles
        keep = alive[previous.lrows] != 0
        old_labels = np.repeat(np.arange(previous.lists), np.diff(previous.starts))[keep]
        new = previous.rows + np.flatnonzero(alive[previous.rows:rows])
        members = np.concatenate([previous.lrows[keep].astype(np.int64), new])
        labels = np.concatenate([old_labels, assign_profiles(view.planes, new, P, words, bits)])
        clustered = previous.clustered_rows
    order = np.argsort(labels, kind="stable")
    lrows = members[order]
    starts = np.zeros(P.shape[1] + 1, dtype=np.int64)
    starts[1:] = np.cumsum(np.bincount(labels, minlength=P.shape[1]))
    del members, labels, order
    live = np.flatnonzero(alive[:rows])
    dense = view.vi[view.voff[live] + 1] == 0
    sparse_rows = live[~dense]
    number = 1 if previous is None else previous.number + 1
    name = f"gen-{number:06d}"
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for key, value in (("profiles", P), ("starts", starts), ("lrows", lrows.astype(np.uint32)),
                       ("dense_rows", live[dense].astype(np.uint32))):
        np.save(tmp / f"{key}.npy", value)
    _list_copies(tmp, view, lrows, starts, words, min(RANK_BITS_MAX, bits))
    del lrows
    # Postings are written straight into their files, coordinate by coordinate (two passes
    # over the rows): no in-memory copy of the sparse rows, whatever the index's size.
    post_starts = postings_count(view.voff, view.vi, sparse_rows, dim)
    np.save(tmp / "post_starts.npy", post_starts)
    post_rows, post_vals = (np.lib.format.open_memmap(tmp / f"{key}.npy", mode="w+", dtype=dtype,
                                                      shape=(int(post_starts[-1]),))
                            for key, dtype in (("post_rows", np.uint32), ("post_vals", np.float32)))
    if post_starts[-1]:
        postings_fill(view.voff, view.vi, view.vf, sparse_rows, post_starts, post_rows, post_vals)
    heads = (head_columns(post_starts, post_rows, post_vals, rows, sparse_rows.shape[0])
             if 2 * sparse_rows.shape[0] > live.shape[0] else
             (np.full(dim, -1, np.int32), np.zeros((0, rows), np.uint8), np.zeros((0, (rows + 1) // 2), np.uint8),
              np.ones(1, np.float32)))
    for key, value in zip(("head_slot", "head_bytes", "head_nibbles", "head_scale"), heads, strict=True):
        np.save(tmp / f"{key}.npy", value)
    np.save(tmp / "norms32.npy", view.norms[:rows].astype(np.float32) if post_starts[-1] else np.zeros(0, np.float32))
    del heads
    post_rows.flush()
    post_vals.flush()
    del post_rows, post_vals
    (tmp / "meta.json").write_text(json.dumps({"number": number, "rows": rows, "clustered_rows": clustered}))
    for f in tmp.iterdir():  # on disk, and cached in 2 MiB pages for the readers to come
        refold(f)
    final = directory / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return name


def _list_copies(tmp: Path, view, lrows: np.ndarray, starts: np.ndarray, words: int, planes: int) -> None:
    """Write the list-order copies of the listed rows' first-stage rows (word-major within each
    list) and low ``planes`` bit planes, a bounded number of rows at a time."""
    entries = lrows.shape[0]
    kept = planes * words
    lfirst = np.lib.format.open_memmap(tmp / "lfirst.npy", mode="w+", dtype=np.uint64,
                                       shape=(entries * view.first.shape[1],))
    lplanes = np.lib.format.open_memmap(tmp / "lplanes.npy", mode="w+", dtype=np.uint64, shape=(entries, kept))
    nlist = starts.shape[0] - 1
    c = 0
    while c < nlist:  # whole lists at a time, about _COPY_ROWS rows
        end = int(np.searchsorted(starts, starts[c] + _COPY_ROWS, side="right")) - 1
        end = min(nlist, max(end, c + 1))
        lo, hi = int(starts[c]), int(starts[end])
        part, width = lrows[lo:hi], view.first.shape[1]
        lfirst[lo * width:hi * width] = list_layout(view.first[part], starts[c:end + 1] - lo)
        lplanes[lo:hi] = view.planes[part, :kept]
        c = end
    lfirst.flush()
    lplanes.flush()
