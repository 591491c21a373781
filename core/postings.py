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

A head column stores each row's value as a level (``scale`` × level, one scale for all
columns: 1 for counts up to 255, which are then exact): a byte a row, or, where all but a few of the
column's levels fit in 4 bits (every word of short passages but the commonest, the few
others saturating at 15), half a byte — two rows a byte. The pass over the head columns
streams their bytes from memory, and that is its cost: on 200,000 passages a query's 45
head columns take 0.18 ms where one byte a row took 0.31. The levels only rank; every
answer is an exact GMM. Head columns are kept where every value they would hold is
non-negative (counts, frequencies, histograms: what bag-of-words is); elsewhere the
postings search reads postings only.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.intrinsics import CACHE_LINE, prefetch, prefetch_flat
from gmmlsh.core.search import row_gmm
from gmmlsh.core.select import GROUP, choose

#: A coordinate held by at least this share of the sparse rows gets a head column (half a byte
#: a row, read in sequence, against 8 bytes a posting and a random update). Fewer columns,
#: each read whole, against more candidates reranked: on Brown passages grown to 200,000
#: rows, 1/8 reached recall@10 0.973 in 0.35 ms a query where 1/16 took 0.41 ms (1/4 lost
#: recall: 0.94 at its best).
HEAD_SHARE = 1 / 8
#: Most head columns a generation keeps (the commonest coordinates). A row's head sum is at
#: most HEAD_MAX × BYTE_LEVELS = 65,280 levels: it is kept in uint16.
HEAD_MAX = 256
#: Highest level of a head column of bytes, and of one packed two rows a byte.
BYTE_LEVELS = 255
NIBBLE_LEVELS = 15
#: A head column is packed where at most this share of its values pass NIBBLE_LEVELS (they
#: saturate there). Word counts of 200-word passages: only "the", "of", "and" and "to" pass 15
#: more often; a column of bytes for every word that ever does took a third of the pass.
SATURATED_SHARE = 1 / 256
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
                 sparse_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The head columns of postings over ``rows`` mirror rows (``sparse_rows`` of them sparse):
    ``(slot, bytes, nibbles, scale)`` — ``slot`` (dim,) int32, a coordinate's column or −1: a
    column below the number of byte columns is a row of ``bytes`` ((columns, rows) uint8
    levels), any other a row of ``nibbles`` ((columns, ⌈rows/2⌉) uint8: the 4-bit levels of
    rows 2i in the low half of byte i, 2i + 1 in the high half); ``scale`` (1,) float32, the
    value of one level (1 where every head value is a count up to 255: then levels are exact up to
    255). No head columns where a head value is negative."""
    held = np.diff(post_starts)
    coords = np.flatnonzero(held >= max(1.0, HEAD_SHARE * sparse_rows))
    coords = coords[np.argsort(-held[coords], kind="stable")][:HEAD_MAX]
    spans = [(int(post_starts[c]), int(post_starts[c + 1])) for c in coords.tolist()]
    top, counts = 0.0, True
    for lo, hi in spans:
        vals = np.asarray(post_vals[lo:hi])
        if vals.min() < 0:
            coords, spans = coords[:0], []
            break
        top = max(top, float(vals.max()))
        counts = counts and bool(np.array_equal(vals, np.rint(vals)))
    scale = np.float32(1.0 if counts and top <= BYTE_LEVELS or top == 0 else top / BYTE_LEVELS)
    levels = [np.minimum(BYTE_LEVELS, np.rint(np.asarray(post_vals[lo:hi]) / scale)).astype(np.uint8)
              for lo, hi in spans]
    small = [bool((lv > NIBBLE_LEVELS).mean() <= SATURATED_SHARE) for lv in levels]
    order = [j for j in range(len(spans)) if not small[j]] + [j for j in range(len(spans)) if small[j]]
    kb = len(spans) - sum(small)
    slot = np.full(held.shape[0], -1, dtype=np.int32)
    slot[coords[order]] = np.arange(len(order), dtype=np.int32)
    byte_cols = np.zeros((kb, rows), dtype=np.uint8)
    nibble_cols = np.zeros((len(order) - kb, (rows + 1) // 2), dtype=np.uint8)
    for at, j in enumerate(order):
        r = np.asarray(post_rows[spans[j][0]:spans[j][1]], dtype=np.int64)
        if at < kb:
            byte_cols[at, r] = levels[j]
        else:
            level = np.minimum(levels[j], NIBBLE_LEVELS)
            np.bitwise_or.at(nibble_cols[at - kb], r // 2, level << (4 * (r % 2)).astype(np.uint8))
    return slot, byte_cols, nibble_cols, np.array([scale], dtype=np.float32)


@njit(nogil=True, cache=True)
def _byte_add(acc, column, level):
    """``acc[r] += min(level, column[r])`` for every row of a block (uint16: one vectorised pass)."""
    lv = np.uint16(level)
    for r in range(acc.shape[0]):
        acc[r] += min(lv, np.uint16(column[r]))


@njit(nogil=True, cache=True)
def _nibble_add(even, odd, packed, level):
    """``min(level, v)`` of every row of a block's packed head column into the uint8 counters of
    its even (low halves) and odd (high halves) rows: one vectorised pass, 128 rows a vector
    instruction (the caller flushes the counters into uint16 before they could pass 255)."""
    lv = np.uint8(level)
    low = np.uint8(NIBBLE_LEVELS)
    for i in range(packed.shape[0]):
        b = packed[i]
        even[i] += min(lv, np.uint8(b & low))
        odd[i] += min(lv, np.uint8(b >> np.uint8(4)))


@njit(nogil=True, cache=True)
def _flush(acc, even, odd):
    """``acc`` (rows of the block in order) ``+=`` the counters of its even and odd rows, which
    are zero again after."""
    for i in range(even.shape[0]):
        acc[2 * i] += np.uint16(even[i])
        acc[2 * i + 1] += np.uint16(odd[i])
        even[i] = 0
        odd[i] = 0


@njit(nogil=True, cache=True, fastmath=_FAST, error_model="numpy")
def _block_levels(head, rare, scale, qn, norms, alive, out):
    """Partial similarity ``a / (‖q‖₁ + ‖v‖₁ − a)`` (``a``: head and rare sums) of a block of
    rows as levels in ``[0, _LEVELS)``, 0 for a retired row. A vectorised pass: the numpy error
    model drops the division-by-zero check that would keep it scalar (the denominator is at
    least ‖q‖₁ > 0)."""
    top = np.float32(_LEVELS - 1)
    q = np.float32(qn)
    for i in range(head.shape[0]):
        a = np.float32(head[i]) * scale + rare[i]
        level = min(top, max(np.float32(0.0), top * a / (q + norms[i] - a)))  # rounded levels can pass 1
        out[i] = np.uint16(np.int32(level) * np.int32(alive[i] != 0))


#: Rows whose sums are kept at a time (in the core's second-level cache; even).
_BLOCK = 32768
#: Cache lines of each head column's next block asked for ahead; candidate rows prefetched ahead.
_PREFETCH_LINES = 4
_AHEAD = 8


@njit(nogil=True, cache=True)
def _head_block(acc, even, odd, head_bytes, head_nibbles, heads, marks, nb, lo, size):
    """The head columns' sums of rows ``[lo, lo + size)`` (``lo`` even) into ``acc`` (uint16, at
    least ``size`` rounded up to even): the query's first ``nb`` heads are byte columns, the
    rest packed ones, summed through the uint8 counters ``even``/``odd`` while their levels allow."""
    for i in range(nb):
        _byte_add(acc[:size], head_bytes[heads[i], lo:lo + size], marks[i])
        if lo + size < head_bytes.shape[1]:  # the next block's start of this column: its stream begins in cache
            for line in range(_PREFETCH_LINES):
                prefetch(head_bytes, heads[i], lo + size + line * CACHE_LINE)
    half = (size + 1) // 2
    at = lo // 2
    held = 0  # the most the uint8 counters can hold now
    for i in range(nb, heads.shape[0]):
        if held + marks[i] > 255:
            _flush(acc[:2 * half], even[:half], odd[:half])
            held = 0
        _nibble_add(even[:half], odd[:half], head_nibbles[heads[i], at:at + half], marks[i])
        held += marks[i]
        if at + half < head_nibbles.shape[1]:
            for line in range(_PREFETCH_LINES):
                prefetch(head_nibbles, heads[i], at + half + line * CACHE_LINE)
    if held:
        _flush(acc[:2 * half], even[:half], odd[:half])


@njit(nogil=True, cache=True)
def _rare_block(rare, lo, hi, qvals, cursor, ends, post_rows, post_vals):
    """Add the rare terms' postings of rows ``[lo, hi)`` into ``rare`` (the block's sums),
    advancing each term's cursor: postings are in row order, so every term is read once, in
    order, and its updates stay in the block's slice of the cache."""
    for j in range(cursor.shape[0]):
        p, qv = cursor[j], qvals[j]
        while p < ends[j] and post_rows[p] < hi:
            rare[post_rows[p] - lo] += np.float32(_same_sign_min(qv, np.float64(post_vals[p])))
            p += 1
        cursor[j] = p


