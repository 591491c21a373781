"""The sorted walk (core.gcws_walk) gives the reference kernel's samples bit for bit.

The reference is the nonzero-major kernel of core.gcws (the direct path, or the
table path with t* wanted, never walks). Ties — equal ``ln a`` at two
coordinates, where the reference keeps the smaller coordinate — cannot be found
with the generator's constants, so one test builds a table that has one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gmmlsh.core import gcws
from gmmlsh.core.gcws import NO_WALK, _sample_dense, constant_table, sketch, walk_table
from gmmlsh.core.gcws_walk import LANES, build_walk_table, sign_bounds, walk_vector


def _walk_one(row: np.ndarray, table: np.ndarray, k: int) -> tuple[bool, np.ndarray]:
    """walk_vector on one dense row, as the sampling kernel calls it."""
    E, C = build_walk_table(table)
    lx = np.full(2 * row.shape[0], np.nan)
    coords, logs = [], []
    for i, x in enumerate(row.astype(np.float64)):
        if x != 0.0:
            coords.append(2 * i + (x < 0))
            logs.append(math.log(abs(x)))
            lx[coords[-1]] = logs[-1]
    U = np.empty(2)
    sign_bounds(np.array(coords, dtype=np.int64), np.array(logs), len(coords), U)
    out = np.full(k, -1, dtype=np.int32)
    ok = walk_vector(lx, U, E, C, k, out, np.empty((3, LANES)))
    return ok, out


def _reference(X: np.ndarray, table: np.ndarray, k: int) -> np.ndarray:
    out = np.empty((X.shape[0], k), dtype=np.int32)
    _sample_dense(X, np.arange(2 * X.shape[1]), table, *NO_WALK, k, out, np.empty((1, 1), np.int64), False)
    return out


@pytest.mark.parametrize("k", [1, 31, 100, 256])
def test_walk_equals_reference_on_fashion_mnist(fmnist, k: int) -> None:
    X = fmnist[0][:300]
    table = constant_table(2 * X.shape[1], k, 7)
    want = _reference(X, table, k)
    for r in range(0, 300, 37):
        ok, got = _walk_one(X[r], table, k)
        assert ok
        np.testing.assert_array_equal(got, want[r])
    np.testing.assert_array_equal(sketch(X, k, seed=7, path="table"), sketch(X, k, seed=7, path="direct"))


def test_walk_equals_reference_on_signed_heavy_tailed_rows() -> None:
    """Negative entries, values far below and above 1 (ln ũ of both signs), all coordinates nonzero."""
    rng = np.random.default_rng(11)
    X = rng.standard_normal((200, 96)) * np.exp(rng.normal(0, 4, (200, 96)))
    X[:, ::7] = 1e-30  # tiny weights: ln ũ ≈ −69
    table = constant_table(192, 64, 3)
    want = _reference(X, table, 64)
    for r in range(0, 200, 9):
        ok, got = _walk_one(X[r], table, 64)
        assert ok
        np.testing.assert_array_equal(got, want[r])
    np.testing.assert_array_equal(sketch(X, 64, seed=3, path="table"), sketch(X, 64, seed=3, path="direct"))


def test_walk_lists_are_sorted_and_bounds_rounded_down() -> None:
    table = constant_table(64, 40, 5)
    E, C = build_walk_table(table)
    t64 = table.astype(np.float64)
    bound = t64[:, :, 2, :] - t64[:, :, 3, :] * t64[:, :, 1, :]
    for s in (0, 1):  # the positive halves, then the negative halves, each sorted by B
        part = slice(32 * s, 32 * s + 32)
        assert (np.diff(E[:, part, 0, :], axis=1) >= 0).all()
        assert (C[:, part, :] % 2 == s).all()
    exact = bound[C, np.arange(E.shape[0])[:, None, None], np.arange(LANES)]
    assert (E[:, :, 0, :].astype(np.float64) <= exact).all()
    for blk in range(E.shape[0]):  # every list holds every coordinate once
        assert (np.sort(C[blk], axis=0) == np.arange(64)[:, None]).all()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_walk_equals_reference_on_one_signed_and_mixed_rows(scale: float) -> None:
    """Rows with only negative values (the positive list is skipped), a single
    negative among positives, and all values below 1 (``U`` < 0: the tightest bound)."""
    rng = np.random.default_rng(5)
    d, k = 300, 96
    pos = rng.exponential(1.0, (6, d)) * scale
    rows = [pos[0], -pos[1], pos[2].copy(), pos[3] * np.where(rng.random(d) < 0.5, 1, -1)]
    rows[2][17] = -rows[2][17]
    table = constant_table(2 * d, k, 9)
    want = _reference(np.array(rows), table, k)
    for r, row in enumerate(rows):
        ok, got = _walk_one(row, table, k)
        assert ok
        np.testing.assert_array_equal(got, want[r])


def test_sign_bounds_cover_each_signs_largest_log() -> None:
    U = np.empty(2)
    sign_bounds(np.array([0, 3, 4, 7]), np.array([-2.0, 1.5, -1.0, 0.5]), 4, U)
    assert -1.0 < U[0] < -1.0 + 1e-5 and 1.5 < U[1] < 1.5 + 1e-5
    sign_bounds(np.array([2, 6]), np.array([3.0, -4.0]), 2, U)
    assert 3.0 < U[0] < 3.0 + 1e-5 and np.isnan(U[1])


def test_a_tie_falls_back_to_the_reference() -> None:
    """Coordinates 0 and 2 get equal ln a for every sample, and 2 comes first in the walk.

    The reference keeps coordinate 0 (the smaller); a walk that ignored ties would
    report 2. Coordinate 2 copies coordinate 0's constants but a β raised within the
    same ⌊lx/r + β⌋, which lowers its bound B = base − r·β without changing ln a.
    """
    k = LANES
    d = 200  # dense enough for the sampling kernel to walk it
    table = constant_table(2 * d, k, 1).copy()
    row = np.full(d, 1e-300)  # ln ũ ≈ −690: these coordinates never come near the minimum
    row[:2] = 1.0  # coordinates 0 and 2, ln ũ = 0: t = ⌊β⌋ = 0 and ln a = base
    table[2] = table[0]
    beta = table[0, :, 1, :].astype(np.float64)
    table[2, :, 1, :] = np.nextafter(np.float32(beta + (1 - beta) / 2), np.float32(0))
    want = _reference(row[None, :], table, k)[0]
    assert (want == 0).all()  # the tie went to the smaller coordinate
    ok, _ = _walk_one(row, table, k)
    assert not ok, "the tie was not detected"
    walk = build_walk_table(table)
    out = np.empty((1, k), dtype=np.int32)
    _sample_dense(row[None, :], np.arange(2 * d), table, *walk, k, out, np.empty((1, 1), np.int64), False)
    np.testing.assert_array_equal(out[0], want)


def test_walk_table_respects_the_budget(monkeypatch) -> None:
    walk_table.cache_clear()
    monkeypatch.setattr(gcws, "TABLE_BUDGET_BYTES", 1000)
    try:
        assert walk_table(64, 32, 0)[0].shape[0] == 0
    finally:
        walk_table.cache_clear()
