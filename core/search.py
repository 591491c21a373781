"""The query kernels: candidates from the inverted lists of every segment and from the tail,
ranked on sketch agreement, then on coarse GMM, exact GMM of the best few; and exact search.

Flat numba functions over the bundles of :mod:`gmmlsh.core.bundles` (a mirror's
:class:`~gmmlsh.core.bundles.Rows` and :class:`~gmmlsh.core.bundles.Lists`, a
:class:`~gmmlsh.core.bundles.Query` and a :class:`~gmmlsh.core.bundles.Budget`).

Every stage reads fewer rows than the one before, laid out so the reads are cheap: the scan
streams the probed lists' first-stage rows in order (word by word, vectorised); every later
stage reads rows from anywhere, and its cost is the cache lines it fetches — so each reads as
few as it can (the low bit planes in list order, then int8 coarse rows, then the float32 rows
of the best ``refine``) and asks for the next rows' lines while it scores the current ones.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.bundles import SEG_LSTARTS
from gmmlsh.core.coarse import HEADER, coarse_gmm
from gmmlsh.core.codes import WORD
from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.intrinsics import CACHE_LINE, popcount, prefetch, prefetch_flat
from gmmlsh.core.ivf import FIRST_WORDS, first_agreement, list_scores, profile_scores
from gmmlsh.core.select import GROUP, choose, select

#: Rows the rank and GMM passes ask for ahead of the one they score (each is a random row:
#: a full memory latency unless requested early).
_AHEAD = 8
_LINE_WORDS = CACHE_LINE // 8  # uint64 words per cache line
_LINE_VALUES = CACHE_LINE // 4  # float32 values per cache line
# Constants a kernel passes to another are numpy integers: a Python int would be typed as its
# literal value, and the callee compiled once more for it.
#: Highest first-stage score (bits in a first-stage row).
_FIRST_TOP = np.int64(FIRST_WORDS * WORD)
#: Levels a coarse GMM is cut to for choosing the rows scored exactly (a counting selection).
_GMM_LEVELS = np.int64(4095)


@njit(nogil=True, cache=True, fastmath=_FAST)
def row_gmm(qbuf, qn, voff, vi, vf, norms, r):
    """Exact GMM ``S / (‖q‖₁ + ‖v‖₁ − S)`` of the query (dense buffer ``qbuf``, norm ``qn``)
    against mirror row ``r``.

    The row is sliced before the loop: indexing ``vf[base + i]`` directly makes numba check
    every index for wrap-around, which stops LLVM vectorising. Sparse indices are read as
    unsigned for the same reason.
    """
    off = voff[r]
    count = vi[off]
    s = 0.0
    if vi[off + 1] == 0:
        vals = vf[off + 2:off + 2 + count]
        for i in range(count):
            s += _same_sign_min(qbuf[i], np.float64(vals[i]))
    else:
        idx = vi[off + 2:off + 2 + count]
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
def chosen_lists(q, lists, budget):
    """The ``budget.probes`` lists whose profiles agree best with the query (every list when
    that is as many as there are), in list order."""
    nlist = lists.profiles.shape[1]
    chosen = np.arange(nlist)
    if budget.probes < nlist:
        pscore = np.empty(nlist, dtype=np.int64)
        profile_scores(lists.profiles, q.planes, budget.words, budget.two, pscore)
        chosen = select(chosen, pscore, nlist, budget.probes, budget.words * WORD)
    return chosen


@njit(nogil=True, cache=True)
def shortlist_of(q, rows, lists, budget):
    """The first stage: the ``budget.shortlist`` best by first-stage agreement among the
    entries of the chosen lists (:func:`chosen_lists`) of every segment and the tail rows,
    ties to the earliest. Returns (refs, rows scanned): a ref below the length of the list
    arenas is an arena entry, any other is that length plus a (tail) mirror row.

    Every entry is scored first (a vectorised pass over each list, as fast as memory streams
    it), then the shortlist chosen (:func:`gmmlsh.core.select.choose`)."""
    chosen = chosen_lists(q, lists, budget)
    segs, lstarts = lists.segs, lists.lstarts
    entries = lists.lrows.shape[0]
    tail = lists.tail_hi - lists.tail_lo
    # Each run of scores (a list of a segment, then the tail) starts at a multiple of GROUP, zeros between.
    total = (tail + GROUP - 1) // GROUP * GROUP + GROUP
    runs = 0
    for s in range(segs.shape[0]):
        base = segs[s, SEG_LSTARTS]
        for c in chosen:
            size = lstarts[base + c + 1] - lstarts[base + c]
            if size:
                total += (size + GROUP - 1) // GROUP * GROUP
                runs += 1
    scores = np.empty(total, dtype=np.uint16)
    spans = np.empty((runs + 2, 3), dtype=np.int64)  # per run: first position, first ref, size
    at = 0
    j = 0
    for s in range(segs.shape[0]):
        base = segs[s, SEG_LSTARTS]
        for c in chosen:
            lo = lstarts[base + c]
            size = lstarts[base + c + 1] - lo
            if size == 0:
                continue
            spans[j, 0], spans[j, 1], spans[j, 2] = at, lo, size
            list_scores(lists.lfirst, lo, size, q.first, scores[at:])
            end = (at + size + GROUP - 1) // GROUP * GROUP
            scores[at + size:end] = 0
            at = end
            j += 1
    spans[j, 0], spans[j, 1], spans[j, 2] = at, entries + lists.tail_lo, tail
    first = rows.first
    for r in range(lists.tail_lo, lists.tail_hi):
        scores[at + r - lists.tail_lo] = first_agreement(first[r], q.first)
    end = (at + tail + GROUP - 1) // GROUP * GROUP
    scores[at + tail:end] = 0
    spans[j + 1, 0], spans[j + 1, 1], spans[j + 1, 2] = end, 0, 0
    return choose(scores, spans, budget.shortlist, _FIRST_TOP), spans[:, 2].sum()


@njit(nogil=True, cache=True)
def _rank(q, rows, lists, budget, short):
    """The shortlist's mirror rows and their agreement on the low ``rank_planes`` bits of every
    sample (0 for a retired row and the excluded one): list entries read from the arena's copy
    of their planes (near what the scan read), tail rows from the mirror's."""
    entries = lists.lrows.shape[0]
    lplanes, planes, alive = lists.lplanes, rows.planes, rows.alive
    words, nplanes = budget.words, budget.rank_planes
    stride = nplanes * words
    k = short.shape[0]
    found = np.empty(k, dtype=np.int64)
    ranked = np.empty(k, dtype=np.int64)
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
            r = np.int64(lists.lrows[ref])
            score = _agree(lplanes[ref], q.planes, words, nplanes)
        else:
            r = ref - entries
            score = _agree(planes[r], q.planes, words, nplanes)
        found[t] = r
        ranked[t] = score if alive[r] and r != q.exclude else 0
    return found, ranked


