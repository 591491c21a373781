"""Inverted lists over sketches: k-modes centroids, the assignment of rows to them, and
the list layout the search scans.

The search partitions the index into lists of similar vectors so that a query
scans a few lists instead of the whole index. Similarity here is sketch
agreement on *first-stage rows*: the first 64 bytes of a sketch's bit planes
(:mod:`gmmlsh.core.codes`) — with 512 samples or more, the lowest bit of the codes of the
first 512; with fewer, the next planes too (256 samples: two bits of each) — compared bit
by bit. One bit of 512 samples ranks better than two bits of 256 in the same bytes (as the
b-bit minwise hashing papers find for high similarities). Centroids are *modes*: per
bit, the value most common among a list's members — the k-means of categorical codes
(k-modes). A few rounds on a sample put nearly all of a query's true top 10 in a few
percent of the rows (docs/tuning.md, "First-stage rows and inverted lists").

A query chooses its lists by their *profiles*: the 2-bit modes of the members over every
sample (not only the first 256 the assignment uses): on the same lists, the lists holding
a query's true top 10 then rank higher. Profiles are stored transposed,
``(2 · words, lists)``, so that scoring every list is one vectorised pass.

A list's first-stage rows are stored word by word (:func:`list_layout`): list ``c``'s
word ``w`` of every entry lies at ``L[8·starts[c] + w·size : …+ size]``, so that
:func:`list_scores` scores 8 entries per vector instruction (AVX-512 ``vpopcntq``)
instead of one row at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.codes import WORD
from gmmlsh.core.intrinsics import popcount
from gmmlsh.core.parallel import spread

#: Words of a first-stage row: the first 8 words of a plane row (plane 0 of 512 samples, or
#: planes 0 and 1 of 256, …), zero where a sketch has fewer bits (equal on both sides).
FIRST_WORDS = 8


def first_rows(planes: np.ndarray, words: int, bits: int) -> np.ndarray:
    """First-stage rows ``(n, FIRST_WORDS)`` of plane rows ``(n, bits · words)``."""
    out = np.zeros((planes.shape[0], FIRST_WORDS), dtype=np.uint64)
    w = min(FIRST_WORDS, bits * words)
    out[:, :w] = planes[:, :w]
    return out


@njit(nogil=True, cache=True, inline="always")
def first_agreement(a, b):
    """Bits (of 512) on which two first-stage rows agree.

    Written out for the fixed layout: with the width as a runtime value nothing is unrolled
    and every index is range-checked (docs/tuning.md).
    """
    return (popcount(~(a[0] ^ b[0])) + popcount(~(a[1] ^ b[1])) + popcount(~(a[2] ^ b[2]))
            + popcount(~(a[3] ^ b[3])) + popcount(~(a[4] ^ b[4])) + popcount(~(a[5] ^ b[5]))
            + popcount(~(a[6] ^ b[6])) + popcount(~(a[7] ^ b[7])))


@njit(nogil=True, cache=True)
def list_scores(L, lo, size, qf, out):
    """First-stage agreement of the query's row ``qf`` with the ``size`` entries of the list
    starting at entry ``lo`` of a :func:`list_layout` array, into ``out[:size]`` (uint16)."""
    base = lo * FIRST_WORDS
    q0, q1, q2, q3, q4, q5, q6, q7 = qf[0], qf[1], qf[2], qf[3], qf[4], qf[5], qf[6], qf[7]
    w0, w1 = L[base:base + size], L[base + size:base + 2 * size]
    w2, w3 = L[base + 2 * size:base + 3 * size], L[base + 3 * size:base + 4 * size]
    w4, w5 = L[base + 4 * size:base + 5 * size], L[base + 5 * size:base + 6 * size]
    w6, w7 = L[base + 6 * size:base + 7 * size], L[base + 7 * size:base + 8 * size]
    for e in range(size):
        out[e] = np.uint16(popcount(~(w0[e] ^ q0)) + popcount(~(w1[e] ^ q1)) + popcount(~(w2[e] ^ q2))
                           + popcount(~(w3[e] ^ q3)) + popcount(~(w4[e] ^ q4)) + popcount(~(w5[e] ^ q5))
                           + popcount(~(w6[e] ^ q6)) + popcount(~(w7[e] ^ q7)))


def list_layout(F: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """First-stage rows ``F`` (entries in list order, ``(entries, FIRST_WORDS)``) laid out word
    by word within each list (flat uint64; see the module docstring)."""
    out = np.empty(F.shape[0] * FIRST_WORDS, dtype=np.uint64)
    for c in range(starts.shape[0] - 1):
        lo, hi = int(starts[c]), int(starts[c + 1])
        out[lo * FIRST_WORDS:hi * FIRST_WORDS] = F[lo:hi].T.ravel()
    return out


@njit(nogil=True, cache=True)
def _profiles(planes, rows, labels, nlist, words, two):
    """Per list, per sample, the most common low-2-bit code of the members (planes 0 and 1),
    transposed: ``(2 · words, nlist)``."""
    counts = np.zeros((nlist, words * WORD, 4), dtype=np.int32)
    for i in range(rows.shape[0]):
        c = labels[i]
        r = rows[i]
        for w in range(words):
            lo = planes[r, w]
            hi = planes[r, words + w] if two else np.uint64(0)
            for s in range(WORD):
                code = ((lo >> np.uint64(s)) & np.uint64(1)) | (((hi >> np.uint64(s)) & np.uint64(1)) << np.uint64(1))
                counts[c, w * WORD + s, code] += 1
    out = np.zeros((2 * words, nlist), dtype=np.uint64)
    for c in range(nlist):
        for w in range(words):
            for s in range(WORD):
                code = np.argmax(counts[c, w * WORD + s])
                bit = np.uint64(1) << np.uint64(s)
                if code & 1:
                    out[w, c] |= bit
                if code & 2:
                    out[words + w, c] |= bit
    return out


def profiles(planes: np.ndarray, rows: np.ndarray, labels: np.ndarray, nlist: int, words: int, bits: int
             ) -> np.ndarray:
    """Profiles of ``nlist`` lists: the 2-bit modes of their members' codes over every sample
    (``planes[rows[i]]``: member ``i``'s plane row; ``labels[i]``: its list), ``(2 · words, nlist)``."""
    return _profiles(planes, rows, labels, nlist, words, bits >= 2)


@njit(nogil=True, cache=True)
def profile_scores(P, qp, words, two, out):
    """2-bit agreement of the query's plane row ``qp`` with every list profile (``P``:
    :func:`profiles`) into ``out`` (one vectorised pass per word)."""
    out[:] = 0
    for w in range(words):
        q0 = qp[w]
        q1 = qp[words + w] if two else np.uint64(0)
        p0, p1 = P[w], P[words + w]
        for c in range(out.shape[0]):
            out[c] += popcount(~((p0[c] ^ q0) | (p1[c] ^ q1)))


@njit(nogil=True, cache=True)
def _assign_profiles(planes, rows, P, words, two, out):
    score = np.empty(P.shape[1], dtype=np.int64)
    for i in range(rows.shape[0]):
        profile_scores(P, planes[rows[i]], words, two, score)
        out[i] = np.argmax(score)


def assign_profiles(planes: np.ndarray, rows: np.ndarray, P: np.ndarray, words: int, bits: int) -> np.ndarray:
    """The list of each row ``planes[rows[i]]`` whose profile agrees best with it (ties: the
    first) — the list a query that is this row would probe first."""
    out = np.empty(rows.shape[0], dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    spread(lambda lo, hi: _assign_profiles(planes, rows[lo:hi], P, words, bits >= 2, out[lo:hi]), rows.shape[0],
           rows.shape[0] * P.shape[0] * P.shape[1])
    return out


@njit(nogil=True, cache=True)
def _assign(F, centroids, out):
    for i in range(F.shape[0]):
        best = -1
        arg = 0
        for c in range(centroids.shape[0]):
            a = first_agreement(F[i], centroids[c])
            if a > best:
                best = a
                arg = c
        out[i] = arg




def assign(F: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the best-agreeing centroid of every first-stage row (ties: the first)."""
    out = np.empty(F.shape[0], dtype=np.int64)
    spread(lambda lo, hi: _assign(F[lo:hi], centroids, out[lo:hi]), F.shape[0],
           F.shape[0] * centroids.shape[0] * FIRST_WORDS)
    return out


@njit(nogil=True, cache=True)
def _modes(F, labels, nlist):
    """Per list, per bit, the value most common among the members (k-modes' update; a tie
    gives 0)."""
    ones = np.zeros((nlist, FIRST_WORDS * WORD), dtype=np.int32)
    size = np.zeros(nlist, dtype=np.int32)
    for i in range(F.shape[0]):
        c = labels[i]
        size[c] += 1
        for w in range(FIRST_WORDS):
            for s in range(WORD):
                ones[c, w * WORD + s] += np.int32((F[i, w] >> np.uint64(s)) & np.uint64(1))
    out = np.zeros((nlist, FIRST_WORDS), dtype=np.uint64)
    for c in range(nlist):
        for w in range(FIRST_WORDS):
            for s in range(WORD):
                if 2 * ones[c, w * WORD + s] > size[c]:
                    out[c, w] |= np.uint64(1) << np.uint64(s)
    return out


def kmodes(F: np.ndarray, nlist: int, *, rounds: int = 3, seed: int = 0) -> np.ndarray:
    """``nlist`` centroids for first-stage rows ``F``: ``rounds`` of k-modes from random rows.

    A random start, not k-means++'s spread one: the spread start made lists so uneven that a
    query scanned more rows for the same recall (docs/tuning.md).
    A list left empty by a round keeps its previous centroid.
    """
    nlist = max(1, min(nlist, F.shape[0]))
    rng = np.random.default_rng(seed)
    centroids = F[rng.choice(F.shape[0], nlist, replace=False)].copy()
    for _ in range(rounds):
        labels = assign(F, centroids)
        updated = _modes(F, labels, nlist)
        used = np.bincount(labels, minlength=nlist) > 0
        centroids[used] = updated[used]
    return centroids
