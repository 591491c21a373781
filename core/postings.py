"""Search through postings: sparse rows found by the coordinates they share with the query.

Bag-of-words text is where sketches struggle: a passage's 10th neighbour has GMM ≈ 0.20
against ≈ 0.15 for a random pair, a gap inside the noise of a few hundred samples. But a
text query touches only its own words, and min-max needs nothing else: for a non-negative
query ``q`` and row ``v``, ``GMM = S / (‖q‖₁ + ‖v‖₁ − S)`` with ``S = Σ min(q_t, v_t)`` over
the coordinates both hold. So the sparse rows of a generation are also kept as *postings*
(coordinate → rows and values), and

* :func:`exact_postings` is exact search in proportion to the postings the query's
  coordinates hold, not to the index or the dimension;
* :func:`postings_search` ranks rows by a partial ``S`` that skips most of that work: the
  commonest coordinates (function words, held by a large share of the rows: most of the
  postings) are read from *head columns* — one byte per row, a sequential pass instead of
  a random update per posting — and of the rest only the *rare* ones (held by at most
  ``rare_rows`` rows) are read; the middle, which holds little of either the mass or the
  signal, is skipped. The best ``candidates`` rows by that partial similarity are then
  scored exactly.

A head column stores each row's value as an int8 level (``scale`` × level, one scale for
all columns): counts up to 127 exactly (scale 1), anything else to within half a level,
summed in int16 — a vector instruction takes 32 rows. The levels only rank; every answer
is an exact GMM.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.intrinsics import CACHE_LINE, prefetch, prefetch_flat
from gmmlsh.core.search import row_gmm

#: A coordinate held by at least this share of the sparse rows gets a head column (one byte a
#: row, read in sequence, against 8 bytes a posting and a random update).
HEAD_SHARE = 1 / 16
#: Most head columns a generation keeps (the commonest coordinates).
HEAD_MAX = 256
#: Levels of partial similarity the candidates are ranked on (a counting selection, no sort).
_LEVELS = 4096


@njit(nogil=True, cache=True)
def postings_count(voff, vi, rows, dim):
    """Postings start of every coordinate (``dim + 1``, int64) over the sparse mirror rows
    ``rows``: the first pass of building postings without a second copy of the rows."""
    starts = np.zeros(dim + 1, dtype=np.int64)
    for r in rows:
        off = voff[r]
        for t in vi[off + 2:off + 2 + vi[off]].view(np.uint32):
            starts[t + 1] += 1
    for c in range(dim):
        starts[c + 1] += starts[c]
    return starts


@njit(nogil=True, cache=True)
def postings_fill(voff, vi, vf, rows, starts, out_rows, out_vals):
    """The second pass: each coordinate's rows (ascending) and values, written into the
    (memory-mapped) outputs at ``starts``."""
    at = starts[:-1].copy()
    for r in rows:
        off = voff[r]
        count = vi[off]
        idx = vi[off + 2:off + 2 + count].view(np.uint32)
        vals = vf[off + 2 + count:off + 2 + 2 * count]
        for p in range(count):
            t = idx[p]
            out_rows[at[t]] = r
            out_vals[at[t]] = vals[p]
            at[t] += 1


@njit(nogil=True, cache=True)
def exact_postings(qbuf, qidx, qn, exclude, alive, norms, post_starts, post_rows, post_vals, acc, seen, out_rows,
                   out_sims):
    """Exact GMM of the query against every sparse row sharing a nonzero coordinate with it,
    from postings (coordinate → rows and values): work in proportion to the postings of the
    query's coordinates, not to the index. Returns how many rows were written to the
    outputs; ``acc``/``seen`` (one slot per row, zero on entry) are zero again on exit."""
    m = 0
    for t in qidx:
        qv = qbuf[t]
        for p in range(post_starts[t], post_starts[t + 1]):
            r = post_rows[p]
            if not seen[r]:
                seen[r] = 1
                out_rows[m] = r
                m += 1
            acc[r] += _same_sign_min(qv, np.float64(post_vals[p]))
    n = 0
    for i in range(m):
        r = out_rows[i]
        s = acc[r]
        acc[r] = 0.0
        seen[r] = 0
        if alive[r] and r != exclude:
            out_rows[n] = r
            out_sims[n] = _ratio(s, qn, norms[r])
            n += 1
    return n


def head_columns(post_starts: np.ndarray, post_rows: np.ndarray, post_vals: np.ndarray, rows: int,
                 sparse_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The head columns of postings over ``rows`` mirror rows (``sparse_rows`` of them sparse):
    ``(slot, columns, scale)`` — ``slot`` (dim,) int32, a coordinate's column or −1;
    ``columns`` (heads, rows) int8 levels; ``scale`` (1,) float32, the value of one level
    (1 where every head value is a count up to 127: then the levels are exact)."""
    held = np.diff(post_starts)
    coords = np.flatnonzero(held >= max(1.0, HEAD_SHARE * sparse_rows))
    coords = coords[np.argsort(-held[coords], kind="stable")][:HEAD_MAX]
    slot = np.full(held.shape[0], -1, dtype=np.int32)
    slot[coords] = np.arange(coords.shape[0], dtype=np.int32)
    spans = [(int(post_starts[c]), int(post_starts[c + 1])) for c in coords.tolist()]
    top, counts = 0.0, True
    for lo, hi in spans:
        vals = np.asarray(post_vals[lo:hi])
        top = max(top, float(np.abs(vals).max()))
        counts = counts and bool(np.array_equal(vals, np.rint(vals)))
    scale = np.float32(1.0 if counts and top <= 127 else top / 127)
    columns = np.zeros((coords.shape[0], rows), dtype=np.int8)
    for j, (lo, hi) in enumerate(spans):
        columns[j, post_rows[lo:hi]] = np.rint(np.asarray(post_vals[lo:hi]) / scale).astype(np.int8)
    return slot, columns, np.array([scale], dtype=np.float32)