@njit(nogil=True, cache=True)
def _coarse_best(q, rows, best, refine):
    """The ``refine`` best of the candidate rows ``best`` by GMM on their coarse copies
    (:mod:`gmmlsh.core.coarse`; a sparse row, which has none, exactly), and how many were
    ranked (live, not excluded)."""
    coff, cdata, alive, voff, vf = rows.coff, rows.cdata, rows.alive, rows.voff, rows.vf
    levels, head, counts = cdata.view(np.int8), cdata.view(np.float32), cdata.view(np.int32)
    q32 = q.dense.astype(np.float32)
    nb = best.shape[0]
    coarse = np.empty(nb, dtype=np.int64)
    ranked = 0
    for t in range(nb):
        if t + 2 * _AHEAD < nb:
            far = best[t + 2 * _AHEAD]
            prefetch_flat(coff, far)
            prefetch_flat(voff, far)
        if t + _AHEAD < nb:  # its lines: to the next row's start, at most a dense row's
            ahead = best[t + _AHEAD]
            lo, hi = coff[ahead], coff[ahead + 1]
            for b in range(lo, min(hi, lo + HEADER + rows.dim), CACHE_LINE):
                prefetch_flat(cdata, b)
            if hi - lo == HEADER:  # a sparse row (no coarse levels): the lines of its indices and values
                for w in range(voff[ahead], voff[ahead + 1], _LINE_VALUES):
                    prefetch_flat(vf, w)
        r = best[t]
        if alive[r] and r != q.exclude:
            g = coarse_gmm(q32, q.norm, coff, levels, head, counts, r)
            if g < 0:  # a sparse row has no coarse copy: its exact GMM costs as little
                g = row_gmm(q.dense, q.norm, rows.voff, rows.vi, rows.vf, rows.norms, r)
            coarse[t] = np.int64(_GMM_LEVELS * g)
            ranked += 1
        else:
            coarse[t] = 0
    return select(best, coarse, nb, refine, _GMM_LEVELS), ranked


