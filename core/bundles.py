"""The named bundles of arrays the search kernels take: one argument per concept.

A kernel reads a search mirror (:mod:`gmmlsh.index.mirror`) through three bundles, built
once per published state of the mirror and reused by every query until the next:

* :class:`Rows`: every mirror row's columns (vectors, norms, sketches, live flags);
* :class:`Lists`: the inverted lists over the rows, in *segments* (below) and the rows
  no segment holds yet (the *tail*, scanned whole);
* :class:`Postings`: the postings of the segments' sparse rows (coordinate → rows and
  values) and the head columns of their commonest coordinates.

A query enters as a :class:`Query` and a search's knobs as a :class:`Budget`. numba
caches kernels taking named tuples like any other: adding a column is one field here.

**Segments.** Rows are listed in segments: runs of mirror rows ``[lo, hi)``, each built once
(its rows assigned to the lists of one shared set of *profiles*) and never changed after;
new rows make new small segments, and small segments are merged into bigger ones, so that
absorbing a row costs the same at any size. All segments of one fit of the profiles live
in one set of append-only *arena* arrays; a segment is a row of ``segs`` giving its row
range and where its parts lie in the arenas (the ``SEG_*`` columns).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: Columns of a segment's row in ``segs`` (int64): its mirror rows ``[LO, HI)``; its list
#: entries ``[E_LO, E_HI)`` of the list arenas and where its ``lists + 1`` list starts begin
#: in ``lstarts``; where its ``dim + 1`` postings starts begin in ``pstarts``; where its head
#: columns begin in ``hbytes`` and ``hnibbles``; its dense rows ``[D_LO, D_HI)`` of ``drows``.
SEG_LO, SEG_HI, SEG_E_LO, SEG_E_HI, SEG_LSTARTS, SEG_PSTARTS, SEG_HBYTES, SEG_HNIBBLES, SEG_D_LO, SEG_D_HI = range(10)
SEG_FIELDS = 10


class Rows(NamedTuple):
    """Row-indexed columns of the mirror, rows ``[0, n)``.

    ``voff``/``vi``/``vf``: the vectors as GMM sees them. Row ``r`` starts at word ``voff[r]``
    of the data (``vi`` and ``vf`` are its uint32 and float32 views: indices read as unsigned
    spare numba's wrap-around checks) with two header words,
    ``count`` and ``kind``: kind 0 is dense (``count`` float32 values follow), kind 1 sparse
    (``count`` int32 indices, then ``count`` float32 values). ``coff``/``cdata``: the coarse rows
    (:mod:`gmmlsh.core.coarse`). ``planes``: the sketches' bit planes; ``first``: their
    first-stage rows (:mod:`gmmlsh.core.ivf`). ``alive``: 0 for a retired vector (it stays until
    the segments holding it are merged or rebuilt)."""

    alive: np.ndarray  # (n,) uint8
    norms: np.ndarray  # (n,) float64: L1 norms
    norms32: np.ndarray  # (n,) float32: the same, for ranking
    planes: np.ndarray  # (n, bits · words) uint64
    first: np.ndarray  # (n, FIRST_WORDS) uint64
    voff: np.ndarray  # (n + 1,) int64
    vi: np.ndarray  # uint32 view of the vector data
    vf: np.ndarray  # float32 view of the vector data
    coff: np.ndarray  # (n + 1,) int64
    cdata: np.ndarray  # uint8
    dim: int


class Lists(NamedTuple):
    """The inverted lists: ``profiles`` (``(2 · words, lists)``: what queries choose lists by)
    and the segments (``segs``, see the module docstring). List ``c`` of segment ``s`` holds the
    arena entries ``[lstarts[segs[s, SEG_LSTARTS] + c], lstarts[segs[s, SEG_LSTARTS] + c + 1])``:
    their mirror rows in ``lrows``, their first-stage rows word by word in ``lfirst``
    (:func:`gmmlsh.core.ivf.list_layout`), their low bit planes in ``lplanes``. Mirror rows
    ``[tail_lo, tail_hi)`` are in no segment: the tail."""

    profiles: np.ndarray  # (2 · words, lists) uint64
    segs: np.ndarray  # (segments, SEG_FIELDS) int64
    lstarts: np.ndarray  # int64 arena
    lrows: np.ndarray  # uint32 arena
    lfirst: np.ndarray  # uint64 arena (FIRST_WORDS words an entry)
    lplanes: np.ndarray  # (entries, planes · words) uint64 arena
    tail_lo: int
    tail_hi: int


class Postings(NamedTuple):
    """The segments' sparse rows by coordinate, and the head columns of the postings search
    (:mod:`gmmlsh.core.postings`). Segment ``s``'s postings of coordinate ``t`` are
    ``[pstarts[segs[s, SEG_PSTARTS] + t], … + t + 1]`` of ``prows``/``pvals`` (rows ascending);
    its head columns are ``(bytes, hi − lo)`` levels in ``hbytes`` from ``segs[s, SEG_HBYTES]``
    and ``(nibbles, ⌈(hi − lo)/2⌉)`` packed levels in ``hnibbles`` from ``segs[s, SEG_HNIBBLES]``;
    ``drows[segs[s, SEG_D_LO]:segs[s, SEG_D_HI]]`` are its dense rows. ``head_slot``
    (``(dim,)``: a coordinate's head column or −1), the counts of byte and packed head columns
    and ``head_scale`` (the value of one level) are shared by all segments of a fit."""

    segs: np.ndarray  # (segments, SEG_FIELDS) int64 (the same as Lists.segs)
    pstarts: np.ndarray  # int64 arena
    prows: np.ndarray  # uint32 arena
    pvals: np.ndarray  # float32 arena
    hbytes: np.ndarray  # uint8 arena
    hnibbles: np.ndarray  # uint8 arena
    drows: np.ndarray  # uint32 arena
    head_slot: np.ndarray  # (dim,) int32
    head_bytes: int  # head columns of a byte a row (slots [0, head_bytes))
    head_nibbles: int  # packed head columns (the slots after)
    head_scale: float
    tail_lo: int
    tail_hi: int


class Query(NamedTuple):
    """One query as the kernels take it: its sketch (``planes``, ``first``; empty where the search
    needs none), the vector GMM sees as a dense float64 buffer of the full dimension (zero where
    it is zero: a sparse stored row costs one gather per nonzero), its L1 norm, and the mirror
    row left out of its answer (its own, for a query by id; −1 for none)."""

    planes: np.ndarray  # (bits · words,) uint64
    first: np.ndarray  # (FIRST_WORDS,) uint64
    dense: np.ndarray  # (dim,) float64
    norm: float
    exclude: int


class Budget(NamedTuple):
    """How much a sketch search reads (:class:`gmmlsh.index.config.SearchParams`, resolved):
    ``probes`` lists of every segment (all: ≥ their number), the ``shortlist`` best by first-stage
    agreement ranked on ``rank_planes`` bit planes, the ``candidates`` best of those ranked by
    coarse GMM, the ``refine`` best of those scored exactly (0: the candidates unscored).
    ``words``: 64-sample words of a plane; ``two``: whether codes have a second bit."""

    words: int
    two: bool
    probes: int
    shortlist: int
    rank_planes: int
    candidates: int
    refine: int


def frozen(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array``: every bundle holds read-only arrays, so that a kernel is
    compiled once for them whether they come from a file mapping or from memory."""
    out = array.view()
    out.flags.writeable = False
    return out
