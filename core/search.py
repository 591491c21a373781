"""The query kernels: candidates from inverted lists and the unlisted tail, two ranking
passes over sketch agreement, exact GMM of the best few.

Flat numba functions over the arrays of a search mirror (:mod:`gmmlsh.index.mirror`):

* ``planes`` (rows, b·words): each row's codes as bit planes (:mod:`gmmlsh.core.codes`),
  and ``first`` (rows, 8) its first-stage row (:mod:`gmmlsh.core.ivf`);
* ``centroids``/``starts``/``lrows``/``lfirst``: the inverted lists of a generation
  (:mod:`gmmlsh.core.ivf`): list ``c`` holds mirror rows ``lrows[starts[c]:starts[c+1]]``
  and a copy of their first-stage rows, so a probed list is read contiguously;
* rows ``[tail_lo, tail_hi)``: added since the generation was built, scanned whole;
* ``alive`` (rows,): 0 for a retired vector (it stays in the arrays until the next generation);
* ``voff``/``vdata``/``norms``: the vectors as GMM sees them. Row ``r`` starts at word
  ``voff[r]`` of ``vdata`` with two int32 header words, ``count`` and ``kind``: kind 0 is
  dense (``count`` float32 values follow), kind 1 sparse (``count`` int32 indices, then
  ``count`` float32 values). ``vi``/``vf`` are the int32 and float32 views of ``vdata``.

The query itself enters as its bit planes ``qp`` and first-stage row ``qf`` and, for the exact stage, as a dense
float64 buffer ``qbuf`` of the full dimension (zero where the query is zero), so that a
sparse stored row costs one gather per nonzero.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from gmmlsh.core.codes import WORD, agreement
from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.intrinsics import CACHE_LINE, prefetch, prefetch_flat
from gmmlsh.core.ivf import FIRST_WORDS, first_agreement
from gmmlsh.core.parallel import twin_kernels

#: Rows the rank pass prefetches ahead (its rows are random: each would be a full memory latency).
_AHEAD = 8
_LINE_WORDS = CACHE_LINE // 8  # uint64 words per cache line
_LINE_VALUES = CACHE_LINE // 4  # float32 values per cache line
#: Highest first-stage score (samples in a first-stage row).
_FIRST_TOP = FIRST_WORDS // 2 * WORD


@njit(nogil=True, cache=True, fastmath=_FAST)
def row_gmm(qbuf, qn, voff, vi, vf, norms, r):
    """Exact GMM of the query against mirror row ``r``.

    The row is sliced before the loop: indexing ``vf[base + i]`` directly makes numba
    check every index for wrap-around, which stops LLVM vectorising (measured 5×).
    Sparse indices are read as unsigned for the same reason.
    """
    off = voff[r]
    count = vi[off]
    s = 0.0
    if vi[off + 1] == 0:
        vals = vf[off + 2:off + 2 + count]
        for i in range(count):
            s += _same_sign_min(qbuf[i], np.float64(vals[i]))
    else:
        idx = vi[off + 2:off + 2 + count].view(np.uint32)
        vals = vf[off + 2 + count:off + 2 + 2 * count]
        for p in range(count):
            s += _same_sign_min(qbuf[idx[p]], np.float64(vals[p]))
    return _ratio(s, qn, norms[r])


@njit(nogil=True, cache=True, inline="always")
def _cut(hist, count):
    """The lowest score kept when taking the ``count`` best of a histogram of scores, and
    how many entries scoring exactly that are taken (ties go to the earliest)."""
    cut = hist.shape[0] - 1
    taken = 0
    while cut > 0 and taken + hist[cut] < count:
        taken += hist[cut]
        cut -= 1
    return cut, count - taken


@njit(nogil=True, cache=True)
def select(ids, scores, m, count, top):
    """The ``count`` entries of ``ids[:m]`` with the highest ``scores`` (integers in
    ``[0, top]``), in their original order; ties at the cut go to the earliest.

    A counting pass over the small integer scores: no sort of ``m`` values.
    """
    if count >= m:
        return ids[:m].copy()
    hist = np.zeros(top + 1, dtype=np.int64)
    for t in range(m):
        hist[scores[t]] += 1
    cut, room = _cut(hist, count)
    out = np.empty(count, dtype=ids.dtype)
    k = 0
    for t in range(m):
        s = scores[t]
        if s > cut or (s == cut and room > 0):
            room -= s == cut
            out[k] = ids[t]
            k += 1
    return out[:k]


@njit(nogil=True, cache=True, inline="always")
def _first_scores(rows_first, lo, hi, qf, scores, at, hist):
    """First-stage scores of rows ``[lo, hi)`` of a first-stage array into ``scores[at:]``,
    counted in ``hist`` as they go; returns the next free position."""
    for e in range(lo, hi):
        s = first_agreement(rows_first[e], qf)
        scores[at] = s
        hist[s] += 1
        at += 1
    return at


@njit(nogil=True, cache=True)
def search(qp, qf, words, qbuf, qn, exclude, centroids, starts, lrows, lfirst, first, planes, tail_lo, tail_hi,
           alive, voff, vi, vf, norms, probes, shortlist, rank_planes, rerank, out_rows, out_sims):
    """One query: returns (rows written to ``out_rows``/``out_sims``, rows scanned).

    1. the ``probes`` lists whose centroids agree best with the query (all when
       ``probes`` ≥ their number), plus the tail, scored on first-stage rows (read
       contiguously; only the scores are written, and counted as they go);
    2. the ``shortlist`` best of those, scored on the low ``rank_planes`` bits of
       every sample;
    3. the ``rerank`` best of those, scored by exact GMM (unsorted; the caller ranks).
    Retired rows and row ``exclude`` (the query's own vector, or −1) are skipped.
    """
    nlist = centroids.shape[0]
    chosen = np.arange(nlist)
    if nlist > 0 and probes < nlist:
        cscore = np.empty(nlist, dtype=np.int64)
        for c in range(nlist):
            cscore[c] = first_agreement(centroids[c], qf)
        chosen = select(chosen, cscore, nlist, probes, _FIRST_TOP)
    total = tail_hi - tail_lo
    for c in chosen:
        total += starts[c + 1] - starts[c]
    scores = np.empty(total, dtype=np.uint16)
    hist = np.zeros(_FIRST_TOP + 1, dtype=np.int64)
    m = 0
    for c in chosen:
        m = _first_scores(lfirst, starts[c], starts[c + 1], qf, scores, m, hist)
    m = _first_scores(first, tail_lo, tail_hi, qf, scores, m, hist)
    # The shortlist, in scan order. Retired rows and ``exclude`` are dropped in the next
    # pass, not here: a live-flag read per scanned row (random rows) tripled the scan's time.
    cut, room = _cut(hist, shortlist)
    short = np.empty(min(shortlist, m), dtype=np.int64)
    k = 0
    t = 0
    for c in chosen:
        for e in range(starts[c], starts[c + 1]):
            s = scores[t]
            t += 1
            if s > cut or (s == cut and room > 0):
                room -= s == cut
                short[k] = lrows[e]
                k += 1
    for r in range(tail_lo, tail_hi):
        s = scores[t]
        t += 1
        if s > cut or (s == cut and room > 0):
            room -= s == cut
            short[k] = r
            k += 1
    short = short[:k]
    ranked = np.empty(k, dtype=np.int64)
    for t in range(k):
        if t + _AHEAD < k:
            ahead = short[t + _AHEAD]
            prefetch_flat(alive, ahead)
            for w in range(0, rank_planes * words, _LINE_WORDS):
                prefetch(planes, ahead, w)
        r = short[t]
        ranked[t] = agreement(planes[r], qp, words, rank_planes, words) if alive[r] and r != exclude else 0
    best = select(short, ranked, k, rerank, words * WORD)
    n = 0
    for t in range(best.shape[0]):
        if t + _AHEAD < best.shape[0]:  # the next rows' vectors, while this one is scored
            ahead = best[t + _AHEAD]
            for w in range(voff[ahead], voff[ahead + 1], _LINE_VALUES):
                prefetch_flat(vf, w)
        r = best[t]
        if alive[r] and r != exclude:
            out_rows[n] = r
            out_sims[n] = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
            n += 1
    return n, m


def _search_many_impl(QP, QF, words, Qbuf, qn, exclude, centroids, starts, lrows, lfirst, first, planes, tail_lo,
                      tail_hi, alive, voff, vi, vf, norms, probes, shortlist, rank_planes, rerank, out_rows, out_sims,
                      counts, scanned):
    for i in prange(QP.shape[0]):
        counts[i], scanned[i] = search(QP[i], QF[i], words, Qbuf[i], qn[i], exclude[i], centroids, starts, lrows,
                                       lfirst, first, planes, tail_lo, tail_hi, alive, voff, vi, vf, norms, probes,
                                       shortlist, rank_planes, rerank, out_rows[i], out_sims[i])


#: :func:`search` for every query of a batch (parallel over queries, or serial).
search_many_parallel, search_many_serial = twin_kernels(_search_many_impl, nogil=True, cache=True)


def _exact_impl(qbuf, qn, exclude, alive, voff, vi, vf, norms, n, out):
    for r in prange(n):
        if alive[r] and r != exclude:
            out[r] = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
        else:
            out[r] = -1.0


#: Exact GMM of one query against every row ``< n`` (−1 for retired rows and ``exclude``).
exact_parallel, exact_serial = twin_kernels(_exact_impl, nogil=True, cache=True)


def _exact_block_impl(Q, qn, exclude, alive, voff, vi, vf, norms, lo, hi, out):
    for r in prange(lo, hi):
        for j in range(Q.shape[0]):
            if alive[r] and r != exclude[j]:
                out[j, r - lo] = row_gmm(Q[j], qn[j], voff, vi, vf, norms, r)
            else:
                out[j, r - lo] = -1.0


#: Exact GMM of many queries against rows ``lo ≤ r < hi``: ``out[j, r − lo]`` (−1 for retired
#: rows and query j's ``exclude[j]``). A row is read from memory once for all the queries
#: (one query at a time reads every row for each: at 784 dimensions that is memory-bound).
exact_block_parallel, exact_block_serial = twin_kernels(_exact_block_impl, nogil=True, cache=True)


@njit(nogil=True, cache=True)
def row_cosine(qbuf, q_l2, voff, vi, vf, r):
    """Correlation ρ (cosine) of the query with mirror row ``r`` (for NRFF's exact RBF)."""
    off = voff[r]
    count = vi[off]
    dot = 0.0
    sq = 0.0
    if vi[off + 1] == 0:
        vals = vf[off + 2:off + 2 + count]
        for i in range(count):
            x = np.float64(vals[i])
            dot += qbuf[i] * x
            sq += x * x
    else:
        idx = vi[off + 2:off + 2 + count].view(np.uint32)
        vals = vf[off + 2 + count:off + 2 + 2 * count]
        for p in range(count):
            x = np.float64(vals[p])
            dot += qbuf[idx[p]] * x
            sq += x * x
    return dot / (q_l2 * np.sqrt(sq))


@njit(nogil=True, cache=True)
def exact_rows(qbuf, qn, exclude, alive, voff, vi, vf, norms, rows, out_rows, out_sims):
    """Exact GMM of the query against the given rows (live ones, ``exclude`` left out)."""
    n = 0
    for r in rows:
        if alive[r] and r != exclude:
            out_rows[n] = r
            out_sims[n] = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
            n += 1
    return n
