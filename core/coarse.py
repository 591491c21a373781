"""Coarse copies of stored vectors: one int8 level per value, for the candidates' GMM.

The last stages of a sketch search score a few hundred rows by GMM, rows from anywhere in
an index of gigabytes: at 784 float32 dimensions each is 49 cache lines fetched from
memory, and those fetches, not the arithmetic, are the cost. A coarse row holds each value
as a level of ``scale = max|v| / 127`` in one byte (a quarter of the lines), with its norm
beside it, so the candidates are ranked by a GMM a few thousandths from the exact one and
only the best few are scored on the float32 rows: the same top 10 for far fewer fetches
(docs/tuning.md, "Coarse rows"). Every similarity an answer reports is exact.

A coarse row is ``[scale (float32), norm (float32), count (int32), levels (int8) …]``
padded to whole words, at byte ``coff[r]`` of a data column (read as int8 levels and as
the 32-bit words of the headers). Only a dense row has levels, one per coordinate; a sparse
row's coarse row is its header alone (count 0), and it is scored exactly instead: its few
values cost no more to read in float32, and an int8 level of the largest count is too
coarse for text, whose neighbours stand a few hundredths apart (it lost true neighbours:
docs/tuning.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.gmm import _FAST, _ratio

#: Largest level: values are ``scale × level`` with ``|level| ≤ LEVELS``.
LEVELS = 127
#: Bytes before a row's levels: its scale and norm (float32) and its count (int32).
HEADER = 12


@njit(nogil=True, cache=True)
def coarse_sizes(voff, vi, lo, hi):
    """Bytes of the coarse rows of float32 mirror rows ``[lo, hi)`` (header and padding included)."""
    out = np.empty(hi - lo, dtype=np.int64)
    for r in range(lo, hi):
        dense = vi[voff[r] + 1] == 0
        out[r - lo] = HEADER + ((vi[voff[r]] + 3) // 4 * 4 if dense else 0)
    return out


def coarse_encode(voff, vi, vf, norms, lo: int, hi: int, out: np.ndarray) -> int:
    """The coarse rows of float32 mirror rows ``[lo, hi)``, one after another, into ``out``
    (uint8, sized by :func:`coarse_sizes`); returns the bytes written. (Its views are made here:
    each kind of view a kernel makes compiles numba's view machinery once more.)"""
    return _coarse_encode(voff, vi, vf, norms, lo, hi, out.view(np.float32), out.view(np.int32), out.view(np.int8))


@njit(nogil=True, cache=True)
def _coarse_encode(voff, vi, vf, norms, lo, hi, head, counts, levels):
    at = 0
    for r in range(lo, hi):
        off = voff[r]
        count = vi[off] if vi[off + 1] == 0 else 0  # a sparse row: the header alone
        top = 0.0
        for i in range(count):
            top = max(top, abs(np.float64(vf[off + 2 + i])))
        scale = top / LEVELS if top > 0 else 1.0
        head[at // 4] = np.float32(scale)
        head[at // 4 + 1] = np.float32(norms[r])
        counts[at // 4 + 2] = count
        base = at + HEADER
        for i in range(count):
            levels[base + i] = np.int8(np.rint(np.float64(vf[off + 2 + i]) / scale))
        size = HEADER + (count + 3) // 4 * 4
        for i in range(base + count, at + size):
            levels[i] = 0
        at += size
    return at


@njit(nogil=True, cache=True, inline="always", fastmath=_FAST)
def _min32(a, b):
    """:func:`gmmlsh.core.gmm._same_sign_min` in float32 (16 lanes a vector instruction, not 8)."""
    zero = np.float32(0.0)
    return max(min(a, b), zero) - min(max(a, b), zero)


@njit(nogil=True, cache=True, fastmath=_FAST)
def coarse_gmm(q32, qn, coff, levels, head, counts, r):
    """GMM of the query (dense float32 buffer ``q32``, L1 norm ``qn``) with the coarse copy of
    mirror row ``r`` (``levels``/``head``/``counts``: the coarse data as int8, float32 and
    int32): within a few thousandths of the exact value, from a quarter of the bytes; −1 for
    a sparse row (no levels: score it exactly). In float32, faster than float64 on rows
    coming from memory (docs/tuning.md)."""
    at = coff[r]
    w = at // 4
    count = counts[w + 2]
    if count == 0:
        return -1.0
    scale = head[w]
    lv = levels[at + HEADER:at + HEADER + count]
    s = np.float32(0.0)
    for i in range(count):
        s += _min32(q32[i], scale * np.float32(lv[i]))
    return _ratio(np.float64(s), qn, np.float64(head[w + 1]))
