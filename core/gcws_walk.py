"""The sorted walk: GCWS of a dense row that visits only coordinates that can still win.

Why: the nonzero-major kernel of :mod:`core.gcws` evaluates every (nonzero,
sample) pair, but a sample's minimum is decided by a few coordinates. With the
table's constants (``t = ⌊lx·(1/r) + β⌋``, ``ln a = base − r·t``) and
``t ≤ lx·(1/r) + β``,

    ln a ≥ B − m·lx,   B = base − r·β,   m = r·(1/r) ∈ 1 ± 2⁻²³,

so with ``U ≥ m·lx`` for every ``lx`` of the row, no coordinate whose ``B``
exceeds ``best + U`` (plus a rounding margin) can reach the running minimum
``best``. Each sample's coordinates are listed once per process by ascending
``B``, in two lists: the positive halves (even 2D coordinates) and the negative
halves (odd ones) of the sign split. A row walks the list of each sign it has,
with that sign's own ``U`` (the largest ``lx`` among its nonzeros of that sign),
and skips the other. Non-negative data — images, counts, tf-idf — thus never
steps over the negative halves, which are all zero. A row with both signs walks its two
lists in turns, each stopping at its own bound against the best of both. A block of 32 samples walks
its lists in lockstep (one vector step per list position, the row's ``lx``
gathered per lane) until every lane has passed its bound. Zero coordinates stay
in the lists with ``lx = NaN``, which no comparison takes.

The answer is bit-identical to that kernel: the same float32 constants and the
same float64 arithmetic. The one difference would be ties — two coordinates
with equal ``ln a``, where the reference keeps the smaller coordinate while the
walk meets them in ``B`` order — so a tie makes :func:`walk_vector` return
False and the caller samples that row the reference way.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.lane_step import LANES, gather_step

#: Bytes of walk table per (coordinate, sample): B and four constants (float32) and the coordinate (uint32).
BYTES_PER_ENTRY = 24
#: Steps between checks of the stopping bound, and the first step checked after a list's start.
_CHECK = 8
_FIRST_CHECK = 16
#: Rounding slack of the bound, relative (the float64 errors it covers are below 1e-12).
_SLACK = 1e-9
#: Relative margin of ``U`` over the largest ``lx``: covers ``m ∈ 1 ± 2⁻²³``.
_U_MARGIN = 1e-6


def build_walk_table(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E, C) for a coordinate-major constant table of every 2D coordinate (see :mod:`core.gcws`).

    ``E[blk, m, :, lane]`` = (B rounded down to float32, 1/r, β, base, r) of the
    ``m``-th coordinate of that sample's lists, ``C[blk, m, lane]`` the coordinate.
    Positions ``[0, D)`` list the even (positive-half) coordinates, ``[D, 2D)`` the
    odd ones, each by ascending ``B``. Rounding B down keeps the bound safe: a
    float32 B above ``best + U`` means the float64 one is too.
    """
    if table.ndim != 4 or table.shape[2:] != (4, LANES) or table.shape[0] % 2:
        raise ValueError(f"table: expected shape (even coords, blocks, 4, {LANES}), got {table.shape}")
    t64 = table.astype(np.float64)
    bound = t64[:, :, 2, :] - t64[:, :, 3, :] * t64[:, :, 1, :]  # (coords, nblk, lanes)
    order = np.concatenate([2 * np.argsort(bound[s::2], axis=0, kind="stable") + s for s in (0, 1)])
    b64 = np.take_along_axis(bound, order, 0)
    b32 = b64.astype(np.float32)
    up = b32.astype(np.float64) > b64
    b32[up] = np.nextafter(b32[up], np.float32(-np.inf))
    nblk = table.shape[1]
    E = np.empty((nblk, table.shape[0], 5, LANES), dtype=np.float32)
    E[:, :, 0, :] = b32.transpose(1, 0, 2)
    for s in range(4):
        E[:, :, 1 + s, :] = np.take_along_axis(table[:, :, s, :], order, 0).transpose(1, 0, 2)
    C = np.ascontiguousarray(order.transpose(1, 0, 2).astype(np.uint32))
    return E, C


@njit(nogil=True, cache=True)
def sign_bounds(coords, logs, p, U) -> None:
    """``U[s]`` for the walk of sign ``s`` (0: positive halves, 1: negative) of a row
    whose nonzeros are ``coords[:p]``/``logs[:p]``: the largest ``lx`` of that sign
    widened by :data:`_U_MARGIN`, or NaN when the row has no nonzero of that sign."""
    U[:] = -np.inf
    for q in range(p):
        s = coords[q] & 1
        U[s] = max(U[s], logs[q])
    for s in range(2):
        U[s] = np.nan if U[s] == -np.inf else U[s] + _U_MARGIN * abs(U[s])


@njit(nogil=True, cache=True, inline="always")
def _all_passed(nb, bb, U) -> bool:
    """Whether every lane's next bound ``nb`` exceeds its ``best + U``."""
    live = 0
    for jj in range(LANES):
        thr = bb[jj] + U + _SLACK * (1.0 + abs(bb[jj]) + abs(U))
        live += np.int64(np.float64(nb[jj]) <= thr)
    return live == 0


@njit(nogil=True, cache=True, inline="always")
def _walk_on(LX, u, E, C, blk, start, m, end, state) -> bool:
    """One step at position ``m`` of the list ``[start, end)``; whether the list must go on after
    it (it has entries left that may still win)."""
    gather_step(LX, C[blk, m], E[blk, m], state, np.float64(m))
    taken = m + 1 - start
    if m + 1 == end:
        return False
    if taken >= _FIRST_CHECK and taken % _CHECK == 0:
        return not _all_passed(E[blk, m + 1, 0], state[0], u)
    return True


@njit(nogil=True, cache=True)
def walk_vector(LX, U, E, C, k, out_row, state) -> bool:
    """i* of one row into ``out_row`` (k values); False if a tie was met (``out_row`` is then void).

    ``LX``: ln|value| at each 2D coordinate of the row, NaN where it is zero;
    ``U``: the two signs' bounds (:func:`sign_bounds`); ``state``: (3, 32) float64
    scratch (see :mod:`core.lane_step`). A row with both signs walks its two lists
    in turns, a step each, so that both stop against the best of both so far: walked
    one after the other, the first list ran on until its own best, which the second
    list's often beats (signed images: 186 steps a block against 111 in turns).
    """
    nblk, M = E.shape[0], E.shape[1]
    half = M // 2
    for blk in range(nblk):
        state[0, :] = np.inf
        state[1:, :] = 0.0
        pos_on, neg_on = not np.isnan(U[0]), not np.isnan(U[1])
        mp, mn = 0, half
        while pos_on or neg_on:
            if pos_on:
                pos_on = _walk_on(LX, U[0], E, C, blk, 0, mp, half, state)
                mp += 1
            if neg_on:
                neg_on = _walk_on(LX, U[1], E, C, blk, half, mn, M, state)
                mn += 1
        for jj in range(LANES):
            if state[2, jj] != 0.0:
                return False
        for jj in range(min(LANES, k - blk * LANES)):
            out_row[blk * LANES + jj] = np.int32(C[blk, np.int64(state[1, jj]), jj])
    return True