@njit(nogil=True, cache=True)
def postings_search(qbuf, qidx, qn, exclude, alive, norms, norms32, post_starts, post_rows, post_vals, head_slot,
                    head_bytes, head_nibbles, head_scale, rows, rare_rows, candidates, voff, vi, vf, levels, out_rows,
                    out_sims):
    """One query against the sparse rows of a generation (mirror rows ``[0, rows)``): partial
    similarity from the head columns and the rare postings, then exact GMM of the best
    ``candidates`` (live, not ``exclude``) into the outputs. Returns how many were written.

    ``qbuf``: the query, dense float64 of the full dimension; ``qidx``: its nonzero
    coordinates; ``norms32``: the rows' norms in float32 (what ranking needs, half the bytes of
    ``norms``, which the exact scores read); ``levels``: uint16 scratch of at least ``rows`` rounded up to a group.
    Rows are taken a block at a time, so that every sum stays in the cache: the head columns
    summed into the block's counters (in uint8 while the query's levels allow, then in uint16),
    the rare terms' postings of the block added, and each row's partial similarity cut to a
    level; the best ``candidates`` levels are then chosen (:func:`gmmlsh.core.select.choose`)."""
    scale = head_scale[0]
    kb = head_bytes.shape[0]
    heads = np.empty(qidx.shape[0], dtype=np.int64)
    marks = np.empty(qidx.shape[0], dtype=np.int64)
    cursor = np.empty(qidx.shape[0], dtype=np.int64)
    ends = np.empty(qidx.shape[0], dtype=np.int64)
    qvals = np.empty(qidx.shape[0], dtype=np.float64)
    nb = nn = nr = 0  # byte heads at the front of heads/marks, packed ones from the back
    for t in qidx:
        qv = qbuf[t]
        j = head_slot[t]
        if j >= 0:  # a head column's values are non-negative: a negative query value shares nothing
            level = min(float(BYTE_LEVELS), np.rint(qv / scale))
            if level < 1:
                continue
            if j < kb:
                heads[nb], marks[nb] = j, np.int64(level)
                nb += 1
            else:  # a packed column's levels stop at NIBBLE_LEVELS: the same min below it
                nn += 1
                heads[qidx.shape[0] - nn], marks[qidx.shape[0] - nn] = j - kb, min(NIBBLE_LEVELS, np.int64(level))
        elif post_starts[t + 1] - post_starts[t] <= rare_rows:
            cursor[nr], ends[nr], qvals[nr] = post_starts[t], post_starts[t + 1], qv
            nr += 1
    heads[nb:nb + nn] = heads[qidx.shape[0] - nn:]
    marks[nb:nb + nn] = marks[qidx.shape[0] - nn:]
    heads, marks = heads[:nb + nn], marks[:nb + nn]
    cursor, ends, qvals = cursor[:nr], ends[:nr], qvals[:nr]
    block = np.zeros(_BLOCK, dtype=np.uint16)
    even, odd = np.zeros(_BLOCK // 2, dtype=np.uint8), np.zeros(_BLOCK // 2, dtype=np.uint8)
    rare = np.zeros(_BLOCK, dtype=np.float32)
    padded = (rows + GROUP - 1) // GROUP * GROUP
    levels[rows:padded] = 0
    for lo in range(0, rows, _BLOCK):
        size = min(_BLOCK, rows - lo)
        block[:] = 0
        rare[:size] = 0
        _head_block(block, even, odd, head_bytes, head_nibbles, heads, marks, nb, lo, size)
        _rare_block(rare[:size], lo, lo + size, qvals, cursor, ends, post_rows, post_vals)
        _block_levels(block[:size], rare[:size], scale, qn, norms32[lo:lo + size], alive[lo:lo + size],
                      levels[lo:lo + size])
    if 0 <= exclude < rows:
        levels[exclude] = 0
    spans = np.array([[0, 0, rows], [padded, 0, 0]], dtype=np.int64)
    kept = choose(levels[:padded], spans, candidates, _LEVELS - 1)
    m = kept.shape[0]
    found = 0
    for i in range(m):
        if i + _AHEAD < m:  # candidate rows are random: ask for one's lines a few rows ahead
            ahead = kept[i + _AHEAD]
            for w in range(voff[ahead], voff[ahead + 1], CACHE_LINE // 4):
                prefetch_flat(vi, w)
        r = kept[i]
        if alive[r] and r != exclude:  # a retired row or the query's own scored 0: chosen only when few rows score
            out_rows[found] = r
            out_sims[found] = row_gmm(qbuf, qn, voff, vi, vf, norms, r)
            found += 1
    return found
