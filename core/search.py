"""The query kernels: candidates from inverted lists and the unlisted tail, two ranking
passes over sketch agreement, exact GMM of the best few.

Flat numba functions over the arrays of a search mirror (:mod:`gmmlsh.index.mirror`):

* ``planes`` (rows, b·words): each row's codes as bit planes (:mod:`gmmlsh.core.codes`);
* ``centroids``/``starts``/``lrows``/``lfirst``: the inverted lists of a generation
  (:mod:`gmmlsh.core.ivf`): list ``c`` holds mirror rows ``lrows[starts[c]:starts[c+1]]``
  and a copy of their first-stage rows, so a probed list is read contiguously;
* rows ``[tail_lo, tail_hi)``: added since the generation was built, scanned whole;
* ``alive`` (rows,): 0 for a retired vector (it stays in the arrays until the next generation);
* ``voff``/``vdata``/``norms``: the vectors as GMM sees them. Row ``r`` starts at word
  ``voff[r]`` of ``vdata`` with two int32 header words, ``count`` and ``kind``: kind 0 is
  dense (``count`` float32 values follow), kind 1 sparse (``count`` int32 indices, then
  ``count`` float32 values). ``vi``/``vf`` are the int32 and float32 views of ``vdata``.

The query itself enters as its bit planes ``qp`` and, for the exact stage, as a dense
float64 buffer ``qbuf`` of the full dimension (zero where the query is zero), so that a
sparse stored row costs one gather per nonzero.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from gmmlsh.core.codes import WORD, agreement
from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.parallel import twin_kernels


@njit(nogil=True, cache=True, fastmath=_FAST)
def row_gmm(qbuf, qn, voff, vi, vf, norms, r):
    """Exact GMM of the query against mirror row ``r``."""
    off = voff[r]
    count = vi[off]
    s = 0.0
    if vi[off + 1] == 0:
        base = off + 2
        for i in range(count):
            s += _same_sign_min(qbuf[i], np.float64(vf[base + i]))
    else:
        base = off + 2
        for p in range(count):
            s += _same_sign_min(qbuf[vi[base + p]], np.float64(vf[base + count + p]))
    return _ratio(s, qn, norms[r])


@njit(nogil=True, cache=True)
def select(ids, scores, m, count, top):
    """The ``count`` entries of ``ids[:m]`` with the highest ``scores`` (integers in
    ``[0, top]``), in their original order; ties at the cut go to the earliest.

    A counting pass over the small integer scores: no sort of ``m`` values.
    """
    if count >= m:
        return ids[:m].copy()
    hist = np.zeros(top + 2, dtype=np.int64)
    for t in range(m):
        hist[scores[t]] += 1
    cut = top
    taken = 0
    while cut > 0 and taken + hist[cut] < count:
        taken += hist[cut]
        cut -= 1
    room = count - taken
    out = np.empty(count, dtype=ids.dtype)
    k = 0
    for t in range(m):
        s = scores[t]
        if s > cut:
            out[k] = ids[t]
            k += 1
        elif s == cut and room > 0:
            room -= 1
            out[k] = ids[t]
            k += 1
    return out[:k]


@njit(nogil=True, cache=True)
def search(qp, words, fp, fw, qbuf, qn, exclude, centroids, starts, lrows, lfirst, planes, tail_lo, tail_hi,
           alive, voff, vi, vf, norms, probes, shortlist, rank_planes, rerank, out_rows, out_sims):
    """One query: returns (rows written to ``out_rows``/``out_sims``, rows scanned).

    1. the ``probes`` lists whose centroids agree best with the query (all when
       ``probes`` ≥ their number), plus the tail, scored on first-stage rows;
    2. the ``shortlist`` best of those, scored on the low ``rank_planes`` bits of
       every sample;
    3. the ``rerank`` best of those, scored by exact GMM (unsorted; the caller ranks).
    Retired rows and row ``exclude`` (the query's own vector, or −1) are skipped.
    """
    qf = np.empty(fp * fw, dtype=np.uint64)
    for p in range(fp):
        for w in range(fw):
            qf[p * fw + w] = qp[p * words + w]
    nlist = centroids.shape[0]
    chosen = np.arange(nlist)
    if nlist > 0 and probes < nlist:
        cscore = np.empty(nlist, dtype=np.int64)
        for c in range(nlist):
            cscore[c] = agreement(centroids[c], qf, fw, fp, fw)
        chosen = select(chosen, cscore, nlist, probes, fw * WORD)
    total = tail_hi - tail_lo
    for c in chosen:
        total += starts[c + 1] - starts[c]
    rows = np.empty(total, dtype=np.int64)
    scores = np.empty(total, dtype=np.int64)
    m = 0
    for c in chosen:
        for e in range(starts[c], starts[c + 1]):
            r = lrows[e]
            if alive[r] and r != exclude:
                rows[m] = r
                scores[m] = agreement(lfirst[e], qf, fw, fp, fw)
                m += 1
    for r in range(tail_lo, tail_hi):
        if alive[r] and r != exclude:
            rows[m] = r
            scores[m] = agreement(planes[r], qp, words, fp, fw)
            m += 1
    short = select(rows, scores, m, shortlist, fw * WORD)
    ranked = np.empty(short.shape[0], dtype=np.int64)
    for t in range(short.shape[0]):
        ranked[t] = agreement(planes[short[t]], qp, words, rank_planes, words)
    best = select(short, ranked, short.shape[0], rerank, words * WORD)
    for t in range(best.shape[0]):
        out_rows[t] = best[t]
        out_sims[t] = row_gmm(qbuf, qn, voff, vi, vf, norms, best[t])
    return best.shape[0], m


def _search_many_impl(QP, words, fp, fw, Qbuf, qn, exclude, centroids, starts, lrows, lfirst, planes, tail_lo,
                      tail_hi, alive, voff, vi, vf, norms, probes, shortlist, rank_planes, rerank, out_rows, out_sims,
                      counts, scanned):
    for i in prange(QP.shape[0]):
        counts[i], scanned[i] = search(QP[i], words, fp, fw, Qbuf[i], qn[i], exclude[i], centroids, starts, lrows,
                                       lfirst, planes, tail_lo, tail_hi, alive, voff, vi, vf, norms, probes,
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


@njit(nogil=True, cache=True)
def row_cosine(qbuf, q_l2, voff, vi, vf, r):
    """Correlation ρ (cosine) of the query with mirror row ``r`` (for NRFF's exact RBF)."""
    off = voff[r]
    count = vi[off]
    dot = 0.0
    sq = 0.0
    base = off + 2
    if vi[off + 1] == 0:
        for i in range(count):
            x = np.float64(vf[base + i])
            dot += qbuf[i] * x
            sq += x * x
    else:
        for p in range(count):
            x = np.float64(vf[base + count + p])
            dot += qbuf[vi[base + p]] * x
            sq += x * x
    return dot / (q_l2 * np.sqrt(sq))