@njit(nogil=True, cache=True)
def exact_of(q, rows, best, out_rows, out_sims):
    """Exact GMM of the query against the rows ``best`` (live ones, the excluded one left out)
    into the outputs; returns how many were written."""
    voff, vf, alive = rows.voff, rows.vf, rows.alive
    nb = best.shape[0]
    n = 0
    for t in range(nb):
        if t + _AHEAD < nb:  # the next rows' vectors, while this one is scored (at most a dense row's lines)
            ahead = best[t + _AHEAD]
            for w in range(voff[ahead], min(voff[ahead + 1], voff[ahead] + 2 + rows.dim), _LINE_VALUES):
                prefetch_flat(vf, w)
        r = best[t]
        if alive[r] and r != q.exclude:
            out_rows[n] = r
            out_sims[n] = row_gmm(q.dense, q.norm, voff, rows.vi, vf, rows.norms, r)
            n += 1
    return n


@njit(nogil=True, cache=True)
def search(q, rows, lists, budget, out_rows, out_sims):
    """One query: returns (rows written to ``out_rows``/``out_sims``, rows scanned, candidates
    ranked by GMM).

    1. the first stage (:func:`shortlist_of`): the ``shortlist`` best of the probed lists and the tail;
    2. those ranked on the low ``rank_planes`` bits (1–4) of every sample;
    3. the ``candidates`` best of those ranked by coarse GMM (:mod:`gmmlsh.core.coarse`);
    4. the ``refine`` best of those scored by exact GMM (unsorted; the caller ranks). With
       ``refine`` ≥ ``candidates`` every candidate is scored exactly; with ``refine`` 0 the
       candidates are returned unscored (similarity 0: which rows a setting reaches).
    Retired rows and the query's ``exclude`` row are skipped.
    """
    short, scanned = shortlist_of(q, rows, lists, budget)
    found, ranked = _rank(q, rows, lists, budget, short)
    best = select(found, ranked, short.shape[0], budget.candidates, budget.words * WORD)
    nb = best.shape[0]
    if budget.refine == 0:
        for t in range(nb):  # a loop, not a slice assignment: that compiles numba's shape errors (seconds)
            out_rows[t] = best[t]
        out_sims[:nb] = 0.0
        return nb, scanned, nb
    if budget.refine < nb:
        best, by_gmm = _coarse_best(q, rows, best, budget.refine)
        n = exact_of(q, rows, best, out_rows, out_sims)
        return n, scanned, by_gmm
    n = exact_of(q, rows, best, out_rows, out_sims)  # no coarse stage: every candidate scored exactly
    return n, scanned, n


@njit(nogil=True, cache=True)
def exact_scan(qbuf, qn, exclude, rows, lo, hi, out):
    """Exact GMM of one query against every row of ``[lo, hi)`` into ``out[r − lo]`` (−1 for
    retired rows and ``exclude``)."""
    for r in range(lo, hi):
        if rows.alive[r] and r != exclude:
            out[r - lo] = row_gmm(qbuf, qn, rows.voff, rows.vi, rows.vf, rows.norms, r)
        else:
            out[r - lo] = -1.0


#: Coordinates summed into one block of the bound exact search prunes rows with
#: (:func:`bound_sums`): narrow enough that the bound is tight on images, wide enough that it
#: costs a small share of an exact score (docs/tuning.md, "Exact search in blocks").
BOUND_WIDTH = 16


@njit(nogil=True, cache=True, inline="always", fastmath=_FAST)
def _nonnegative(vals):
    """Whether no value is negative: a vectorised minimum (``np.min`` compiled its own machinery
    for every array type it met: seconds of a first start)."""
    low = 0.0
    for i in range(vals.shape[0]):
        low = min(low, np.float64(vals[i]))
    return low >= 0.0


