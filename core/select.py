"""Choosing the best few of many small-integer scores, without sorting them.

Both searches end their cheap first pass with many scored entries (a sketch search: tens of
thousands of rows by first-stage agreement; the postings search: every row by a partial
similarity level) of which they keep a few hundred. Scores are small integers, so a
histogram finds the cut. Over many entries even that costs more than the scoring itself
(docs/tuning.md), so :func:`choose`
estimates the cut from a sample of the scores, gathers the entries at or above it 16 at a
time (:func:`gather_above`: one test per group), and chooses exactly among those.
Ties go to the earliest entry everywhere, so the result is that of a stable sort.
"""

from __future__ import annotations

import numpy as np
from numba import njit


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

    A counting pass over the small integer scores (:func:`keep_best`, on copies): no sort of
    ``m`` values.
    """
    refs = ids[:m].copy()
    if count >= m:
        return refs
    return refs[:keep_best(refs, scores[:m].copy(), m, count, top)[1]]


@njit(nogil=True, cache=True)
def keep_best(refs, scores, m, count, top):
    """Keep the ``count`` best of the first ``m`` entries (scores in ``[0, top]``) at the front, in
    order (ties to the earliest); returns (the lowest score kept, how many were kept)."""
    hist = np.zeros(top + 1, dtype=np.int64)
    for i in range(m):
        hist[scores[i]] += 1
    cut, room = _cut(hist, count)
    k = 0
    for i in range(m):
        s = scores[i]
        if s > cut or (s == cut and room > 0):
            room -= s == cut
            refs[k] = refs[i]
            scores[k] = s
            k += 1
    return cut, k


#: Entries compared with the cut at a time (their best first: most groups hold none above it).
GROUP = 16
#: Entries of the sample above its cut, at the least, for :func:`estimated_cut` (its stride
#: follows from it), and the largest stride.
_SAMPLED_ABOVE = 24
_MAX_STRIDE = 16


@njit(nogil=True, cache=True)
def estimated_cut(scores, m, count, top):
    """A score below the cut of the ``count`` best of ``scores[:m]`` (in ``[0, top]``), most
    likely: the cut of a sample (every ``stride``-th score, the stride such that about
    :data:`_SAMPLED_ABOVE` sampled scores or more lie above the cut) taken for 1.5 times ``count``,
    and one lower — a margin of several sample standard deviations."""
    stride = max(1, min(_MAX_STRIDE, count // _SAMPLED_ABOVE))
    hist = np.zeros(top + 1, dtype=np.int32)
    for i in range(0, m, stride):
        hist[scores[i]] += 1
    cut = _cut(hist, (3 * count) // (2 * stride) + 1)[0]
    return max(0, cut - 1)


#: No cut (every entry gathered): a numpy integer, as a literal 0 would compile
#: :func:`gather_above` once more.
_NO_CUT = np.int64(0)
#: The top bit of each 16-bit lane of a word.
_LANE_TOPS = np.uint64(0x8000800080008000)


@njit(nogil=True, cache=True)
def gather_above(scores, spans, cut, refs, kept):
    """Refs and scores of every scored entry at or above ``cut`` (``spans``: per scored run, its
    first position in ``scores`` — a multiple of :data:`GROUP` —, its first ref and its size),
    in order; returns how many, or −1 when they do not fit in ``refs``.

    A group of 16 scores is tested at once, as 4 words: adding ``0x8000 − cut`` to each 16-bit
    lane sets the lane's top bit exactly when its score (< 0x8000) is at least ``cut``, and
    no lane carries into the next. ``scores`` must therefore hold whole words (a multiple of 4
    entries; whole groups, as :func:`choose` passes them)."""
    words = scores.view(np.uint64)
    lift = np.uint64(0x8000 - cut) * np.uint64(0x0001000100010001)
    m = 0
    room = refs.shape[0] - GROUP
    for j in range(spans.shape[0] - 1):
        at, ref0 = spans[j, 0], spans[j, 1]
        size = spans[j, 2]
        for g0 in range(0, size, GROUP):
            w = (at + g0) // 4
            if ((words[w] + lift) | (words[w + 1] + lift) | (words[w + 2] + lift) | (words[w + 3] + lift)) & _LANE_TOPS:
                for e in range(g0, min(size, g0 + GROUP)):  # no branch per entry: written always, kept if above
                    s = np.int64(scores[at + e])
                    refs[m] = ref0 + e
                    kept[m] = s
                    m += s >= cut
                if m > room:
                    return -1
    return m


@njit(nogil=True, cache=True)
def choose(scores, spans, count, top):
    """The refs of the ``count`` best scored entries, in order, ties to the earliest. ``scores``:
    uint16 in ``[0, top]``, in runs padded with zeros to whole groups; ``spans``: one row per
    run (its first position, its first ref, its size), then a last row (the scores' end, 0, 0).
    A cut is estimated from a sample of the scores (:func:`estimated_cut`), the entries at or
    above it gathered and the best chosen among those; in the rare case the estimate keeps too
    few (or too many to hold), every entry is gathered instead."""
    scanned = spans[:, 2].sum()
    m = spans[spans.shape[0] - 1, 0]
    cut = estimated_cut(scores, m, count, top) if scanned > count else 0
    room = min(scanned, 4 * count) + 2 * GROUP
    refs = np.empty(room, dtype=np.int64)
    kept = np.empty(room, dtype=np.int64)
    found = gather_above(scores, spans, cut, refs, kept)
    if found < count and cut > 0 or found < 0:  # the estimate kept too few, or too many: every entry
        refs = np.empty(m + GROUP, dtype=np.int64)
        kept = np.empty(m + GROUP, dtype=np.int64)
        found = gather_above(scores, spans, _NO_CUT, refs, kept)
    found = keep_best(refs, kept, found, count, top)[1]
    return refs[:found]


#: Answers up to this long are chosen by :func:`_insertion_top`; longer ones by numpy.
_INSERTION_K = 64


@njit(nogil=True, cache=True)
def _insertion_top(values, k):
    """Positions of the ``k`` largest ``values``, largest first, ties to the earlier position: each
    value inserted into a sorted run of at most ``k`` (most fail the first test once it is full).
    Written out rather than a compiled stable sort, which took seconds to compile."""
    top = np.empty(k, dtype=np.int64)
    m = 0
    for i in range(values.shape[0]):
        v = values[i]
        if m == k and v <= values[top[k - 1]]:  # a later equal value stays behind the earlier
            continue
        j = m if m < k else k - 1
        while j > 0 and values[top[j - 1]] < v:
            top[j] = top[j - 1]
            j -= 1
        top[j] = i
        m = min(m + 1, k)
    return top[:m]


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest ``values`` (float), largest first, ties by position:
    compiled for an answer's length (a fifth of numpy's call overheads), a partition and a sort
    of the partition's ``k`` for longer ones."""
    k = min(k, values.shape[0])
    if k == 0:
        return np.zeros(0, np.int64)
    if k <= _INSERTION_K:
        return _insertion_top(values, k)
    kth = -np.partition(-values, k - 1)[k - 1]
    above = np.flatnonzero(values > kth)
    part = np.concatenate([above, np.flatnonzero(values == kth)[:k - above.shape[0]]])
    return part[np.lexsort((part, -values[part]))]
