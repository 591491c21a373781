"""Inverted lists in segments: built aside, published whole, never rewritten.

A *fit* is one set of list *profiles* (:mod:`gmmlsh.core.ivf`: k-modes over the first-stage
rows of a sample, ~:data:`LIST_ROWS` rows a list; the 2-bit modes of each list's members
over every sample are its profile) and, where the data are text-like, one choice of *head
columns* for the postings search (:mod:`gmmlsh.core.postings`). A fit lives in a directory
``lists-NNNNNN/`` of the mirror, with its *arenas*: append-only files that hold its segments.

A *segment* lists the mirror rows ``[lo, hi)``: every live row goes to the list whose profile
it agrees with best (the list a query that is this row probes first), and the segment keeps
copies of what a search reads of its rows, list by list — their first-stage rows laid out
for a vectorised scan and their low bit planes — plus the postings of its sparse rows
(coordinate → rows and values, for exact search and the postings search), their head
columns, and the list of its dense rows. A segment is written once, at the end of the
arenas, and never changed; the mirror's state names the segments a query reads. Segments
tile the rows ``[0, tail)``; rows after them form the *tail*, which a query scans whole.

**Upkeep** (:mod:`gmmlsh.index.upkeep`) keeps the cost of absorbing a row independent of the
index's size: the tail becomes a new small segment once it holds :func:`tail_limit` rows;
:data:`MERGE_FANOUT` adjacent segments of one size tier are merged into one (their list
membership is kept: a merge copies, it assigns nothing); a segment whose rows are mostly
retired is rebuilt alone. Each row is thus rewritten about once per tier, log₄ of the
index's size over the tail's. When the index has doubled since the fit, or its arenas hold
more dead segments than live ones, a new fit is made and every segment built again under
it, in the background, while queries keep reading the old one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gmmlsh.core.bundles import SEG_FIELDS, Lists, Postings, frozen
from gmmlsh.core.ivf import FIRST_WORDS, assign, assign_profiles, kmodes, list_layout, profiles
from gmmlsh.core.postings import head_levels, head_plan, postings_count, postings_fill
from gmmlsh.index.columns import Column
from gmmlsh.index.config import RANK_BITS_MAX

#: Rows per inverted list a fit aims for.
LIST_ROWS = 512
#: Below this many live rows there are no lists: the whole index is the tail (a scan is as fast).
MIN_ROWS = 2048
#: The tail becomes a segment at this many rows (every query scans the tail whole; a postings
#: search scores it exactly).
TAIL_ROWS = 1024
#: Segments of one size tier (sizes within a factor of this of each other) merged at once.
MERGE_FANOUT = 4
#: The prefix of a replaced fit's directory, and the seconds it stays on disk so named (long
#: enough for every process that queries to have loaded the new fit: see :func:`retire_fit`).
RETIRED = "retired-"
RETIRED_SECONDS = 60.0
#: A segment with more than this share of its listed rows retired is rebuilt alone.
DEAD_SHARE = 0.3
#: Rows of the k-modes sample per list (capped by :data:`SAMPLE_MAX`).
SAMPLE_PER_LIST = 64
SAMPLE_MAX = 1 << 18
#: Sparse rows the head columns are planned on (a sample).
_HEAD_SAMPLE = 1 << 16
#: Listed rows copied into list order at a time (a build's memory stays bounded).
_COPY_ROWS = 1 << 16

#: The arena files of a fit: name → (dtype, file suffix).
ARENAS = {"lrows": np.uint32, "lfirst": np.uint64, "lplanes": np.uint64, "lstarts": np.int64,
          "pstarts": np.int64, "prows": np.uint32, "pvals": np.float32, "hbytes": np.uint8,
          "hnibbles": np.uint8, "drows": np.uint32}


@dataclass(frozen=True)
class Fit:
    """One fit of the list profiles and head columns (see the module docstring)."""

    name: str
    rows: int  # mirror rows when it was made (a new fit is due when the index has doubled)
    profiles: np.ndarray  # (2 · words, lists) uint64
    planes: int  # low bit planes its lists keep a copy of (the rank pass reads at most these)
    head_slot: np.ndarray  # (dim,) int32
    head_bytes: int
    head_nibbles: int
    head_scale: float

    @property
    def lists(self) -> int:
        return self.profiles.shape[1]

    @property
    def number(self) -> int:
        return int(self.name.rsplit("-", 1)[1])

    @classmethod
    def load(cls, directory: Path) -> Fit:
        meta = json.loads((directory / "fit.json").read_text())
        return cls(name=directory.name, rows=meta["rows"], planes=meta["planes"],
                   profiles=frozen(np.load(directory / "profiles.npy")),
                   head_slot=frozen(np.load(directory / "head_slot.npy")), head_bytes=meta["head_bytes"],
                   head_nibbles=meta["head_nibbles"], head_scale=meta["head_scale"])


def fit_name(number: int) -> str:
    return f"lists-{number:06d}"


def tail_limit(rows: int) -> int:
    """Tail rows at which the tail becomes a segment."""
    return TAIL_ROWS


def lists_due(live: int) -> bool:
    """Whether an index of ``live`` live rows wants lists at all."""
    return live >= MIN_ROWS


def make_fit(directory: Path, view, number: int, bits: int, seed: int, previous: Fit | None = None) -> Fit:
    """A new fit over the live rows of ``view`` in ``directory/lists-{number}``: new profiles,
    or ``previous``'s (a repack: the same lists, fresh arenas). Returns it (its arenas empty)."""
    words = view.planes.shape[1] // bits
    live = view.live_rows()
    if previous is None:
        nlist = max(1, live.shape[0] // LIST_ROWS)
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(live, min(live.shape[0], SAMPLE_PER_LIST * nlist, SAMPLE_MAX), replace=False))
        F = np.ascontiguousarray(view.first[sample])
        P = profiles(view.planes, sample, assign(F, kmodes(F, nlist, seed=seed)), nlist, words, bits)
        slot, nbytes, scale = _head_plan(view, live, seed)
    else:
        P, slot, nbytes, scale = previous.profiles, previous.head_slot, previous.head_bytes, previous.head_scale
    name = fit_name(number)
    path = directory / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    np.save(path / "profiles.npy", P)
    np.save(path / "head_slot.npy", slot)
    columns = int(slot.max()) + 1 if (slot >= 0).any() else 0
    meta = {"rows": view.rows, "planes": min(RANK_BITS_MAX, bits), "head_bytes": nbytes,
            "head_nibbles": columns - nbytes, "head_scale": scale}
    (path / "fit.json").write_text(json.dumps(meta))
    return Fit.load(path)


