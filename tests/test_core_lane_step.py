"""The vector steps of core.lane_step compute exactly the float64 formula, lane by lane."""

from __future__ import annotations

import numpy as np
from numba import njit

from gmmlsh.core.lane_step import LANES, broadcast_step, gather_step


@njit
def _gather(lx, cc, consts, state, pos):
    gather_step(lx, cc, consts, state, pos)


@njit
def _broadcast(lx, consts, state, pos):
    broadcast_step(lx, consts, state, pos)


def _ln_a(lx, c):
    """ln a = base − rate·⌊lx·(1/r) + β⌋ with float32 constants widened to float64."""
    invr, beta, base, rate = (c[s].astype(np.float64) for s in range(4))
    return base - rate * np.floor(lx * invr + beta)


def _state(rng):
    state = np.zeros((3, LANES))
    state[0] = rng.normal(0, 2, LANES)
    state[0, :4] = np.inf
    state[1] = rng.integers(0, 50, LANES)
    return state


def test_gather_step_takes_smaller_values_flags_ties_and_ignores_nan() -> None:
    rng = np.random.default_rng(3)
    lx = rng.normal(0, 2, 200)
    lx[::5] = np.nan  # zero coordinates
    cc = rng.integers(0, 200, LANES).astype(np.uint32)
    consts = rng.normal(0, 1, (5, LANES)).astype(np.float32)
    state = _state(rng)
    la = _ln_a(lx[cc], consts[1:])
    state[0, 5] = la[5]  # a tie
    before = state.copy()
    _gather(lx, cc, consts, state, 77.0)
    take = la < before[0]
    assert take.any() and (~take).any()
    np.testing.assert_array_equal(state[0], np.where(take, la, before[0]))
    np.testing.assert_array_equal(state[1], np.where(take, 77.0, before[1]))
    np.testing.assert_array_equal(state[2], (la == before[0]).astype(float))
    assert state[2, 5] == 1.0 and state[2].sum() == 1.0


def test_broadcast_step_uses_rows_0_to_3_and_keeps_earlier_ties() -> None:
    rng = np.random.default_rng(4)
    consts = rng.normal(0, 1, (4, LANES)).astype(np.float32)
    state = _state(rng)
    la = _ln_a(np.full(LANES, 1.3), consts)
    state[0, 6] = la[6]
    before = state.copy()
    _broadcast(1.3, consts, state, 9.0)
    take = la < before[0]
    assert take.any() and (~take).any() and not take[6]
    np.testing.assert_array_equal(state[0], np.where(take, la, before[0]))
    np.testing.assert_array_equal(state[1], np.where(take, 9.0, before[1]))
    np.testing.assert_array_equal(state[2], before[2])  # no tie flag
