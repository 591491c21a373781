"""Search through postings: sparse rows found by the coordinates they share with the query.

Bag-of-words text is where sketches struggle: a passage's 10th neighbour has GMM ≈ 0.20
against ≈ 0.15 for a random pair, a gap inside the noise of a few hundred samples. But a
text query touches only its own words, and min-max needs nothing else: for a non-negative
query ``q`` and row ``v``, ``GMM = S / (‖q‖₁ + ‖v‖₁ − S)`` with ``S = Σ min(q_t, v_t)`` over
the coordinates both hold. So the sparse rows of each segment are also kept as *postings*
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
streams their bytes from memory, and that is its cost, so half a byte a row reads faster than
a byte (docs/tuning.md, "The postings search"). The levels only rank; every
answer is an exact GMM. Head columns are kept where every value they would hold is
non-negative (counts, frequencies, histograms: what bag-of-words is); elsewhere the
postings search reads postings only.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.bundles import SEG_D_HI, SEG_D_LO, SEG_HBYTES, SEG_HI, SEG_HNIBBLES, SEG_LO, SEG_PSTARTS
from gmmlsh.core.gmm import _FAST, _ratio, _same_sign_min
from gmmlsh.core.intrinsics import CACHE_LINE, prefetch, prefetch_flat
from gmmlsh.core.search import exact_range, exact_rows, row_gmm
from gmmlsh.core.select import GROUP, choose

#: A coordinate held by at least this share of the sparse rows gets a head column (half a byte
#: a row, read in sequence, against 8 bytes a posting and a random update). Fewer columns,
#: each read whole, against more candidates reranked: 1/8 is the fastest share that holds
#: the recall on text (docs/tuning.md).
HEAD_SHARE = 1 / 8
#: Most head columns a fit keeps (the commonest coordinates). A row's head sum is at
#: most HEAD_MAX × BYTE_LEVELS = 65,280 levels: it is kept in uint16.
HEAD_MAX = 256
#: Highest level of a head column of bytes, and of one packed two rows a byte.
BYTE_LEVELS = 255
NIBBLE_LEVELS = 15
#: A head column is packed where at most this share of its values pass NIBBLE_LEVELS (they
#: saturate there): in word counts only the few commonest words pass 15 more often, and a
#: column of bytes for every word that ever does would slow the pass (docs/tuning.md).
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
        for t in vi[off + 2:off + 2 + vi[off]]:
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
        idx = vi[off + 2:off + 2 + count]
        vals = vf[off + 2 + count:off + 2 + 2 * count]
        for p in range(count):
            t = idx[p]
            out_rows[at[t]] = r
            out_vals[at[t]] = vals[p]
            at[t] += 1


@njit(nogil=True, cache=True)
def exact_postings(q, qidx, rows, post, acc, seen, out_rows, out_sims):
    """Exact search of one query (``qidx``: its nonzero coordinates) over the whole mirror:
    the segments' sparse rows sharing a coordinate with it through their postings (work in
    proportion to the postings of the query's coordinates, not to the index), their dense
    rows and the tail row by row. Rows sharing nothing with the query (similarity 0) are left
    out. Returns how many rows were written to the outputs; ``acc``/``seen`` (one slot per
    row, zero on entry) are zero again on exit."""
    segs, pstarts, prows, pvals = post.segs, post.pstarts, post.prows, post.pvals
    m = 0
    for s in range(segs.shape[0]):
        ps = segs[s, SEG_PSTARTS]
        for t in qidx:
            qv = q.dense[t]
            for p in range(pstarts[ps + t], pstarts[ps + t + 1]):
                r = prows[p]
                if not seen[r]:
                    seen[r] = 1
                    out_rows[m] = r
                    m += 1
                acc[r] += _same_sign_min(qv, np.float64(pvals[p]))
    n = 0
    for i in range(m):
        r = out_rows[i]
        total = acc[r]
        acc[r] = 0.0
        seen[r] = 0
        if rows.alive[r] and r != q.exclude:
            out_rows[n] = r
            out_sims[n] = _ratio(total, q.norm, rows.norms[r])
            n += 1
    for s in range(segs.shape[0]):
        n += exact_rows(q, rows, post.drows[segs[s, SEG_D_LO]:segs[s, SEG_D_HI]], out_rows[n:], out_sims[n:])
    return n + exact_range(q, rows, post.tail_lo, post.tail_hi, out_rows[n:], out_sims[n:])


def head_plan(post_starts: np.ndarray, post_vals: np.ndarray, sparse_rows: int) -> tuple[np.ndarray, int, float]:
    """Which coordinates get head columns, from the postings of a fit's rows (``sparse_rows`` of
    them sparse): ``(slot, bytes, scale)`` — ``slot`` (dim,) int32, a coordinate's column or −1
    (the first ``bytes`` columns hold a byte a row, the others half a byte: see
    :func:`head_levels`); ``scale`` the value of one level (1 where every head value is a count
    up to 255: then levels are exact up to 255). No head columns where a head value is negative."""
    held = np.diff(post_starts)
    coords = np.flatnonzero(held >= max(1.0, HEAD_SHARE * sparse_rows))
    coords = coords[np.argsort(-held[coords], kind="stable")][:HEAD_MAX]
    spans = [(int(post_starts[c]), int(post_starts[c + 1])) for c in coords.tolist()]
    top, counts = 0.0, True
    for lo, hi in spans:
        vals = np.asarray(post_vals[lo:hi])
        if vals.min() < 0:
            return np.full(held.shape[0], -1, dtype=np.int32), 0, 1.0
        top = max(top, float(vals.max()))
        counts = counts and bool(np.array_equal(vals, np.rint(vals)))
    scale = float(np.float32(1.0 if counts and top <= BYTE_LEVELS or top == 0 else top / BYTE_LEVELS))
    small = [bool((np.minimum(BYTE_LEVELS, np.rint(np.asarray(post_vals[lo:hi]) / scale)) > NIBBLE_LEVELS).mean()
                  <= SATURATED_SHARE) for lo, hi in spans]
    order = [j for j in range(len(spans)) if not small[j]] + [j for j in range(len(spans)) if small[j]]
    slot = np.full(held.shape[0], -1, dtype=np.int32)
    slot[coords[order]] = np.arange(len(order), dtype=np.int32)
    return slot, len(spans) - sum(small), scale


def head_levels(slot: np.ndarray, nbytes: int, scale: float, post_starts: np.ndarray, post_rows: np.ndarray,
                post_vals: np.ndarray, lo: int, nrows: int) -> tuple[np.ndarray, np.ndarray]:
    """The head columns of the mirror rows ``[lo, lo + nrows)`` from their postings: ``(bytes,
    nibbles)`` — ``(nbytes, nrows)`` uint8 levels, and ``(columns − nbytes, ⌈nrows/2⌉)`` uint8
    holding the 4-bit levels of local rows 2i in the low half of byte i and 2i + 1 in the high
    half (saturating at 15). A level is ``round(value / scale)``, at most 255: levels only rank."""
    heads = np.flatnonzero(slot >= 0)
    columns = int(slot.max()) + 1 if heads.shape[0] else 0
    byte_cols = np.zeros((nbytes, nrows), dtype=np.uint8)
    nibble_cols = np.zeros((columns - nbytes, (nrows + 1) // 2), dtype=np.uint8)
    for c in heads.tolist():
        a, b = int(post_starts[c]), int(post_starts[c + 1])
        r = np.asarray(post_rows[a:b], dtype=np.int64) - lo
        level = np.clip(np.rint(np.asarray(post_vals[a:b]) / scale), 0, BYTE_LEVELS).astype(np.uint8)
        j = int(slot[c])
        if j < nbytes:
            byte_cols[j, r] = level
        else:
            np.bitwise_or.at(nibble_cols[j - nbytes], r // 2,
                             (np.minimum(level, NIBBLE_LEVELS) << (4 * (r % 2))).astype(np.uint8))
    return byte_cols, nibble_cols


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
def postings_search(q, qidx, rows, post, rare_share, candidates, levels, out_rows, out_sims):
    """One query (``qidx``: its nonzero coordinates) through postings: the segments' sparse rows
    ranked by a partial similarity from the head columns and the postings of the query's rare
    coordinates (held by at most ``rare_share`` of a segment's rows), the best ``candidates``
    scored by exact GMM; the segments' dense rows and the tail scored exactly. Returns how
    many rows were written to the outputs (room: ``candidates`` + dense rows + tail).

    ``levels``: uint16 scratch of at least the segments' rows rounded up to a group. Rows are
    taken a block at a time, so that every sum stays in the cache: the head columns summed
    into the block's counters (in uint8 while the query's levels allow, then in uint16), the
    rare coordinates' postings of the block added, and each row's partial similarity cut to a
    level; the best ``candidates`` levels are then chosen (:func:`gmmlsh.core.select.choose`)."""
    segs, pstarts = post.segs, post.pstarts
    scale = np.float32(post.head_scale)
    kb, kn = post.head_bytes, post.head_nibbles
    nq = qidx.shape[0]
    heads = np.empty(nq, dtype=np.int64)
    marks = np.empty(nq, dtype=np.int64)
    others = np.empty(nq, dtype=np.int64)  # the query's coordinates without a head column
    # byte heads at the front of heads/marks, packed ones from the back (numpy integers: a literal 0
    # reaching _head_block would compile it once more)
    nb = nn = no = np.int64(0)
    for t in qidx:
        j = post.head_slot[t]
        if j >= 0:  # a head column's values are non-negative: a negative query value shares nothing
            level = min(float(BYTE_LEVELS), np.rint(q.dense[t] / scale))
            if level < 1:
                continue
            if j < kb:
                heads[nb], marks[nb] = j, np.int64(level)
                nb += 1
            else:  # a packed column's levels stop at NIBBLE_LEVELS: the same min below it
                nn += 1
                heads[nq - nn], marks[nq - nn] = j - kb, min(NIBBLE_LEVELS, np.int64(level))
        else:
            others[no] = t
            no += 1
    for i in range(nn):  # a loop, not a slice assignment: that compiles numba's shape errors (seconds)
        heads[nb + i], marks[nb + i] = heads[nq - nn + i], marks[nq - nn + i]
    heads, marks = heads[:nb + nn], marks[:nb + nn]
    cursor = np.empty(no, dtype=np.int64)
    ends = np.empty(no, dtype=np.int64)
    qvals = np.empty(no, dtype=np.float64)
    block = np.zeros(_BLOCK, dtype=np.uint16)
    even, odd = np.zeros(_BLOCK // 2, dtype=np.uint8), np.zeros(_BLOCK // 2, dtype=np.uint8)
    rare = np.zeros(_BLOCK, dtype=np.float32)
    listed = post.tail_lo  # the segments tile rows [0, tail_lo)
    padded = (listed + GROUP - 1) // GROUP * GROUP
    levels[listed:padded] = 0
    for s in range(segs.shape[0]):
        lo, hi = segs[s, SEG_LO], segs[s, SEG_HI]
        n = hi - lo
        half = (n + 1) // 2
        hb = post.hbytes[segs[s, SEG_HBYTES]:segs[s, SEG_HBYTES] + kb * n].reshape((kb, n))
        hn = post.hnibbles[segs[s, SEG_HNIBBLES]:segs[s, SEG_HNIBBLES] + kn * half].reshape((kn, half))
        ps = segs[s, SEG_PSTARTS]
        nr = 0
        for i in range(no):  # the rare coordinates of this segment
            t = others[i]
            a, b = pstarts[ps + t], pstarts[ps + t + 1]
            if 0 < b - a <= rare_share * n:
                cursor[nr], ends[nr], qvals[nr] = a, b, q.dense[t]
                nr += 1
        for blo in range(0, n, _BLOCK):
            size = min(_BLOCK, n - blo)
            block[:] = 0
            rare[:size] = 0
            _head_block(block, even, odd, hb, hn, heads, marks, nb, blo, size)
            _rare_block(rare[:size], lo + blo, lo + blo + size, qvals[:nr], cursor[:nr], ends[:nr], post.prows,
                        post.pvals)
            _block_levels(block[:size], rare[:size], scale, q.norm, rows.norms32[lo + blo:lo + blo + size],
                          rows.alive[lo + blo:lo + blo + size], levels[lo + blo:lo + blo + size])
    if 0 <= q.exclude < listed:
        levels[q.exclude] = 0
    spans = np.array([[0, 0, listed], [padded, 0, 0]], dtype=np.int64)
    kept = choose(levels[:padded], spans, candidates, _LEVELS - 1)
    m = kept.shape[0]
    found = 0
    voff, vi = rows.voff, rows.vi
    for i in range(m):
        if i + _AHEAD < m:  # candidate rows are random: ask for one's lines a few rows ahead
            ahead = kept[i + _AHEAD]
            for w in range(voff[ahead], voff[ahead + 1], CACHE_LINE // 4):
                prefetch_flat(vi, w)
        r = kept[i]
        if rows.alive[r] and r != q.exclude:  # a retired row or the query's own scored 0: chosen when few score
            out_rows[found] = r
            out_sims[found] = row_gmm(q.dense, q.norm, voff, vi, rows.vf, rows.norms, r)
            found += 1
    for s in range(segs.shape[0]):
        found += exact_rows(q, rows, post.drows[segs[s, SEG_D_LO]:segs[s, SEG_D_HI]], out_rows[found:],
                            out_sims[found:])
    return found + exact_range(q, rows, post.tail_lo, post.tail_hi, out_rows[found:], out_sims[found:])