def _head_plan(view, live: np.ndarray, seed: int) -> tuple[np.ndarray, int, float]:
    """The head columns of a new fit, planned on a sample of its sparse rows (none unless most
    rows are sparse): whether the postings search they serve pays is the tuner's to measure."""
    dense = view.vi[view.voff[live] + 1] == 0
    sparse = live[~dense]
    if 2 * sparse.shape[0] <= live.shape[0]:
        return _no_heads(view), 0, 1.0
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(sparse, min(sparse.shape[0], _HEAD_SAMPLE), replace=False))
    starts = postings_count(view.voff, view.vi, sample, view.dim)
    prows, pvals = np.empty(int(starts[-1]), np.uint32), np.empty(int(starts[-1]), np.float32)
    postings_fill(view.voff, view.vi, view.vf, sample, starts, prows, pvals)
    return head_plan(starts, pvals, sample.shape[0])


def _no_heads(view) -> np.ndarray:
    return np.full(view.dim, -1, np.int32)


class Arenas:
    """The arena files of one fit, mapped for reading (every process maps them shared)."""

    def __init__(self, directory: Path, fit: Fit, words: int):
        self.dir = directory
        self.fit = fit
        widths = {"lplanes": fit.planes * words}
        self.columns = {name: Column(directory / f"{name}.arena", dtype, widths.get(name, 0))
                        for name, dtype in ARENAS.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        """Each arena whole, read-only (segments name the parts written; room reserved past them
        may not be written yet)."""
        return {name: frozen(col.whole()) for name, col in self.columns.items()}


class ArenaWriter:
    """Writes segments into the arenas of a fit: ``allocate(sizes) → offsets`` reserves room at
    their ends (through the mirror's state for a published fit, or locally for one being made).

    What it hands out is written back to the disk a piece at a time once filled (when the region
    after the next is asked for: the postings' rows and values are asked for together, then
    filled; or at the segment's end), by :func:`~gmmlsh.index.columns.write_back`: a fit's
    gigabytes go out as they are made, not in one burst at the next checkpoint."""

    def __init__(self, directory: Path, fit: Fit, words: int, allocate: Callable[[dict], dict]):
        self.dir = directory
        self.fit = fit
        self.words = words
        self.allocate = allocate
        widths = {"lplanes": fit.planes * words}
        self.columns = {name: Column(directory / f"{name}.arena", dtype, widths.get(name, 0))
                        for name, dtype in ARENAS.items()}
        self._handed: list[tuple[str, int, int]] = []  # regions handed out and not yet written back

    def region(self, name: str, offset: int, count: int) -> np.ndarray:
        """Writable values ``[offset, offset + count)`` of an arena (room made, a mapping); the
        regions handed out before the last one are written back first."""
        self.write_back(keep=1)
        self._handed.append((name, offset, offset + count))
        return self.columns[name].reserve(offset + count)[offset:offset + count]

    def write_back(self, keep: int = 0) -> None:
        """Write back the regions handed out, but for the last ``keep`` (0: all, a segment's end)."""
        done = self._handed[:len(self._handed) - keep]
        for name, lo, hi in done:
            self.columns[name].write_back(lo, hi)
        del self._handed[:len(done)]


def local_allocator(ends: dict[str, int]) -> Callable[[dict], dict]:
    """An allocator at the ends ``ends`` (updated in place): for a fit no other process writes."""
    def allocate(sizes: dict) -> dict:
        out = {}
        for name, size in sizes.items():
            out[name] = ends.get(name, 0)
            ends[name] = out[name] + int(size)
        return out
    return allocate


def build_segment(writer: ArenaWriter, view, lo: int, hi: int, live: np.ndarray | None = None,
                  labels: np.ndarray | None = None) -> dict:
    """Write the segment of mirror rows ``[lo, hi)`` of ``view``: its ``live`` rows (by default
    those live now) assigned to the fit's lists (or to ``labels``, one per live row: a merge keeps
    the lists rows were in), their list-order copies, their postings and head columns, its dense
    rows. Returns its record (what the mirror's state keeps). A row retired while this runs is
    listed all the same: its live flag keeps it out of answers until a merge drops it."""
    fit, words = writer.fit, writer.words
    bits = view.planes.shape[1] // words
    if live is None:
        live = view.live_rows(lo, hi)
    if labels is None:
        labels = assign_profiles(view.planes, live, fit.profiles, words, bits)
    order = np.argsort(labels, kind="stable")
    lrows = live[order]
    starts = np.zeros(fit.lists + 1, dtype=np.int64)
    starts[1:] = np.cumsum(np.bincount(labels, minlength=fit.lists))
    del order, labels
    dense = view.vi[view.voff[live] + 1] == 0
    drows = live[dense]
    sparse = live[~dense]
    dim = view.dim
    pcount = postings_count(view.voff, view.vi, sparse, dim)
    n, entries, npost = hi - lo, lrows.shape[0], int(pcount[-1])
    half = (n + 1) // 2
    sizes = {"lrows": entries, "lfirst": entries * FIRST_WORDS, "lplanes": entries, "lstarts": fit.lists + 1,
             "pstarts": dim + 1, "prows": npost, "pvals": npost, "hbytes": fit.head_bytes * n,
             "hnibbles": fit.head_nibbles * half, "drows": drows.shape[0]}
    at = writer.allocate(sizes)
    e0 = at["lrows"]
    if at["lfirst"] != e0 * FIRST_WORDS or at["lplanes"] != e0:  # the kernels address all three by entry
        raise RuntimeError("segments: the list arenas are out of step")
    writer.region("lrows", e0, entries)[:] = lrows
    writer.region("lstarts", at["lstarts"], fit.lists + 1)[:] = e0 + starts
    _list_copies(writer, view, lrows, starts, at["lfirst"], at["lplanes"])
    writer.region("pstarts", at["pstarts"], dim + 1)[:] = at["prows"] + pcount
    if npost:
        prows, pvals = writer.region("prows", at["prows"], npost), writer.region("pvals", at["pvals"], npost)
        postings_fill(view.voff, view.vi, view.vf, sparse, pcount, prows, pvals)
        if fit.head_bytes + fit.head_nibbles:
            hb, hn = head_levels(fit.head_slot, fit.head_bytes, fit.head_scale, pcount, prows, pvals, lo, n)
            writer.region("hbytes", at["hbytes"], hb.size)[:] = hb.ravel()
            writer.region("hnibbles", at["hnibbles"], hn.size)[:] = hn.ravel()
    elif fit.head_bytes + fit.head_nibbles:  # no sparse rows: every level 0
        writer.region("hbytes", at["hbytes"], sizes["hbytes"])[:] = 0
        writer.region("hnibbles", at["hnibbles"], sizes["hnibbles"])[:] = 0
    writer.region("drows", at["drows"], drows.shape[0])[:] = drows
    writer.write_back()
    return {"lo": lo, "hi": hi, "e": e0, "n": entries, "ls": at["lstarts"], "ps": at["pstarts"], "p": at["prows"],
            "np": npost, "hb": at["hbytes"], "hn": at["hnibbles"], "d": at["drows"], "nd": int(drows.shape[0])}


def _list_copies(writer: ArenaWriter, view, lrows: np.ndarray, starts: np.ndarray, f0: int, p0: int) -> None:
    """The list-order copies of the listed rows' first-stage rows (word-major within each list)
    and low bit planes, whole lists of about :data:`_COPY_ROWS` rows at a time."""
    kept = writer.fit.planes * writer.words
    nlist = starts.shape[0] - 1
    c = 0
    while c < nlist:
        end = int(np.searchsorted(starts, starts[c] + _COPY_ROWS, side="right")) - 1
        end = min(nlist, max(end, c + 1))
        lo, hi = int(starts[c]), int(starts[end])
        if hi > lo:
            part = lrows[lo:hi]
            writer.region("lfirst", f0 + lo * FIRST_WORDS, (hi - lo) * FIRST_WORDS)[:] = list_layout(
                view.first[part], starts[c:end + 1] - lo)
            writer.region("lplanes", p0 + lo, hi - lo)[:] = view.planes[part, :kept]
        c = end


def labels_of(arrays: dict, segments: list[dict], nlist: int) -> tuple[np.ndarray, np.ndarray]:
    """(listed rows, their lists) of ``segments``, rows ascending: what a merge keeps."""
    rows, labels = [], []
    for seg in segments:
        starts = np.asarray(arrays["lstarts"][seg["ls"]:seg["ls"] + nlist + 1]) - seg["e"]
        rows.append(np.asarray(arrays["lrows"][seg["e"]:seg["e"] + seg["n"]], dtype=np.int64))
        labels.append(np.repeat(np.arange(nlist), np.diff(starts)))
    r, lab = np.concatenate(rows), np.concatenate(labels)
    order = np.argsort(r, kind="stable")
    return r[order], lab[order]


def merged_labels(view, arrays: dict, segments: list[dict], nlist: int) -> tuple[np.ndarray, np.ndarray]:
    """(the live rows of ``segments`` — adjacent, in order —, the list each was in): what a merge
    of them keeps. Every live row is listed (rows are listed live, and never come back to life)."""
    rows, labels = labels_of(arrays, segments, nlist)
    lo, hi = segments[0]["lo"], segments[-1]["hi"]
    live = view.live_rows(lo, hi)
    pos = np.minimum(np.searchsorted(rows, live), max(0, rows.shape[0] - 1))
    if rows.shape[0] == 0 and live.shape[0] or not np.array_equal(rows[pos], live):
        raise RuntimeError("segments: a live row is in no list")
    return live, labels[pos]


def seg_matrix(segments: list[dict]) -> np.ndarray:
    """The kernels' ``segs`` (see :mod:`gmmlsh.core.bundles`) of segment records."""
    out = np.empty((len(segments), SEG_FIELDS), dtype=np.int64)
    for s, g in enumerate(segments):
        out[s] = (g["lo"], g["hi"], g["e"], g["e"] + g["n"], g["ls"], g["ps"], g["hb"], g["hn"], g["d"],
                  g["d"] + g["nd"])
    return frozen(out)


def size_of(seg: dict, fit: Fit, dim: int) -> int:
    """Values a segment takes in the arenas (dead once it is merged away)."""
    n = seg["hi"] - seg["lo"]
    return (seg["n"] * (2 + FIRST_WORDS) + fit.lists + 1 + dim + 1 + 2 * seg["np"] + fit.head_bytes * n
            + fit.head_nibbles * ((n + 1) // 2) + seg["nd"])


def tier(rows: int) -> int:
    """A segment's size tier: sizes within a factor of :data:`MERGE_FANOUT` share one."""
    return int(math.log(max(rows, TAIL_ROWS) / TAIL_ROWS, MERGE_FANOUT))


def merge_plan(segments: list[dict]) -> tuple[int, int] | None:
    """The segments ``[i, j)`` to merge next, or None: the lowest tier's newest run of at least
    :data:`MERGE_FANOUT` adjacent segments of one tier."""
    tiers = [tier(s["hi"] - s["lo"]) for s in segments]
    best = None
    j = len(segments)
    while j > 0:
        i = j - 1
        while i > 0 and tiers[i - 1] == tiers[j - 1]:
            i -= 1
        if j - i >= MERGE_FANOUT and (best is None or tiers[i] < tiers[best[0]]):
            best = (i, j)
        j = i
    return best


def dead_segment(segments: list[dict], alive: np.ndarray) -> int | None:
    """A segment most of whose listed rows are retired (:data:`DEAD_SHARE`), or None."""
    for s, seg in enumerate(segments):
        if seg["n"] and 1 - int(alive[seg["lo"]:seg["hi"]].sum()) / seg["n"] > DEAD_SHARE:
            return s
    return None


def bundles(arenas: Arenas | None, state: dict | None, rows: int, profiles_words: int
            ) -> tuple[Lists, Postings]:
    """The :class:`Lists` and :class:`Postings` bundles of a published lists state over mirror rows
    ``[0, rows)`` (no fit yet: no segments, every row in the tail)."""
    if arenas is None or state is None:
        segs = frozen(np.zeros((0, SEG_FIELDS), np.int64))
        tail_lo = 0
        empty = {name: frozen(np.zeros(0, dtype)) for name, dtype in ARENAS.items()}
        empty["lplanes"] = frozen(np.zeros((0, 1), np.uint64))
        profiles_ = frozen(np.zeros((2 * profiles_words, 0), np.uint64))
        slot, hbytes, hnibbles, scale = frozen(np.zeros(0, np.int32)), 0, 0, 1.0
        a = empty
    else:
        segs = seg_matrix(state["segments"])
        tail_lo = int(segs[-1, 1]) if segs.shape[0] else 0
        a = arenas.arrays()
        fit = arenas.fit
        profiles_, slot, hbytes, hnibbles, scale = (fit.profiles, fit.head_slot, fit.head_bytes,
                                                    fit.head_nibbles, fit.head_scale)
    lists = Lists(profiles_, segs, a["lstarts"], a["lrows"], a["lfirst"], a["lplanes"], tail_lo, rows)
    post = Postings(segs, a["pstarts"], a["prows"], a["pvals"], a["hbytes"], a["hnibbles"], a["drows"], slot,
                    hbytes, hnibbles, float(scale), tail_lo, rows)
    return lists, post


def remove_fit(directory: Path) -> None:
    """Delete a fit no process maps (one built but never published)."""
    shutil.rmtree(directory, ignore_errors=True)


def retire_fit(directory: Path) -> None:
    """Put aside a fit no state names any more: renamed (``retired-…``), so no process opens it
    again, and deleted by :func:`delete_retired` once the processes that map it have moved on.
    Deleted at once, its files would be freed by whichever process unmaps them last: a query
    process dropping its old view (~0.2 ms per MB of the fit, measured: 86 ms for 400 MB)."""
    target = directory.with_name(RETIRED + directory.name)
    shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(directory, target)
        os.utime(target)  # when it was retired
    except FileNotFoundError:
        pass


def delete_retired(directory: Path, after: float = RETIRED_SECONDS) -> None:
    """Delete the fits retired more than ``after`` seconds ago (upkeep calls it now and then)."""
    for path in directory.glob(RETIRED + "lists-*"):
        with contextlib.suppress(FileNotFoundError):
            if time.time() - path.stat().st_mtime > after:
                shutil.rmtree(path, ignore_errors=True)


def is_fit_dir(name: str) -> bool:
    """Whether a mirror entry is a fit's directory: published, retired, or being built."""
    return name.startswith(("lists-", ".lists-", RETIRED))


def sweep(directory: Path, keep: set[str]) -> None:
    """Retire the fits no state names, delete leftovers of interrupted builds and fits retired
    long enough ago."""
    for path in directory.glob("lists-*"):
        if path.name not in keep:
            retire_fit(path)
    for path in directory.glob(".lists-*"):
        shutil.rmtree(path, ignore_errors=True)
    delete_retired(directory)
