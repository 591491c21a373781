"""The query path, one skeleton for single and batch queries:

    query → (sketch planes, dense buffer) → one search (sketch, postings, exact or NRFF)
    over the mirror's bundles → exact similarities → top k → names

All of it reads the mirror (:mod:`gmmlsh.index.mirror`); nothing here touches the
store. The kernels are :mod:`gmmlsh.core.search`'s and :mod:`gmmlsh.core.postings`'.
:func:`run` is the one dispatcher from a mode to a search.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import orjson
import scipy.sparse as sp

from gmmlsh.core import nrff
from gmmlsh.core.bundles import Budget, Query
from gmmlsh.core.codes import bit_planes
from gmmlsh.core.gcws import table_fits
from gmmlsh.core.gmm import l1_norm, l1_norms
from gmmlsh.core.ivf import FIRST_WORDS, first_rows
from gmmlsh.core.parallel import spread
from gmmlsh.core.postings import exact_postings, postings_search
from gmmlsh.core.search import bound_sums, exact_block, exact_scan, row_cosine, search
from gmmlsh.core.select import GROUP, top_k
from gmmlsh.core.validate import VectorError
from gmmlsh.index.config import DEFAULT_K, DEFAULT_RARE, RANK_BITS_MAX, IndexConfig, SearchParams
from gmmlsh.index.mirror import View
from gmmlsh.index.records import SparseRow, as_hashed, codes_of, mirror_row, planes_of
from gmmlsh.results import Neighbor, QueryResult

#: Modes a query may ask for: ``auto`` lets the index choose (what its tuning found cheapest
#: at its recall target); the others name a search. ``lsh`` is ``auto``'s former name.
MODES = ("auto", "sketch", "postings", "exact", "nrff")
MODE_ALIASES = {"lsh": "auto"}


_NO_PLANES = np.zeros(0, np.uint64)
_NO_FIRST = np.zeros(FIRST_WORDS, np.uint64)


@dataclass
class Prepared:
    """A query ready for the kernels: :attr:`q` is its :class:`~gmmlsh.core.bundles.Query`;
    ``nonzero``, its nonzero coordinates where known (sparse input)."""

    q: Query
    nonzero: np.ndarray | None = None

    @property
    def exclude(self) -> int:
        return self.q.exclude

    def coordinates(self) -> np.ndarray:
        """The query's nonzero coordinates (int32, as a sparse query's indices: one compiled
        postings kernel for both)."""
        return self.nonzero if self.nonzero is not None else np.flatnonzero(self.q.dense).astype(np.int32)

    def excluding(self, row: int) -> Prepared:
        return replace(self, q=self.q._replace(exclude=row))


def _query(planes, first, dense, norm, exclude=-1) -> Query:
    return Query(_NO_PLANES if planes is None else planes, _NO_FIRST if first is None else first, dense,
                 float(norm), int(exclude))


_BUFFERS = threading.local()


@contextlib.contextmanager
def sparse_query(row: SparseRow, config: IndexConfig):
    """A one-row sparse query prepared for a search that needs no sketch (postings, exact),
    its dense buffer this thread's own, borrowed for the duration: zeros of the full
    dimension cost page faults per query (a third of a text query's preparation), so the
    buffer is kept and only the query's coordinates are set, then cleared."""
    buf = getattr(_BUFFERS, "dense", None)
    if buf is None or buf.shape[0] != config.dim:
        buf = _BUFFERS.dense = np.zeros(config.dim)
    buf[row.indices] = row.values
    try:
        yield Prepared(_query(None, None, buf, l1_norm(row.values)), nonzero=row.indices)
    finally:
        buf[row.indices] = 0.0


def prepare_vectors(X32, config: IndexConfig, sketch: bool = True, codes: np.ndarray | None = None
                    ) -> list[Prepared]:
    """Validated rows at stored precision (dense 2-D, CSR or a :class:`SparseRow`) → prepared
    queries; hashed only if ``sketch`` (brute force needs no sketch, and hashing a sparse query
    costs ~1 ms), unless their ``codes`` are given (:func:`query_codes`, checked by the caller).
    A sparse row of a dimension whose hashing table fits is prepared dense: hashed by one compiled
    call, where its own path made one a step (a strokes query at 1M: 167 → 117 µs to prepare)."""
    if isinstance(X32, SparseRow):
        X32 = X32.dense() if table_fits(config.dim, config.samples) else X32.csr()
    Xh = as_hashed(X32, config)
    n = Xh.shape[0]
    planes = first = [None] * n
    if sketch:
        planes = bit_planes(codes, config.bits) if codes is not None else planes_of(Xh, config)
        first = first_rows(planes, planes.shape[1] // config.bits, config.bits)
    if sp.issparse(Xh):  # scattered into zeros: scipy's toarray costs more than the query's nonzeros
        dense = np.zeros(Xh.shape)
        nonzero = [Xh.indices[Xh.indptr[i]:Xh.indptr[i + 1]] for i in range(n)]
        norms = np.empty(n)
        for i in range(n):
            values = Xh.data[Xh.indptr[i]:Xh.indptr[i + 1]]
            dense[i, nonzero[i]] = values
            norms[i] = l1_norm(values)
    else:
        dense, nonzero = np.array(Xh, dtype=np.float64), [None] * n
        norms = l1_norms(dense)
    return [Prepared(_query(planes[i], first[i], dense[i], norms[i]), nonzero=nonzero[i]) for i in range(n)]


def query_codes(X32, config: IndexConfig) -> np.ndarray:
    """The b-bit codes ``(n, samples)`` uint16 of validated query rows (dense 2-D or CSR), as
    :func:`prepare_vectors` would make them: a router hashes a query once for every group."""
    return np.asarray(codes_of(as_hashed(X32, config), config), dtype=np.uint16)


def check_codes(codes, n: int, config: IndexConfig) -> np.ndarray:
    """Codes given with ``n`` queries, checked against the index: ``(n, samples)`` whole numbers
    below ``2**bits`` (as uint16), else a :class:`VectorError` naming ``codes``."""
    c = np.asarray(codes)
    if c.shape != (n, config.samples) or c.dtype.kind not in "ui":
        raise VectorError("codes", f"expected {n} × {config.samples} whole numbers (the index's samples), got "
                          f"shape {c.shape} of {c.dtype}")
    if c.size and (int(c.min()) < 0 or int(c.max()) >= 1 << config.bits):
        raise VectorError("codes", f"codes are {config.bits}-bit: between 0 and {(1 << config.bits) - 1}")
    return c.astype(np.uint16, copy=False)


def prepare_row(view: View, row: int, config: IndexConfig) -> Prepared:
    """A stored vector as a query (its own row excluded), from the mirror alone."""
    dense = mirror_row(view.voff, view.vi, view.vf, row, config.dim)
    return Prepared(_query(np.array(view.planes[row]), np.array(view.first[row]), dense, view.norms[row], row))


def refine_count(k: int) -> int:
    """Candidates scored by exact GMM for a top-``k`` answer, the best by coarse GMM: the ``k``
    and as many again (at least 10) for the few thousandths the coarse ranking may be off by."""
    return k + max(k, 10)


def budget(view: View, params: SearchParams, config: IndexConfig, k: int = DEFAULT_K, scored: bool = True) -> Budget:
    """The sketch search's knobs for the kernels (``scored`` False: candidates unscored)."""
    words = view.planes.shape[1] // config.bits
    return Budget(words, config.bits >= 2, params.probes if params.probes > 0 else 1 << 30, params.shortlist,
                  max(1, min(params.rank_bits, RANK_BITS_MAX, config.bits)), params.candidates,
                  refine_count(k) if scored else 0)


def run_sketch(view: View, queries: list[Prepared], params: SearchParams, config: IndexConfig, k: int = DEFAULT_K,
               scored: bool = True) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(rows, exact similarities, candidates ranked by GMM) of each query: its candidates' best
    :func:`refine_count` by coarse GMM, scored exactly. With ``scored`` False, every candidate
    unscored (similarity 0): which rows a setting reaches, at a fraction of its cost (the
    tuner's recall trials). A batch is spread over the cores."""
    b = budget(view, params, config, k, scored)

    def some(lo: int, hi: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
        out = []
        rows, sims = np.empty(params.candidates, np.int64), np.empty(params.candidates)
        for p in queries[lo:hi]:
            n, _, ranked = search(p.q, view.row_bundle, view.lists, b, rows, sims)
            out.append((rows[:n].copy(), sims[:n].copy(), int(ranked)))
        return out

    return [f for part in spread(some, len(queries), len(queries) << 20) for f in part]


def run_exact(view: View, p: Prepared, k: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, exact similarities, rows scored) by brute force, the ground truth.

    Sparse rows in segments are scored through their postings (rows sharing no coordinate
    with the query score 0 and are left out, unless fewer than ``k`` others remain); dense
    rows and the tail, row by row. Where most values are in dense rows, every row is scored
    row by row: the postings would spare little.
    """
    if not _postings_pay(view):
        return _exact_scan(view, p)
    n = view.rows
    scratch = _scratch(n)
    rows, sims = np.empty(n, np.int64), np.empty(n)
    m = exact_postings(p.q, p.coordinates(), view.row_bundle, view.postings, scratch.acc, scratch.seen, rows, sims)
    rows, sims = rows[:m], sims[:m]
    live = view.live - (0 <= p.exclude < n and bool(view.alive[p.exclude]))
    if m < min(k, live):  # rows sharing nothing with the query (similarity 0) fill the answer
        zero = np.setdiff1d(view.live_rows(), np.append(rows, p.exclude))[:k - m]
        rows, sims = np.concatenate([rows, zero]), np.concatenate([sims, np.zeros(zero.shape[0])])
    return rows, sims, live


def exact_loaded(view: View) -> bool:
    """Whether this process has run the kernel :func:`run_exact` uses on ``view``: until then
    its first call also loads or compiles it (seconds on a cold cache), and times nothing."""
    return bool((exact_postings if _postings_pay(view) else exact_scan).signatures)


def run_postings(view: View, p: Prepared, params: SearchParams) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, exact similarities, rows scored) of the postings search (:mod:`gmmlsh.core.postings`):
    the segments' sparse rows ranked on the head columns and the postings of coordinates held
    by at most ``params.rare`` of a segment's rows, the best ``params.candidates`` scored
    exactly; their dense rows and the tail scored exactly (as exact search does)."""
    if not view.has_postings:
        return _exact_scan(view, p)
    share = params.rare if params.rare > 0 else DEFAULT_RARE
    room = params.candidates + sum(s["nd"] for s in view.segments) + view.rows - view.tail_start
    rows, sims = np.empty(room, np.int64), np.empty(room)
    levels = _scratch(view.tail_start + GROUP).levels
    m = postings_search(p.q, p.coordinates(), view.row_bundle, view.postings, share, params.candidates, levels,
                        rows, sims)
    return rows[:m], sims[:m], m


#: Bytes of similarities a batch of exact queries holds at a time (rows are scored in blocks).
_EXACT_BLOCK_BYTES = 32 << 20
#: Rows of the first step of :func:`_exact_block`, scored whole to give each query a floor.
_FIRST_STEP = 8192
#: How far under a query's ``k``-th best so far its floor is set: far above the rounding of a
#: similarity (~1e-15), so that no row that ties the ``k``-th is left out.
_FLOOR_SLACK = 1e-9
#: Queries of a batch timed on each exact path before the faster takes the rest.
_PROBE_QUERIES = 4


def run_exact_many(view: View, qs: list[Prepared], k: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """:func:`run_exact` for a batch, each answer cut to its best ``k`` rows and those tied
    with the ``k``-th (the similarities equal run_exact's; among tied rows the order may differ).

    Two paths, chosen by what they cost on this data: rows scored in blocks against all the
    queries at once (each row read once for the batch, compared with every query in one
    vectorised pass), or query by query through postings (text, where a query's words touch
    few of the stored values). Where the mirror has postings, a few queries are timed on
    each path and the faster answers the rest.
    """
    if not qs:
        return []
    if k >= 1 and not _postings_pay(view):
        return _exact_block(view, qs, k)
    if k < 1 or len(qs) < 2 * _PROBE_QUERIES:
        return [run_exact(view, q, k) for q in qs]
    head = qs[:_PROBE_QUERIES]
    t0 = time.perf_counter()
    by_postings = [_cut(run_exact(view, q, k), k) for q in head]
    t1 = time.perf_counter()
    by_blocks = _exact_block(view, qs[_PROBE_QUERIES:2 * _PROBE_QUERIES], k)
    t2 = time.perf_counter()
    rest = qs[2 * _PROBE_QUERIES:]
    if t2 - t1 <= t1 - t0:
        return by_postings + by_blocks + _exact_block(view, rest, k)
    return by_postings + by_blocks + [_cut(run_exact(view, q, k), k) for q in rest]


def _postings_pay(view: View) -> bool:
    """Whether exact search may go through the postings: the mirror has them, and they hold most
    of its values (words of the vectors column in sparse rows of segments)."""
    posted = 2 * sum(s["np"] for s in view.segments)
    return view.has_postings and 2 * posted >= int(view.voff[view.rows])


def _cut(found: tuple[np.ndarray, np.ndarray, int], k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """An exact answer cut to its best ``k`` rows and those tied with the ``k``-th."""
    rows, sims, scored = found
    if sims.shape[0] > k:
        keep = sims >= np.partition(sims, -k)[-k]
        rows, sims = rows[keep], sims[keep]
    return rows, sims, scored


def _exact_block(view: View, qs: list[Prepared], k: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Every query against every row, the rows in steps: after a step each query's ``k``-th best
    so far (less :data:`_FLOOR_SLACK`) is its floor, and the next steps leave out the dense rows
    whose GMM bound is below it (:func:`~gmmlsh.core.search.exact_block`). The first step is
    short, so that most rows meet a floor."""
    if not qs:
        return []
    n, m = view.rows, len(qs)
    Q = np.stack([p.q.dense for p in qs])
    QT = np.ascontiguousarray(Q.T)
    qn = np.array([p.q.norm for p in qs])
    qsums = bound_sums(Q)
    exclude = np.array([p.exclude for p in qs], dtype=np.int64)
    floor = np.zeros(m)
    best = [np.zeros(0) for _ in qs]  # each query's k best similarities so far
    step = max(1024, _EXACT_BLOCK_BYTES // (8 * m))
    out = np.empty((m, min(step, max(n, 1))))  # whole (C-contiguous) for every block; the last fills part
    kept: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in qs]
    lo = 0
    while lo < n:
        hi = min(n, lo + (step if lo else min(step, _FIRST_STEP)))
        spread(lambda a, b, lo=lo: exact_block(Q, QT, qn, exclude, view.row_bundle, lo + a, lo + b, out[:, a:b],
                                               qsums, floor), hi - lo, int(view.voff[hi] - view.voff[lo]) * m)
        for j in range(m):
            sims = out[j, :hi - lo]
            keep = np.flatnonzero(sims >= floor[j])  # retired and pruned rows are below any floor
            if keep.shape[0] > k:
                keep = keep[sims[keep] >= np.partition(sims[keep], -k)[-k]]
            kept[j].append((keep + lo, sims[keep]))
            best[j] = np.concatenate([best[j], sims[keep]])
            if best[j].shape[0] >= k:
                best[j] = np.partition(best[j], -k)[-k:]
                floor[j] = max(floor[j], best[j][0] - _FLOOR_SLACK)
        lo = hi
    found = []
    for j, p in enumerate(qs):
        rows = np.concatenate([r for r, _ in kept[j]])
        sims = np.concatenate([s for _, s in kept[j]])
        found.append(_cut((rows, sims, view.live - (0 <= p.exclude < n and bool(view.alive[p.exclude]))), k))
    return found


def _exact_scan(view: View, p: Prepared) -> tuple[np.ndarray, np.ndarray, int]:
    n = view.rows
    sims = np.empty(n)
    spread(lambda lo, hi: exact_scan(p.q.dense, p.q.norm, p.exclude, view.row_bundle, lo, hi, sims[lo:hi]), n,
           int(view.voff[n]))
    rows = np.flatnonzero(sims >= 0)
    return rows, sims[rows], int(rows.shape[0])


_SCRATCH = threading.local()


def _scratch(rows: int):
    """Per-thread buffers of one slot per row: exact search's accumulators (zero, kept zero by
    the kernels) and the postings search's levels (a query's own allocation of that size costs
    page faults)."""
    s = getattr(_SCRATCH, "s", None)
    if s is None or s.acc.shape[0] < rows + 64:
        size = max(rows, 1024) * 2
        s = _SCRATCH.s = SimpleNamespace(acc=np.zeros(size), seen=np.zeros(size, np.uint8),
                                         levels=np.empty(size, np.uint16))
    return s


def run_nrff(view: View, p: Prepared, config: IndexConfig, budget_: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Stored NRFF features ranked by estimated RBF, the best ``budget_`` scored by the exact RBF."""
    if view.nrff is None:
        raise VectorError("mode", "this index stores no NRFF features (created with nrff_k=0)")
    f = nrff.features(p.q.dense, config.nrff_k, config.gamma, config.seed).astype(np.float32)
    est = view.nrff @ f
    est[view.alive == 0] = -np.inf
    if 0 <= p.exclude < est.shape[0]:
        est[p.exclude] = -np.inf
    live = int(np.isfinite(est).sum())
    top = top_k(est, min(budget_, live)) if live else np.zeros(0, np.int64)
    l2 = math.sqrt(float(p.q.dense @ p.q.dense))
    rho = np.array([row_cosine(p.q.dense, l2, view.voff, view.vi, view.vf, r) for r in top.tolist()])
    return top, np.exp(-config.gamma * (1.0 - np.clip(rho, -1.0, 1.0))), int(top.shape[0])


def answer(view: View, mode: str, k: int, rows: np.ndarray, sims: np.ndarray, scored: int,
           min_similarity: float) -> QueryResult:
    """The best ``k`` of the scored rows at or above ``min_similarity``, named from the mirror."""
    if min_similarity > 0:
        keep = sims >= min_similarity
        rows, sims = rows[keep], sims[keep]
    best = top_k(sims, k)
    chosen = rows[best].tolist()
    out = [Neighbor(name, s, orjson.loads(m) if m else None)
           for name, s, m in zip(view.names_of(chosen), sims[best].tolist(), view.metadata_of(chosen), strict=True)]
    return QueryResult(mode=mode, k=k, candidates=scored, neighbors=tuple(out))


def found_by(view: View, qs: list[Prepared], k: int, mode: str, params: SearchParams, config: IndexConfig
             ) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(rows, exact similarities, rows scored) of each query by the search ``mode`` names
    (``sketch``, ``postings``, ``exact`` or ``nrff``): the one dispatcher from a mode to a search."""
    if mode == "sketch":
        return run_sketch(view, qs, params, config, k)
    if mode == "exact":
        return [run_exact(view, q, k) for q in qs]
    if mode == "postings":
        return [run_postings(view, q, params) for q in qs]
    return [run_nrff(view, q, config, params.candidates) for q in qs]


def run(view: View, qs: list[Prepared], k: int, mode: str, min_similarity: float, params: SearchParams,
        config: IndexConfig) -> list[QueryResult]:
    """Answers to prepared queries by the search ``mode`` names."""
    return [answer(view, mode, k, rows, sims, scored, min_similarity)
            for rows, sims, scored in found_by(view, qs, k, mode, params, config)]
