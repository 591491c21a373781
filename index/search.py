"""The query path, one skeleton for single and batch queries:

    query → (sketch planes, dense buffer) → candidates from lists and tail → first-stage
    shortlist → rank on every sample → exact GMM of the best few → top k → names

All of it reads the mirror (:mod:`gmmlsh.index.mirror`); nothing here touches the
store. The kernels are :mod:`gmmlsh.core.search`'s.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import numba
import numpy as np
import orjson
import scipy.sparse as sp

from gmmlsh.core import nrff
from gmmlsh.core.codes import bit_planes
from gmmlsh.core.ivf import first_rows
from gmmlsh.core.parallel import PARALLEL_LOCK, PARALLEL_MIN_WORK
from gmmlsh.core.postings import exact_postings, postings_search
from gmmlsh.core.search import (
    exact_block_parallel,
    exact_block_serial,
    exact_parallel,
    exact_rows,
    exact_serial,
    row_cosine,
    search,
    search_many_parallel,
    search_many_serial,
)
from gmmlsh.core.select import top_k
from gmmlsh.index.config import DEFAULT_RARE, RANK_BITS_MAX, IndexConfig, SearchParams
from gmmlsh.index.mirror import View
from gmmlsh.index.records import SparseRow, as_hashed, codes_of

MODES = ("lsh", "exact", "nrff", "postings")


@dataclass
class Neighbor:
    id: str
    similarity: float
    metadata: dict | None = None


@dataclass
class QueryResult:
    """An answer: the ``mode`` that produced it, how many vectors it scored exactly
    (``candidates``), and the neighbours best first with their exact similarity."""

    mode: str
    k: int
    candidates: int
    neighbors: list[Neighbor] = field(default_factory=list)


@dataclass
class Prepared:
    """A query as the kernels take it."""

    planes: np.ndarray | None  # (bits · words,) uint64; None when the answer needs no sketch
    first: np.ndarray | None  # (FIRST_WORDS,) uint64
    dense: np.ndarray  # (dim,) float64: the vector GMM sees (centred), zero where it is zero
    norm: float  # its L1 norm
    exclude: int = -1  # mirror row left out of the answer (a query by id), or −1
    nonzero: np.ndarray | None = None  # its nonzero coordinates, when known (sparse input)

    def coordinates(self) -> np.ndarray:
        """The query's nonzero coordinates."""
        return self.nonzero if self.nonzero is not None else np.flatnonzero(self.dense)


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
        yield Prepared(None, None, buf, float(np.abs(row.values, dtype=np.float64).sum()), nonzero=row.indices)
    finally:
        buf[row.indices] = 0.0