@njit(nogil=True, cache=True)
def _rows_nonnegative(Q):
    """Whether no row of ``Q`` has a negative value (a function of its own: its answer is a
    ``bool``, where a flag set to a constant in the caller would reach a kernel as a literal)."""
    for j in range(Q.shape[0]):
        if not _nonnegative(Q[j]):
            return False
    return True


@njit(nogil=True, cache=True, fastmath=_FAST)
def _block_sums(vals, sums):
    """``sums[b]``: the positive values of coordinates ``[b·W, (b+1)·W)`` summed, ``sums[B + b]``
    the magnitudes of its negative ones (``W`` = :data:`BOUND_WIDTH`, ``B`` = half of ``sums``).
    Returns how many of ``sums`` a bound must read: ``B`` where no value is negative."""
    nb = sums.shape[0] // 2
    whole = vals.shape[0] // BOUND_WIDTH
    if _nonnegative(vals):
        for b in range(whole):  # a fixed width: unrolled, vectorised
            block = vals[b * BOUND_WIDTH:(b + 1) * BOUND_WIDTH]
            total = 0.0
            for i in range(BOUND_WIDTH):
                total += np.float64(block[i])
            sums[b] = total
        for b in range(whole, nb):
            sums[b] = 0.0
            for i in range(b * BOUND_WIDTH, min((b + 1) * BOUND_WIDTH, vals.shape[0])):
                sums[b] += np.float64(vals[i])
        sums[nb:] = 0.0  # read where the other side has negative values
        return nb
    for b in range(nb):
        pos = 0.0
        neg = 0.0
        for i in range(b * BOUND_WIDTH, min((b + 1) * BOUND_WIDTH, vals.shape[0])):
            v = np.float64(vals[i])
            pos += max(v, 0.0)
            neg += max(-v, 0.0)
        sums[b] = pos
        sums[nb + b] = neg
    return 2 * nb


