"""The query kernels: candidates from inverted lists and the unlisted tail, ranked on
sketch agreement, then on coarse GMM, exact GMM of the best few.

Flat numba functions over the arrays of a search mirror (:mod:`gmmlsh.index.mirror`) and
its generation of lists (:mod:`gmmlsh.index.generation`):

* ``profiles``/``starts``/``lrows``/``lfirst``/``lplanes``: the inverted lists. List ``c``
  holds mirror rows ``lrows[starts[c]:starts[c+1]]``; ``lfirst`` their first-stage rows laid
  out for a vectorised scan (:func:`gmmlsh.core.ivf.list_layout`), ``lplanes`` the low bit
  planes of their sketches in list order (so the rank pass reads near what it scanned);
  ``profiles`` choose the lists (:func:`gmmlsh.core.ivf.profile_scores`);
* ``first`` (rows, 8) and ``planes`` (rows, b·words): every row's first-stage row and bit
  planes (:mod:`gmmlsh.core.ivf`, :mod:`gmmlsh.core.codes`), read for the rows
  ``[tail_lo, tail_hi)`` added since the generation was built (scanned whole);
* ``alive`` (rows,): 0 for a retired vector (it stays in the arrays until the next generation);
* ``coff``/``cdata``: the coarse rows (:mod:`gmmlsh.core.coarse`);
* ``voff``/``vdata``/``norms``: the vectors as GMM sees them. Row ``r`` starts at word
  ``voff[r]`` of ``vdata`` with two int32 header words, ``count`` and ``kind``: kind 0 is
  dense (``count`` float32 values follow), kind 1 sparse (``count`` int32 indices, then
  ``count`` float32 values). ``vi``/``vf`` are the int32 and float32 views of ``vdata``.

The query itself enters as its bit planes ``qp`` and first-stage row ``qf`` and, for the GMM
stages, as a dense float64 buffer ``qbuf`` of the full dimension (zero where the query is
zero), so that a sparse stored row costs one gather per nonzero.

Measured on Fashion-MNIST grown to 1M (one query, 24 lists of ~500 rows): the scan reads
about 1.3 MB in order; every later stage reads rows from anywhere, and its cost is the
cache lines it fetches — so each stage reads as few as it can (4 bit planes in list order,
then int8 coarse rows, then the float32 rows of the best ``refine``), and asks for the next
rows' lines while it scores the current ones.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from gmmlsh.core.coarse import HEADER, coarse_gmm
from gmmlsh.core.codes import WORD
from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.intrinsics import CACHE_LINE, popcount, prefetch, prefetch_flat
from gmmlsh.core.ivf import FIRST_WORDS, first_agreement, list_scores, profile_scores
from gmmlsh.core.parallel import twin_kernels
from gmmlsh.core.select import GROUP, choose, select

#: Rows the rank and GMM passes ask for ahead of the one they score (each is a random row:
#: a full memory latency unless requested early).
_AHEAD = 8
_LINE_WORDS = CACHE_LINE // 8  # uint64 words per cache line
_LINE_VALUES = CACHE_LINE // 4  # float32 values per cache line
#: Highest first-stage score (bits in a first-stage row).
_FIRST_TOP = FIRST_WORDS * WORD
#: Levels a coarse GMM is cut to for choosing the rows scored exactly (a counting selection).
_GMM_LEVELS = 4095


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
def _agree(a, b, words, planes):
    """Samples on which the low ``planes`` (1–4) bits of two plane rows agree: each plane
    count written out, so that the loop over words vectorises."""
    total = 0
    if planes == 4:
        for w in range(words):
            total += popcount(~((a[w] ^ b[w]) | (a[words + w] ^ b[words + w]) | (a[2 * words + w] ^ b[2 * words + w])
                                | (a[3 * words + w] ^ b[3 * words + w])))
    elif planes == 3:
        for w in range(words):
            total += popcount(~((a[w] ^ b[w]) | (a[words + w] ^ b[words + w]) | (a[2 * words + w] ^ b[2 * words + w])))
    elif planes == 2:
        for w in range(words):
            total += popcount(~((a[w] ^ b[w]) | (a[words + w] ^ b[words + w])))
    else:
        for w in range(words):
            total += popcount(~(a[w] ^ b[w]))
    return total


@njit(nogil=True, cache=True)
def shortlist_of(qf, qp, words, two, profiles, starts, lfirst, first, tail_lo, tail_hi, probes, shortlist):
    """The first stage: the ``shortlist`` best rows by first-stage agreement among the
    ``probes`` lists whose profiles agree best with the query (all when ``probes`` ≥ their
    number) and the tail, ties to the earliest. Returns (refs, rows scanned): a ref below the
    number of list entries is an entry, any other is ``entries + row`` (a tail row).

    Every entry is scored first (a vectorised pass over the lists, as fast as memory streams
    them), then the shortlist chosen (:func:`gmmlsh.core.select.choose`)."""
    nlist = starts.shape[0] - 1
    entries = starts[nlist]
    chosen = np.arange(nlist)
    if probes < nlist:
        pscore = np.empty(nlist, dtype=np.int64)
        profile_scores(profiles, qp, words, two, pscore)
        chosen = select(chosen, pscore, nlist, probes, words * WORD)
    # Each run of scores (a list, then the tail) starts at a multiple of GROUP, zeros between.
    total = (tail_hi - tail_lo + GROUP - 1) // GROUP * GROUP + GROUP
    for c in chosen:
        total += (starts[c + 1] - starts[c] + GROUP - 1) // GROUP * GROUP
    scores = np.empty(total, dtype=np.uint16)
    spans = np.empty((chosen.shape[0] + 2, 3), dtype=np.int64)  # per run: first position, first ref, size
    at = 0
    for j in range(chosen.shape[0]):
        c = chosen[j]
        size = starts[c + 1] - starts[c]
        spans[j, 0], spans[j, 1], spans[j, 2] = at, starts[c], size
        list_scores(lfirst, starts[c], size, qf, scores[at:])
        end = (at + size + GROUP - 1) // GROUP * GROUP
        scores[at + size:end] = 0
        at = end
    j = chosen.shape[0]
    spans[j, 0], spans[j, 1], spans[j, 2] = at, entries + tail_lo, tail_hi - tail_lo
    for r in range(tail_lo, tail_hi):
        scores[at + r - tail_lo] = first_agreement(first[r], qf)
    end = (at + tail_hi - tail_lo + GROUP - 1) // GROUP * GROUP
    scores[at + tail_hi - tail_lo:end] = 0
    spans[j + 1, 0], spans[j + 1, 1], spans[j + 1, 2] = end, 0, 0
    return choose(scores, spans, shortlist, _FIRST_TOP), spans[:, 2].sum()


@njit(nogil=True, cache=True)
def search(qp, qf, words, two, qbuf, qn, exclude, profiles, starts, lrows, lfirst, lplanes, first, planes, tail_lo,
           tail_hi, alive, coff, cdata, dim, voff, vi, vf, norms, probes, shortlist, rank_planes, candidates, refine,
           out_rows, out_sims):
    """One query: returns (rows written to ``out_rows``/``out_sims``, rows scanned, candidates
    ranked by GMM).

    1. the first stage (:func:`shortlist_of`): the ``shortlist`` best of the probed lists and the tail;
    2. those ranked on the low ``rank_planes`` bits (1–4) of every sample;
    3. the ``candidates`` best of those ranked by coarse GMM (:mod:`gmmlsh.core.coarse`);
    4. the ``refine`` best of those scored by exact GMM (unsorted; the caller ranks). With
       ``refine`` ≥ ``candidates`` every candidate is scored exactly; with ``refine`` 0 the
       candidates are returned unscored (similarity 0: which rows a setting reaches).
    Retired rows and row ``exclude`` (the query's own vector, or −1) are skipped.
    """
    entries = starts[starts.shape[0] - 1]
    short, scanned = shortlist_of(qf, qp, words, two, profiles, starts, lfirst, first, tail_lo, tail_hi, probes,
                                  shortlist)
    k = short.shape[0]
    rows = np.empty(k, dtype=np.int64)
    ranked = np.empty(k, dtype=np.int64)
    stride = rank_planes * words
    for t in range(k):
        if t + _AHEAD < k:
            ahead = short[t + _AHEAD]
            if ahead < entries:
                for w in range(0, stride, _LINE_WORDS):
                    prefetch(lplanes, ahead, w)
            else:
                prefetch_flat(alive, ahead - entries)
                for w in range(0, stride, _LINE_WORDS):
                    prefetch(planes, ahead - entries, w)
        ref = short[t]
        if ref < entries:
            r = np.int64(lrows[ref])
            score = _agree(lplanes[ref], qp, words, rank_planes)
        else:
            r = ref - entries
            score = _agree(planes[r], qp, words, rank_planes)
        rows[t] = r
        ranked[t] = score if alive[r] and r != exclude else 0
    best = select(rows, ranked, k, candidates, words * WORD)
    nb = best.shape[0]
    if refine == 0:
        out_rows[:nb] = best
        out_sims[:nb] = 0.0
        return nb, scanned, nb
    ranked_by_gmm = -1  # no coarse stage: every candidate is scored exactly
    if refine < nb:
        ranked_by_gmm = 0
        levels = cdata.view(np.int8)
        head = cdata.view(np.float32)
        counts = cdata.view(np.int32)
        q32 = qbuf.astype(np.float32)
        coarse = np.empty(nb, dtype=np.int64)
        for t in range(nb):
            if t + 2 * _AHEAD < nb:
                prefetch_flat(coff, best[t + 2 * _AHEAD])
            if t + _AHEAD < nb:  # its lines: to the next row's start, at most a dense row's
                ahead = best[t + _AHEAD]
                for b in range(coff[ahead], min(coff[ahead + 1], coff[ahead] + HEADER + dim), CACHE_LINE):
                    prefetch_flat(cdata, b)
            r = best[t]
            if alive[r] and r != exclude:
                g = coarse_gmm(q32, qn, coff, levels, head, counts, r)
                if g < 0:  # a sparse row has no coarse copy: its exact GMM costs as little
                    g = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
                coarse[t] = np.int64(_GMM_LEVELS * g)
                ranked_by_gmm += 1
            else:
                coarse[t] = 0
        best = select(best, coarse, nb, refine, _GMM_LEVELS)
        nb = best.shape[0]
    n = 0
    for t in range(nb):
        if t + _AHEAD < nb:  # the next rows' vectors, while this one is scored (at most a dense row's lines)
            ahead = best[t + _AHEAD]
            for w in range(voff[ahead], min(voff[ahead + 1], voff[ahead] + 2 + dim), _LINE_VALUES):
                prefetch_flat(vf, w)
        r = best[t]
        if alive[r] and r != exclude:
            out_rows[n] = r
            out_sims[n] = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
            n += 1
    return n, scanned, n if ranked_by_gmm < 0 else ranked_by_gmm


def _search_many_impl(QP, QF, words, two, Qbuf, qn, exclude, profiles, starts, lrows, lfirst, lplanes, first, planes,
                      tail_lo, tail_hi, alive, coff, cdata, dim, voff, vi, vf, norms, probes, shortlist, rank_planes,
                      candidates, refine, out_rows, out_sims, counts, scanned, ranked):
    for i in prange(QP.shape[0]):
        counts[i], scanned[i], ranked[i] = search(
            QP[i], QF[i], words, two, Qbuf[i], qn[i], exclude[i], profiles, starts, lrows, lfirst, lplanes, first,
            planes, tail_lo, tail_hi, alive, coff, cdata, dim, voff, vi, vf, norms, probes, shortlist, rank_planes,
            candidates, refine, out_rows[i], out_sims[i])


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
