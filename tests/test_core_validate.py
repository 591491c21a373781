"""Every bad input raises its documented error (core.validate), at every core entry point.

The error types are what the service maps to 4xx answers naming the field, so the
test checks the type *and* the field, not just "some exception".
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from gmmlsh.core.codes import bbit_codes
from gmmlsh.core.gcws import sketch, sketch_sparse_vector
from gmmlsh.core.gmm import gmm, gmm_many, gmm_matrix, score_rows
from gmmlsh.core.nrff import features
from gmmlsh.core.validate import (
    DimensionError,
    NonFiniteError,
    SparseIndexError,
    VectorError,
    ZeroVectorError,
    check_batch,
    check_dense,
    check_sparse,
)

X = np.array([[1.0, -2.0, 0.0], [0.0, 0.5, 3.0]])


def test_error_hierarchy() -> None:
    """All are VectorError (hence ValueError) and carry the field and the reason."""
    for cls in (DimensionError, NonFiniteError, ZeroVectorError, SparseIndexError):
        assert issubclass(cls, VectorError) and issubclass(cls, ValueError)
    err = DimensionError("values", "expected 3 values, got 4")
    assert err.field == "values" and err.reason == "expected 3 values, got 4"
    assert str(err) == "values: expected 3 values, got 4"


def test_an_error_carries_its_row_and_part() -> None:
    """The row of a batch and the part of the row travel in the error, not only in its text:
    moved to another row (a part of a batch checked alone), pickled, the parts stay."""
    import pickle

    err = SparseIndexError("vectors", "duplicate index 3", row=2, part="indices")
    assert (err.name, err.row, err.part, err.field) == ("vectors", 2, "indices", "vectors[2].indices")
    moved = err.at(7)
    assert type(moved) is SparseIndexError and moved.field == "vectors[7].indices" and moved.reason == err.reason
    back = pickle.loads(pickle.dumps(moved))
    assert type(back) is SparseIndexError and (back.field, back.row, back.part) == ("vectors[7].indices", 7, "indices")
    assert ZeroVectorError("vectors", "all zero", row=0, part="values").field == "vectors[0]"
    with pytest.raises(ValueError, match="part"):
        VectorError("vectors", "x", row=0, part="vals")


@pytest.mark.parametrize(
    ("indices", "values", "part"),
    [([2, 1], [1.0, 1.0], "indices"), ([1, 9], [1.0, 1.0], "indices"), (["x"], [1.0], "indices"),
     ([1, 2], [math.nan, 1.0], "values"), ([1, 2], [0.0, 0.0], "values")],
)
def test_check_sparse_says_which_list_is_at_fault(indices, values, part) -> None:
    with pytest.raises(VectorError) as info:
        check_sparse(indices, values, 5, field="vectors", row=4)
    assert (info.value.row, info.value.part) == (4, part)


def test_check_batch_names_the_row_in_parts() -> None:
    bad = X.copy()
    bad[1] = 0
    for batch in (bad, sp.csr_matrix(bad)):
        with pytest.raises(ZeroVectorError) as info:
            check_batch(batch)
        assert (info.value.name, info.value.row, info.value.part, info.value.field) == ("vectors", 1, "values",
                                                                                        "vectors[1]")


# --- the checkers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "dim", "error", "field"),
    [
        ([1.0, 2.0], 3, DimensionError, "values"),
        ([[1.0, 2.0, 3.0]], 3, DimensionError, "values"),
        ([], None, DimensionError, "values"),
        ([1.0, math.nan, 2.0], 3, NonFiniteError, "values"),
        ([1.0, math.inf, 2.0], 3, NonFiniteError, "values"),
        ([-math.inf, 1.0, 2.0], 3, NonFiniteError, "values"),
        ([0.0, 0.0, -0.0], 3, ZeroVectorError, "values"),
        (["a", 1.0], None, VectorError, "values"),
    ],
)
def test_check_dense(values, dim, error, field) -> None:
    with pytest.raises(error) as info:
        check_dense(values, dim)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("indices", "values", "dim", "error"),
    [
        ([2, 1], [1.0, 1.0], 5, SparseIndexError),  # unsorted
        ([1, 1], [1.0, 1.0], 5, SparseIndexError),  # duplicate
        ([-1, 2], [1.0, 1.0], 5, SparseIndexError),  # negative
        ([1, 5], [1.0, 1.0], 5, DimensionError),  # out of range
        ([1, 2], [1.0], 5, SparseIndexError),  # mismatched lengths
        ([1], [1.0, 2.0], 5, SparseIndexError),  # mismatched lengths
        ([0.5, 2], [1.0, 1.0], 5, SparseIndexError),  # not integers
        ([[1, 2]], [[1.0, 1.0]], 5, SparseIndexError),  # not flat
        ([1, 2], [math.nan, 1.0], 5, NonFiniteError),
        ([1, 2], [1.0, -math.inf], 5, NonFiniteError),
        ([1, 2], [0.0, 0.0], 5, ZeroVectorError),
        ([], [], 5, ZeroVectorError),
    ],
)
def test_check_sparse(indices, values, dim, error) -> None:
    with pytest.raises(error):
        check_sparse(indices, values, dim)


def test_check_sparse_accepts_good_input() -> None:
    idx, val = check_sparse([0, 3, 4], [1, -2.5, 0.0], 5)
    assert idx.dtype == np.int64 and val.dtype == np.float64
    np.testing.assert_array_equal(idx, [0, 3, 4])


def test_check_batch_names_the_row() -> None:
    with pytest.raises(DimensionError):
        check_batch(X, dim=4)
    with pytest.raises(DimensionError):
        check_batch(sp.csr_matrix(X), dim=4)
    with pytest.raises(DimensionError):
        check_batch(np.ones((2, 3, 1)))
    bad = X.copy()
    bad[1, 2] = math.nan
    with pytest.raises(NonFiniteError) as info:
        check_batch(bad)
    assert info.value.field == "vectors[1]"
    with pytest.raises(NonFiniteError) as info:
        check_batch(sp.csr_matrix(bad))
    assert info.value.field == "vectors[1]"
    zero = np.vstack([X, np.zeros(3)])
    with pytest.raises(ZeroVectorError) as info:
        check_batch(zero)
    assert info.value.field == "vectors[2]"
    # a CSR row whose only stored entries are zeros is an all-zero vector
    stored_zero = sp.csr_matrix((np.array([1.0, 0.0]), np.array([0, 1]), np.array([0, 1, 2])), shape=(2, 3))
    with pytest.raises(ZeroVectorError) as info:
        check_batch(stored_zero)
    assert info.value.field == "vectors[1]"


# --- sketch --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_sketch_refuses_non_finite(bad: float) -> None:
    Y = X.copy()
    Y[1, 0] = bad
    for form in (Y, sp.csr_matrix(Y)):
        with pytest.raises(NonFiniteError):
            sketch(form, 8)
    with pytest.raises(NonFiniteError):
        sketch(Y[1], 8)
    # the centred path validates too (it skips the zero-row check, not the finiteness one)
    with pytest.raises(NonFiniteError):
        sketch(Y, 8, center=np.zeros(3))
    with pytest.raises(NonFiniteError):
        sketch(X, 8, center=np.array([0.0, bad, 0.0]))


def test_sketch_refuses_zero_vectors() -> None:
    with pytest.raises(ZeroVectorError):
        sketch(np.zeros(4), 8)
    with pytest.raises(ZeroVectorError):
        sketch(np.vstack([X, np.zeros(3)]), 8)
    with pytest.raises(ZeroVectorError):
        sketch(sp.csr_matrix(np.vstack([X, np.zeros(3)])), 8)
    with pytest.raises(ZeroVectorError):
        sketch(X, 8, center=X[0])  # row 0 equals the center: nothing to sample
    # with a center, an all-zero raw row is fine
    assert sketch(np.zeros((1, 3)), 8, center=np.ones(3)).shape == (1, 8)


@pytest.mark.parametrize("k", [0, -1, -64])
def test_k_must_be_positive(k: int) -> None:
    with pytest.raises(ValueError, match="k"):
        sketch(X, k)
    with pytest.raises(ValueError, match="k"):
        features(X, k, 1.0)


def test_sketch_other_arguments() -> None:
    with pytest.raises(ValueError, match="path"):
        sketch(X, 8, path="fast")
    with pytest.raises(ValueError, match="center"):
        sketch(X, 8, center=np.zeros(2))


@pytest.mark.parametrize(
    ("indices", "values", "error"),
    [
        ([2, 0], [1.0, 1.0], SparseIndexError),
        ([0, 0], [1.0, 1.0], SparseIndexError),
        ([-1, 0], [1.0, 1.0], SparseIndexError),
        ([0, 3], [1.0, 1.0], DimensionError),
        ([0, 1], [1.0], SparseIndexError),
        ([0, 1], [0.0, 0.0], ZeroVectorError),
        ([0, 1], [math.nan, 1.0], NonFiniteError),
    ],
)
def test_sketch_sparse_vector_refuses(indices, values, error) -> None:
    with pytest.raises(error):
        sketch_sparse_vector(indices, values, 3, 8)


@pytest.mark.parametrize("b", [0, -1, 17, 32])
def test_b_out_of_range(b: int) -> None:
    I = sketch(X, 8)
    with pytest.raises(ValueError, match="b"):
        bbit_codes(I, b)


def test_t_bits_out_of_range() -> None:
    I, T = sketch(X, 8, return_t=True)
    with pytest.raises(ValueError, match="t_bits"):
        bbit_codes(I, 8, tstar=T, t_bits=17)
    with pytest.raises(ValueError, match="t_bits"):
        bbit_codes(I, 8, tstar=T, t_bits=-1)


# --- gmm -----------------------------------------------------------------------------------


def test_gmm_wrong_dimension() -> None:
    with pytest.raises(DimensionError):
        gmm(np.ones(4), np.ones(3))
    with pytest.raises(DimensionError):
        gmm_many(np.ones(4), X)
    with pytest.raises(DimensionError):
        gmm_many(([0, 3], [1.0, 1.0]), X)  # index 3 out of range for 3 columns
    with pytest.raises(DimensionError):
        gmm_many(np.ones(4), sp.csr_matrix(X))
    with pytest.raises(DimensionError):
        score_rows(np.ones(2), X, np.array([0]))
    with pytest.raises(DimensionError):
        gmm_matrix(np.ones((2, 4)), X)
    with pytest.raises(DimensionError):
        gmm_matrix(np.ones((2, 3)), np.ones(3))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_gmm_non_finite(bad: float) -> None:
    q = np.array([1.0, bad, 0.0])
    with pytest.raises(NonFiniteError):
        gmm(q, X[0])
    with pytest.raises(NonFiniteError):
        gmm(X[0], q)
    with pytest.raises(NonFiniteError):
        gmm_many(q, X)
    with pytest.raises(NonFiniteError):
        gmm_many(([0, 1], [1.0, bad]), X)
    with pytest.raises(NonFiniteError):
        gmm_matrix(np.vstack([X[0], q]), X)


def test_gmm_zero_vector() -> None:
    with pytest.raises(ZeroVectorError):
        gmm(np.zeros(3), X[0])
    with pytest.raises(ZeroVectorError):
        gmm(X[0], np.zeros(3))
    with pytest.raises(ZeroVectorError):
        gmm_many(np.zeros(3), X)
    with pytest.raises(ZeroVectorError):
        gmm_many(([0, 2], [0.0, 0.0]), X)
    with pytest.raises(ZeroVectorError):
        gmm_matrix(np.zeros((1, 3)), X)


@pytest.mark.parametrize(
    ("indices", "values", "error"),
    [
        ([2, 0], [1.0, 1.0], SparseIndexError),
        ([1, 1], [1.0, 1.0], SparseIndexError),
        ([-1, 1], [1.0, 1.0], SparseIndexError),
        ([0, 1, 2], [1.0, 1.0], SparseIndexError),
    ],
)
def test_gmm_sparse_query_refused(indices, values, error) -> None:
    with pytest.raises(error):
        gmm_many((indices, values), X)
    with pytest.raises(error):
        gmm((indices, values), X[0])


# --- nrff ----------------------------------------------------------------------------------


def test_features_refuses_bad_input() -> None:
    with pytest.raises(NonFiniteError):
        features(np.array([1.0, math.nan]), 8, 1.0)
    with pytest.raises(ZeroVectorError):
        features(np.vstack([X, np.zeros(3)]), 8, 1.0)
    with pytest.raises(ZeroVectorError):
        features(sp.csr_matrix(np.vstack([X, np.zeros(3)])), 8, 1.0)
    for gamma in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="gamma"):
            features(X, 8, gamma)


def test_dense_float32_fast_path_matches_the_full_checks():
    """The compiled query check returns exactly what check_dense + float32 rounding give,
    and declines (None) everything the full checks would refuse or must convert."""
    from gmmlsh.core.validate import dense_float32_or_none

    rng = np.random.default_rng(5)
    for dtype in (np.float64, np.float32):
        v = (rng.standard_normal(50) * 10.0 ** rng.integers(-30, 30, 50)).astype(dtype)
        v[::7] = 0.0
        got = dense_float32_or_none(v, 50)
        assert got is not None and got.dtype == np.float32
        assert np.array_equal(got, check_dense(v, 50).astype(np.float32))
    declined = {
        "nan": np.array([1.0, np.nan]),
        "inf": np.array([1.0, -np.inf]),
        "overflows float32": np.array([1.0, 1e39]),
        "all zero": np.zeros(2),
        "underflows to zero": np.array([1e-50, -1e-60]),
        "wrong length": np.ones(3),
        "integers": np.array([1, 2]),
        "2-D": np.ones((1, 2)),
        "a list": [1.0, 2.0],
    }
    for what, v in declined.items():
        assert dense_float32_or_none(v, 2) is None, what
