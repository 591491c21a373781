"""Fast sketch agreement: how many samples two GCWS sketches share, on 2-bit codes.

Ranking thousands of bucket candidates by agreement over all k samples is what
keeps the exact rerank small. Two bits per sample (the low bits of the b-bit
code, itself a hash of i*) keep a row at k/4 bytes, so gathering candidate
rows stays cheap; chance agreement is 1/4, which shifts every score alike:
``E[agree] = k·(GMM + (1 − GMM)/4)`` — still monotone in GMM.
"""

from __future__ import annotations

import numpy as np
from gmmlsh.core.intrinsics import popcount
from numba import njit

_M01 = np.uint64(0x5555555555555555)
SAMPLES_PER_WORD = 32


@njit(nogil=True, cache=True)
def _pack2(codes):
    n, k = codes.shape
    w = (k + SAMPLES_PER_WORD - 1) // SAMPLES_PER_WORD
    out = np.zeros((n, w), dtype=np.uint64)
    for v in range(n):
        for j in range(k):
            out[v, j >> 5] |= np.uint64(codes[v, j] & 3) << np.uint64(2 * (j & 31))
    return out


def pack2(codes: np.ndarray, words: int | None = None) -> np.ndarray:
    """b-bit codes (n, k) → their low 2 bits packed 32 per uint64 word (n, ceil(k/32)).

    ``words`` pads each row with zero words (equal on both sides: a constant offset).
    """
    out = _pack2(np.atleast_2d(np.asarray(codes, dtype=np.uint16)))
    if words is not None and words > out.shape[1]:
        out = np.hstack([out, np.zeros((out.shape[0], words - out.shape[1]), dtype=np.uint64)])
    return out


@njit(nogil=True, cache=True, inline="always")
def _agree(x):
    """Agreeing 2-bit codes in a word of XORed codes."""
    return popcount(~(x | (x >> np.uint64(1))) & _M01)


@njit(nogil=True, cache=True)
def agreement2(q, S, rows):
    """Samples on which query words ``q`` agree with rows ``rows`` of ``S`` (both from :func:`pack2`).

    Padding samples past k are zero on both sides and count for every row alike.
    """
    out = np.empty(rows.shape[0], dtype=np.int32)
    w = q.shape[0]
    for t in range(rows.shape[0]):
        r = rows[t]
        c = np.uint64(0)
        for j in range(w):
            c += _agree(S[r, j] ^ q[j])
        out[t] = np.int32(c)
    return out


#: Words of each row the first stage of the scan reads (256 samples: 64 bytes).
FIRST_WORDS = 8