def bound_sums(Q: np.ndarray) -> np.ndarray:
    """The block sums of each dense row of ``Q``, ``(m, 2·⌈dim / W⌉)``, as :func:`_block_sums` gives
    a stored row's (a test holds them equal): what :func:`exact_block` bounds a query's GMM with.
    In numpy, once a batch: the kernel would be compiled once more, for float64 queries."""
    m, d = Q.shape
    nb = -(-d // BOUND_WIDTH)
    blocks = np.zeros((m, nb * BOUND_WIDTH))
    blocks[:, :d] = Q
    blocks = blocks.reshape(m, nb, BOUND_WIDTH)
    return np.concatenate([np.maximum(blocks, 0.0).sum(axis=2), np.maximum(-blocks, 0.0).sum(axis=2)], axis=1)


@njit(nogil=True, cache=True, fastmath=_FAST)
def _bound(qsums, sums, used):
    """An upper bound of ``S`` from block sums: ``Σ_b min(U_b, V_b)`` sign by sign (a block's
    same-sign minima add up to at most the smaller of its two sums), over the first ``used``."""
    s = 0.0
    for b in range(used):
        s += min(qsums[b], sums[b])
    return s


@njit(nogil=True, cache=True, fastmath=_FAST)
def _row_against_all(Q, QT, nonneg, voff, vi, vf, r, s, todo):
    """``s[j] = S`` of mirror row ``r`` against every query ``j`` (``Q``: the queries' dense
    buffers, ``(m, dim)``; ``QT``: the same transposed; ``nonneg``: no query has a negative
    value); a dense row only against the queries ``todo`` names. The row is read from memory
    once: a dense row, from the cache, against each query in turn (a vectorised sum over its
    values); a sparse row value by value, against all the queries' values of its coordinate at
    once (side by side in ``QT``: one vectorised pass, where a query at a time would gather).
    Where neither side has a negative value the same-sign minimum is the minimum (one
    instruction, not four). Not inlined: it keeps its own fast-math flags, which let the sums
    vectorise."""
    off = voff[r]
    count = vi[off]
    m = s.shape[0]
    if vi[off + 1] == 0:
        vals = vf[off + 2:off + 2 + count]
        if nonneg and _nonnegative(vals):
            for j in range(m):
                if todo[j]:
                    q = Q[j]
                    total = 0.0
                    for i in range(count):
                        total += min(q[i], np.float64(vals[i]))
                    s[j] = total
        else:
            for j in range(m):
                if todo[j]:
                    q = Q[j]
                    total = 0.0
                    for i in range(count):
                        total += _same_sign_min(q[i], np.float64(vals[i]))
                    s[j] = total
    else:
        s[:] = 0.0
        idx = vi[off + 2:off + 2 + count]
        vals = vf[off + 2 + count:off + 2 + 2 * count]
        if nonneg and _nonnegative(vals):
            for p in range(count):
                v = np.float64(vals[p])
                qrow = QT[idx[p]]
                for j in range(m):
                    s[j] += min(qrow[j], v)
        else:
            for p in range(count):
                v = np.float64(vals[p])
                qrow = QT[idx[p]]
                for j in range(m):
                    s[j] += _same_sign_min(qrow[j], v)


#: ``out`` of :func:`exact_block` for a row a query's bound rules out.
PRUNED = -2.0


@njit(nogil=True, cache=True)
def exact_block(Q, QT, qn, exclude, rows, lo, hi, out, qsums, floor):
    """Exact GMM of many queries against rows ``lo ≤ r < hi``: ``out[j, r − lo]`` (−1 for retired
    rows and query j's ``exclude[j]``). A row is read from memory once for all the queries (see
    :func:`_row_against_all`).

    ``floor[j] > 0``: query j only wants rows that may reach it — a dense row whose GMM bound
    (the row's block sums against the query's, ``qsums[j]`` from :func:`bound_sums`) is below
    it is not scored (:data:`PRUNED`). Exact search sets the floor a little under the ``k``-th
    best similarity found so far: the answer is the same, at a fraction of the work."""
    m = qn.shape[0]
    nonneg = _rows_nonnegative(Q)
    prunes = False
    for j in range(m):
        prunes = prunes or floor[j] > 0
    s = np.empty(m)
    todo = np.ones(m, np.bool_)
    sums = np.empty(qsums.shape[1])
    for r in range(lo, hi):
        if not rows.alive[r]:
            for j in range(m):
                out[j, r - lo] = -1.0
            continue
        nr = rows.norms[r]
        off = rows.voff[r]
        dense = rows.vi[off + 1] == 0
        if prunes and dense:
            used = _block_sums(rows.vf[off + 2:off + 2 + rows.vi[off]], sums)
            for j in range(m):  # S ≤ the smaller norm, then the block sums' bound
                todo[j] = floor[j] <= 0.0 or (min(qn[j], nr) >= floor[j] * max(qn[j], nr) and
                                              _ratio(_bound(qsums[j], sums, used), qn[j], nr) >= floor[j])
        _row_against_all(Q, QT, nonneg, rows.voff, rows.vi, rows.vf, r, s, todo)
        for j in range(m):
            if r == exclude[j]:
                out[j, r - lo] = -1.0
            elif todo[j] or not dense:
                out[j, r - lo] = _ratio(s[j], qn[j], nr)
            else:
                out[j, r - lo] = PRUNED
        if prunes and dense:
            todo[:] = True


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
        idx = vi[off + 2:off + 2 + count]
        vals = vf[off + 2 + count:off + 2 + 2 * count]
        for p in range(count):
            x = np.float64(vals[p])
            dot += qbuf[idx[p]] * x
            sq += x * x
    return dot / (q_l2 * np.sqrt(sq))


@njit(nogil=True, cache=True)
def exact_rows(q, rows, which, out_rows, out_sims):
    """Exact GMM of the query against the mirror rows ``which`` (live ones, the excluded one
    left out) into the outputs; returns how many were written."""
    n = 0
    for t in range(which.shape[0]):
        r = np.int64(which[t])  # uint32 in the arena: as every other caller's row, one compiled row_gmm
        if rows.alive[r] and r != q.exclude:
            out_rows[n] = r
            out_sims[n] = row_gmm(q.dense, q.norm, rows.voff, rows.vi, rows.vf, rows.norms, r)
            n += 1
    return n


@njit(nogil=True, cache=True)
def exact_range(q, rows, lo, hi, out_rows, out_sims):
    """:func:`exact_rows` of the mirror rows ``[lo, hi)`` (the tail)."""
    n = 0
    for r in range(lo, hi):
        if rows.alive[r] and r != q.exclude:
            out_rows[n] = r
            out_sims[n] = row_gmm(q.dense, q.norm, rows.voff, rows.vi, rows.vf, rows.norms, r)
            n += 1
    return n