@njit(nogil=True, cache=True)
def _head_add(acc, column, level):
    """``acc[r] += same-sign min(level, column[r])`` for every row of a block, in int16 levels
    (at most :data:`HEAD_MAX` × 127: no overflow): one vectorised pass."""
    zero = np.int16(0)
    if level > 0:
        for r in range(acc.shape[0]):
            acc[r] += max(zero, min(level, np.int16(column[r])))
    else:
        for r in range(acc.shape[0]):
            acc[r] += max(zero, min(-level, -np.int16(column[r])))


@njit(nogil=True, cache=True, fastmath=_FAST, error_model="numpy")
def _block_levels(head, rare, scale, qn, norms, out):
    """Partial similarity ``a / (‖q‖₁ + ‖v‖₁ − a)`` (``a``: head and rare sums) of a block of
    rows as levels in ``[0, _LEVELS)``; ``rare`` zero again on exit. A vectorised pass: the
    numpy error model drops the division-by-zero check that would keep it scalar (the
    denominator is at least ‖q‖₁ > 0)."""
    top = np.float32(_LEVELS - 1)
    q = np.float32(qn)
    for i in range(head.shape[0]):
        a = np.float32(head[i]) * scale + rare[i]
        out[i] = np.int16(np.int32(top * a / (q + np.float32(norms[i]) - a)))
    rare[:] = 0


@njit(nogil=True, cache=True)
def _keep_best(rows, levels, m, count):
    """Keep the ``count`` best of the first ``m`` entries (ties to the earliest), in order, at
    the front; returns (the lowest level kept, how many were kept)."""
    hist = np.zeros(_LEVELS, dtype=np.int64)
    for i in range(m):
        hist[levels[i]] += 1
    cut, taken = _LEVELS - 1, 0
    while cut > 0 and taken + hist[cut] < count:
        taken += hist[cut]
        cut -= 1
    room, k = count - taken, 0
    for i in range(m):
        level = levels[i]
        if level > cut or (level == cut and room > 0):
            room -= level == cut
            rows[k] = rows[i]
            levels[k] = level
            k += 1
    return cut, k


#: Rows whose head sums are kept at a time (in the core's first-level cache).
_BLOCK = 8192
#: Cache lines of each head column's next block asked for ahead; candidate rows prefetched ahead.
_PREFETCH_LINES = 4
_AHEAD = 8


@njit(nogil=True, cache=True)
def postings_search(qbuf, qidx, qn, exclude, alive, norms, post_starts, post_rows, post_vals, head_slot, head_cols,
                    head_scale, rows, rare_rows, candidates, voff, vi, vf, rare, out_rows, out_sims):
    """One query against the sparse rows of a generation (mirror rows ``[0, rows)``): partial
    similarity from the head columns and the rare postings, then exact GMM of the best
    ``candidates`` (live, not ``exclude``) into the outputs. Returns how many were written.

    ``qbuf``: the query, dense float64 of the full dimension; ``qidx``: its nonzero
    coordinates; ``rare`` (float32, one slot per row): zero on entry and on exit. The head
    columns are summed block by block of rows, the sums never leaving the cache, and each
    block's best rows join a running selection (the best ``candidates`` so far and those
    above the lowest of them), so no pass over all rows follows."""
    scale = head_scale[0]
    heads = np.empty(qidx.shape[0], dtype=np.int64)
    marks = np.empty(qidx.shape[0], dtype=np.int16)
    h = 0
    for t in qidx:
        qv = qbuf[t]
        j = head_slot[t]
        if j >= 0:
            heads[h] = j
            marks[h] = np.int16(max(-127.0, min(127.0, np.rint(qv / scale))))
            h += 1
        elif post_starts[t + 1] - post_starts[t] <= rare_rows:
            for p in range(post_starts[t], post_starts[t + 1]):
                rare[post_rows[p]] += _same_sign_min(qv, np.float64(post_vals[p]))
    block = np.zeros(_BLOCK, dtype=np.int16)
    block_levels = np.empty(_BLOCK, dtype=np.int16)
    kept = np.empty(3 * candidates + _BLOCK, dtype=np.int64)
    kept_levels = np.empty(3 * candidates + _BLOCK, dtype=np.int16)
    m, floor = 0, 0  # rows kept so far; a row joins when its level is above ``floor``
    for lo in range(0, rows, _BLOCK):
        size = min(_BLOCK, rows - lo)
        acc = block[:size]
        acc[:] = 0
        for i in range(h):
            _head_add(acc, head_cols[heads[i], lo:lo + size], marks[i])
            if lo + _BLOCK < rows:  # the next block's start of this column: its stream begins in cache
                for line in range(_PREFETCH_LINES):
                    prefetch(head_cols, heads[i], lo + _BLOCK + line * CACHE_LINE)
        _block_levels(acc, rare[lo:lo + size], scale, qn, norms[lo:lo + size], block_levels)
        for i in range(size):
            if block_levels[i] > floor:
                kept[m] = lo + i
                kept_levels[m] = block_levels[i]
                m += 1
        if m > 2 * candidates:
            floor, m = _keep_best(kept, kept_levels, m, candidates)
    m = _keep_best(kept, kept_levels, m, candidates)[1]
    found = 0
    for i in range(m):
        if i + _AHEAD < m:  # candidate rows are random: ask for one a few rows ahead
            prefetch_flat(vi, voff[kept[i + _AHEAD]])
        r = kept[i]
        if alive[r] and r != exclude:
            out_rows[found] = r
            out_sims[found] = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
            found += 1
    return found