@njit(nogil=True, cache=True, inline="always")
def _even_bits(x):
    """The 32 even bits of ``x`` packed into the low half (a 2-bit code's low bits, in order)."""
    x &= _M01
    x = (x | (x >> np.uint64(1))) & np.uint64(0x3333333333333333)
    x = (x | (x >> np.uint64(2))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return (x | (x >> np.uint64(16))) & np.uint64(0xFFFFFFFF)


@njit(nogil=True, cache=True)
def _bit_planes(W, out):
    """Rows of 8 packed 2-bit words (n, 8) → word-major bit planes ``out`` (8, n): words
    0–3 hold the codes' low bits (64 samples a word), 4–7 their high bits."""
    for r in range(W.shape[0]):
        for j in range(4):
            a, b = W[r, 2 * j], W[r, 2 * j + 1]
            out[j, r] = _even_bits(a) | (_even_bits(b) << np.uint64(32))
            out[4 + j, r] = _even_bits(a >> np.uint64(1)) | (_even_bits(b >> np.uint64(1)) << np.uint64(32))


def first_words(S: np.ndarray) -> np.ndarray:
    """The first-stage words of packed rows as bit planes, word-major ``(FIRST_WORDS, n)``: what the scan reads.

    Rows narrower than ``FIRST_WORDS`` are padded with zero words (equal on both
    sides: a constant offset).
    """
    W = np.zeros((S.shape[0], FIRST_WORDS), dtype=np.uint64)
    w1 = min(FIRST_WORDS, S.shape[1])
    W[:, :w1] = S[:, :w1]
    F = np.empty((FIRST_WORDS, S.shape[0]), dtype=np.uint64)
    _bit_planes(W, F)
    return F


@njit(nogil=True, cache=True)
def _scan_scores(q, F, have, n, scores):
    """Agreement of ``q`` (its first 8 packed words) with every row < n over the bit planes
    ``F`` (:func:`first_words`); −1 where ``have`` is 0.

    Bit planes: a sample agrees when neither its low nor its high bit differs, so
    one OR, one popcount and one add cover 64 samples (packed 2-bit words need
    twice the instructions per sample; measured 60 → 52 µs for 60,000 rows, the
    same scores). Word-major, unrolled, so the loop runs over rows: one lane per
    row, 8 rows an AVX-512 instruction, no horizontal sums.
    """
    qp = np.empty((FIRST_WORDS, 1), dtype=np.uint64)
    _bit_planes(q[:FIRST_WORDS].reshape((1, FIRST_WORDS)), qp)
    l0, l1, l2, l3, h0, h1, h2, h3 = qp[0, 0], qp[1, 0], qp[2, 0], qp[3, 0], qp[4, 0], qp[5, 0], qp[6, 0], qp[7, 0]
    f0, f1, f2, f3, f4, f5, f6, f7 = F[0], F[1], F[2], F[3], F[4], F[5], F[6], F[7]
    full = np.int32(FIRST_WORDS * SAMPLES_PER_WORD)
    for r in range(n):
        d = (popcount((f0[r] ^ l0) | (f4[r] ^ h0)) + popcount((f1[r] ^ l1) | (f5[r] ^ h1))
             + popcount((f2[r] ^ l2) | (f6[r] ^ h2)) + popcount((f3[r] ^ l3) | (f7[r] ^ h3)))
        h = np.int32(have[r])
        scores[r] = (full - np.int32(d)) * h + (h - 1)


@njit(nogil=True, cache=True, inline="always")
def _cut(hist, top, need, weight):
    """Walk down from the top score while the rows above, each counted ``weight`` times,
    stay short of ``need``: (the cut score, how many rows score above it).
    ``hist[s + 1]`` counts the rows scoring ``s``."""
    cut = top
    taken = 0
    while cut > 0 and (taken + hist[cut + 1]) * weight < need:
        taken += hist[cut + 1]
        cut -= 1
    return cut, taken


@njit(nogil=True, cache=True)
def _best(scores, rows, c, top):
    """(rows, scores) of the ``c`` best of ``scores`` (−1 = absent), by a counting selection.

    Ties at the cut go to the earliest; the result keeps the order of ``rows``.

    The histogram is kept four times over (row i counts in copy i mod 4) so that
    runs of equal scores do not serialise on one counter.
    """
    hists = np.zeros((4, top + 2), dtype=np.int64)
    n = scores.shape[0]
    for i in range(n):
        hists[i & 3, scores[i] + 1] += 1  # −1 (absent) lands in bin 0
    hist = hists[0] + hists[1] + hists[2] + hists[3]
    live = n - hist[0]
    c = min(c, live)
    cut, taken = _cut(hist, top, c, 1)  # lowest score that still makes the cut
    room = c - taken  # how many at exactly the cut fit
    keep = np.empty(c, dtype=np.int64)
    out = np.empty(c, dtype=np.int32)
    t = 0
    for i in range(n):
        s = scores[i]
        if s >= cut and s >= 0:
            if s == cut:
                if room == 0:
                    continue
                room -= 1
            keep[t] = rows[i]
            out[t] = s
            t += 1
    return keep[:t], out[:t]


#: The sampled cut of :func:`_best_of_all` reads every ``_SAMPLE_STRIDE``-th score
#: and aims for ``_SAMPLE_AIM`` × c rows above it.
_SAMPLE_STRIDE = 8
_SAMPLE_AIM = 2


@njit(nogil=True, cache=True)
def _best_of_all(scores, c, top):
    """:func:`_best` over rows ``0 … n−1`` (the same rows, the same ties) at half the cost.

    The full histogram is a random-increment pass over every score (30 µs for
    60,000). Instead the histogram of a strided sample gives a cut that keeps about
    twice ``c``; the rows at or above it are collected in row order and
    :func:`_best` picks exactly among them. Whenever the collected rows are fewer
    than ``c`` (the sample misjudged, or few rows are live) it falls back to the
    full selection, so the answer never depends on the sample.
    """
    n = scores.shape[0]
    if n < 16 * c:
        return _best(scores, np.arange(n), c, top)
    hist = np.zeros(top + 2, dtype=np.int64)
    for i in range(0, n, _SAMPLE_STRIDE):
        hist[scores[i] + 1] += 1
    cut, _ = _cut(hist, top, _SAMPLE_AIM * c, _SAMPLE_STRIDE)
    cut = max(cut, 0)
    keep = np.empty(n, dtype=np.int64)
    t = 0
    for i in range(n):  # branch-free compaction: 20 % faster than np.flatnonzero(scores >= cut)
        keep[t] = i
        t += scores[i] >= cut
    if t < c:
        return _best(scores, np.arange(n), c, top)
    rows = keep[:t]
    return _best(scores[rows], rows, c, top)


@njit(nogil=True, cache=True)
def top_by_agreement(q, S, F, have, n, c):
    """Rows ``< n`` with ``have`` set whose agreement with ``q`` is among the ``c`` highest.

    The scan that replaces bucket reads when every sketch of the index is in
    memory, in two stages: the first-stage words (``F``, word-major, from
    :func:`first_words`) of every row pick the best max(4·c, 1024), then all
    words of ``S`` rank those. Measured on Fashion-MNIST the first stage loses
    almost nothing (recall@10 0.993 vs 0.994 at c = 200) and reads half the
    bytes. Counting selections over the small integer scores, so no sort of n
    values. ``q`` and ``S`` have at least ``FIRST_WORDS`` words (``pack2`` with
    ``words`` a multiple of 8). Returns (rows, scores), rows ascending.
    """
    w = q.shape[0]
    w1 = FIRST_WORDS
    if w < w1 or S.shape[1] != w or F.shape[0] != w1:
        raise ValueError("top_by_agreement: q and S need the same number of words, at least FIRST_WORDS")
    scores = np.empty(n, dtype=np.int32)
    _scan_scores(q, F, have, n, scores)
    first, _ = _best_of_all(scores, max(4 * c, 1024) if w > w1 else c, w1 * SAMPLES_PER_WORD)
    if w == w1:
        return first, scores[first]
    full = agreement2(q, S, first)
    return _best(full, first, c, w * SAMPLES_PER_WORD)