def prepare_vectors(X32, config: IndexConfig, sketch: bool = True) -> list[Prepared]:
    """Validated rows at stored precision (dense 2-D, CSR or a :class:`SparseRow`) → prepared
    queries; hashed only if ``sketch`` (brute force needs no sketch, and hashing a sparse query
    costs ~1 ms)."""
    if isinstance(X32, SparseRow):
        X32 = X32.csr()
    Xh = as_hashed(X32, config)
    planes = first = None
    if sketch:
        planes = bit_planes(codes_of(Xh, config), config.bits)
        first = first_rows(planes, planes.shape[1] // config.bits, config.bits)
    n = Xh.shape[0]
    if sp.issparse(Xh):  # scattered into zeros: scipy's toarray costs more than the query's nonzeros
        dense = np.zeros(Xh.shape)
        nonzero = [Xh.indices[Xh.indptr[i]:Xh.indptr[i + 1]] for i in range(n)]
        norms = np.empty(n)
        for i in range(n):
            values = Xh.data[Xh.indptr[i]:Xh.indptr[i + 1]]
            dense[i, nonzero[i]] = values
            norms[i] = np.abs(values, dtype=np.float64).sum()
    else:
        dense, nonzero = np.asarray(Xh, dtype=np.float64), [None] * n
        norms = np.abs(dense).sum(axis=1)
    return [Prepared(planes[i] if sketch else None, first[i] if sketch else None, dense[i], float(norms[i]),
                     nonzero=nonzero[i]) for i in range(n)]


def prepare_row(view: View, row: int, config: IndexConfig) -> Prepared:
    """A stored vector as a query (its own row excluded), from the mirror alone."""
    off = int(view.voff[row])
    count, kind = int(view.vi[off]), int(view.vi[off + 1])
    dense = np.zeros(config.dim)
    if kind == 0:
        dense[:] = view.vf[off + 2:off + 2 + count]
    else:
        dense[view.vi[off + 2:off + 2 + count]] = view.vf[off + 2 + count:off + 2 + 2 * count]
    return Prepared(np.array(view.planes[row]), np.array(view.first[row]), dense, float(view.norms[row]), exclude=row)


def _lists(view: View, config: IndexConfig) -> tuple[np.ndarray, ...]:
    """The generation's lists as the search kernel takes them (profiles, starts, rows, first-stage
    rows, bit planes); no lists at all, every row in the tail, before the first generation."""
    g = view.generation
    if g is not None:
        return g.profiles, g.starts, g.lrows, g.lfirst, g.lplanes
    words = view.planes.shape[1] // config.bits
    return (np.zeros((2 * words, 0), np.uint64), np.zeros(1, np.int64), np.zeros(0, np.uint32),
            np.zeros(0, np.uint64), np.zeros((0, min(RANK_BITS_MAX, config.bits) * words), np.uint64))


def refine_count(k: int) -> int:
    """Candidates scored by exact GMM for a top-``k`` answer, the best by coarse GMM: the ``k``
    and as many again (at least 10) for the few thousandths the coarse ranking may be off by
    (Fashion-MNIST at 1M: the best 15 of 200 held the same top 10 as all 200)."""
    return k + max(k, 10)


def run_lsh(view: View, queries: list[Prepared], params: SearchParams, config: IndexConfig, k: int = 10,
            scored: bool = True) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(rows, exact similarities, candidates ranked by GMM) of each query: its candidates' best
    :func:`refine_count` by coarse GMM, scored exactly. With ``scored`` False, every candidate
    unscored (similarity 0): which rows a setting reaches, at a fraction of its cost (the
    tuner's recall trials)."""
    words = view.planes.shape[1] // config.bits
    probes = params.probes if params.probes > 0 else 1 << 30
    rank_planes = max(1, min(params.rank_bits, RANK_BITS_MAX, config.bits))
    C = params.candidates
    refine = refine_count(k) if scored else 0
    common = (*_lists(view, config), view.first, view.planes, view.tail_start, view.rows, view.alive, view.coff,
              view.cdata, config.dim, view.voff, view.vi, view.vf, view.norms, probes, params.shortlist, rank_planes,
              C, refine)
    two = config.bits >= 2
    if len(queries) == 1:
        q = queries[0]
        rows, sims = np.empty(C, np.int64), np.empty(C)
        n, _, ranked = search(q.planes, q.first, words, two, q.dense, q.norm, q.exclude, *common, rows, sims)
        return [(rows[:n], sims[:n], int(ranked))]
    m = len(queries)
    rows, sims = np.empty((m, C), np.int64), np.empty((m, C))
    counts, scanned, ranked = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64)
    QP = np.stack([q.planes for q in queries])
    QF = np.stack([q.first for q in queries])
    Qd = np.stack([q.dense for q in queries])
    qn = np.array([q.norm for q in queries])
    ex = np.array([q.exclude for q in queries], dtype=np.int64)
    args = (QP, QF, words, two, Qd, qn, ex, *common, rows, sims, counts, scanned, ranked)
    if numba.get_num_threads() > 1:
        with PARALLEL_LOCK:
            search_many_parallel(*args)
    else:
        search_many_serial(*args)
    return [(rows[i, :counts[i]], sims[i, :counts[i]], int(ranked[i])) for i in range(m)]


def run_exact(view: View, q: Prepared, k: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, exact similarities, rows scored) by brute force, the ground truth.

    Sparse rows of the generation are scored through its postings (rows sharing no
    coordinate with the query score 0 and are left out, unless fewer than ``k`` others
    remain); dense rows and the tail, row by row.
    """
    g = view.generation
    if g is None or g.post_rows.shape[0] == 0:
        return _exact_scan(view, q)
    n = view.rows
    scratch = _scratch(n)
    rows, sims = np.empty(n, np.int64), np.empty(n)
    m = exact_postings(q.dense, q.coordinates(), q.norm, q.exclude, view.alive, view.norms, g.post_starts, g.post_rows,
                       g.post_vals, scratch.acc, scratch.seen, rows, sims)
    rest = _unposted(view)
    m += exact_rows(q.dense, q.norm, q.exclude, view.alive, view.voff, view.vi, view.vf, view.norms, rest,
                    rows[m:], sims[m:])
    rows, sims = rows[:m], sims[:m]
    live = view.live - (0 <= q.exclude < n and bool(view.alive[q.exclude]))
    if m < min(k, live):  # rows sharing nothing with the query (similarity 0) fill the answer
        zero = np.setdiff1d(np.flatnonzero(view.alive[:n]), np.append(rows, q.exclude))[:k - m]
        rows, sims = np.concatenate([rows, zero]), np.concatenate([sims, np.zeros(zero.shape[0])])
    return rows, sims, live


def run_postings(view: View, q: Prepared, params: SearchParams) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, exact similarities, rows scored) of the postings search (:mod:`gmmlsh.core.postings`):
    the generation's sparse rows ranked on the head columns and the postings of coordinates
    held by at most ``params.rare`` of its rows, the best ``params.candidates`` scored
    exactly; its dense rows and the tail scored exactly (as exact search does)."""
    g = view.generation
    if g is None or g.post_rows.shape[0] == 0:
        return _exact_scan(view, q)
    share = params.rare if params.rare > 0 else DEFAULT_RARE
    rest = _unposted(view)
    rows, sims = np.empty(params.candidates + rest.shape[0], np.int64), np.empty(params.candidates + rest.shape[0])
    m = postings_search(q.dense, q.coordinates(), q.norm, q.exclude, view.alive, view.norms, g.norms32,
                        g.post_starts, g.post_rows, g.post_vals, g.head_slot, g.head_bytes, g.head_nibbles,
                        g.head_scale, g.rows, int(share * g.rows), params.candidates, view.voff, view.vi, view.vf,
                        _scratch(g.rows).levels, rows, sims)
    if rest.shape[0]:
        m += exact_rows(q.dense, q.norm, q.exclude, view.alive, view.voff, view.vi, view.vf, view.norms, rest,
                        rows[m:], sims[m:])
    return rows[:m], sims[:m], m


def _unposted(view: View) -> np.ndarray:
    """Mirror rows no postings hold: the generation's dense rows and the tail."""
    g = view.generation
    if not g.dense_rows.shape[0]:
        return np.arange(g.rows, view.rows)
    return np.concatenate([g.dense_rows.astype(np.int64), np.arange(g.rows, view.rows)])


#: Bytes of similarities a batch of exact queries holds at a time (rows are scored in blocks).
_EXACT_BLOCK_BYTES = 32 << 20


def run_exact_many(view: View, qs: list[Prepared], k: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """:func:`run_exact` for a batch, each answer cut to its best ``k`` rows and those tied
    with the ``k``-th (the similarities equal run_exact's; among tied rows the order may differ).

    Where exact search reads most stored values anyway (dense data), the rows are scored in
    blocks against all those queries at once, each row read once for the whole batch;
    where postings spare most of them (sparse text), query by query.
    """
    scan = [k >= 1 and _scans_most(view, q) for q in qs]
    if sum(scan) < 2:
        return [run_exact(view, q, k) for q in qs]
    blocked = iter(_exact_block(view, [q for q, s in zip(qs, scan, strict=True) if s], k))
    return [next(blocked) if s else run_exact(view, q, k) for q, s in zip(qs, scan, strict=True)]


def _scans_most(view: View, q: Prepared) -> bool:
    """Whether exact search through postings would read most of the stored values anyway: no
    postings, or dense rows and the query's postings hold half of them (images, not text)."""
    g = view.generation
    if g is None or not g.post_rows.shape[0]:
        return True
    c = q.coordinates()
    touched = int((g.post_starts[c + 1] - g.post_starts[c]).sum())
    stored = int(view.voff[view.rows])  # words of the vectors column; a posting is 2 of them
    return touched + stored - 2 * g.post_rows.shape[0] >= stored // 2


def _exact_block(view: View, qs: list[Prepared], k: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    n, m = view.rows, len(qs)
    Q = np.stack([q.dense for q in qs])
    qn = np.array([q.norm for q in qs])
    exclude = np.array([q.exclude for q in qs], dtype=np.int64)
    step = max(1024, _EXACT_BLOCK_BYTES // (8 * m))
    out = np.empty((m, min(step, n)))  # whole (C-contiguous) for every block; the last fills part
    kept: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in qs]
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        args = (Q, qn, exclude, view.alive, view.voff, view.vi, view.vf, view.norms, lo, hi, out)
        if int(view.voff[hi] - view.voff[lo]) * m >= PARALLEL_MIN_WORK:
            with PARALLEL_LOCK:
                exact_block_parallel(*args)
        else:
            exact_block_serial(*args)
        for j in range(m):
            sims = out[j, :hi - lo]
            cut = max(0.0, np.partition(sims, -k)[-k]) if sims.shape[0] > k else 0.0
            keep = np.flatnonzero(sims >= cut)
            kept[j].append((keep + lo, sims[keep].copy()))
    found = []
    for j, q in enumerate(qs):
        rows = np.concatenate([r for r, _ in kept[j]])
        sims = np.concatenate([s for _, s in kept[j]])
        found.append((rows, sims, view.live - (0 <= q.exclude < n and bool(view.alive[q.exclude]))))
    return found


def _exact_scan(view: View, q: Prepared) -> tuple[np.ndarray, np.ndarray, int]:
    n = view.rows
    sims = np.empty(n)
    args = (q.dense, q.norm, q.exclude, view.alive, view.voff, view.vi, view.vf, view.norms, n, sims)
    if int(view.voff[n]) >= PARALLEL_MIN_WORK:
        with PARALLEL_LOCK:
            exact_parallel(*args)
    else:
        exact_serial(*args)
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
        s = SimpleNamespace(acc=np.zeros(size), seen=np.zeros(size, np.uint8), levels=np.empty(size, np.uint16))
        _SCRATCH.s = s
    return s


def run_nrff(view: View, q: Prepared, config: IndexConfig, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Stored NRFF features ranked by estimated RBF, the best ``budget`` scored by the exact RBF."""
    if view.nrff is None:
        from gmmlsh.core.validate import VectorError

        raise VectorError("mode", "this index stores no NRFF features (created with nrff_k=0)")
    f = nrff.features(q.dense, config.nrff_k, config.gamma, config.seed).astype(np.float32)
    est = view.nrff @ f
    est[view.alive == 0] = -np.inf
    if 0 <= q.exclude < est.shape[0]:
        est[q.exclude] = -np.inf
    live = int(np.isfinite(est).sum())
    top = top_k(est, min(budget, live)) if live else np.zeros(0, np.int64)
    l2 = math.sqrt(float(q.dense @ q.dense))
    rho = np.array([row_cosine(q.dense, l2, view.voff, view.vi, view.vf, r) for r in top.tolist()])
    return top, np.exp(-config.gamma * (1.0 - np.clip(rho, -1.0, 1.0))), int(top.shape[0])


def answer(view: View, mode: str, k: int, rows: np.ndarray, sims: np.ndarray, scored: int,
           min_similarity: float) -> QueryResult:
    """The best ``k`` of the scored rows at or above ``min_similarity``, named from the mirror."""
    if min_similarity > 0:
        keep = sims >= min_similarity
        rows, sims = rows[keep], sims[keep]
    best = top_k(sims, k)
    chosen = rows[best].tolist()
    names, metas = view.names_and_metadata(chosen)
    out = [Neighbor(name, s, orjson.loads(m) if m else None)
           for name, s, m in zip(names, sims[best].tolist(), metas, strict=True)]
    return QueryResult(mode=mode, k=k, candidates=scored, neighbors=out)
