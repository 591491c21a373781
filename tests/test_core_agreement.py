"""Sketch agreement kernels (core.agreement) against plain numpy.

The scan and its selections decide which candidates reach the exact rerank, so
they must be exact: the c best rows by agreement, ties broken by row order,
whatever shortcut the selection takes.
"""

from __future__ import annotations

import numpy as np
import pytest
from gmmlsh.core.agreement import (
    FIRST_WORDS,
    SAMPLES_PER_WORD,
    _best,
    _best_of_all,
    agreement2,
    first_words,
    pack2,
    top_by_agreement,
)


def _reference_best(scores: np.ndarray, rows: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """The c highest scores ≥ 0, ties in row order; returned in row order like the kernels."""
    live = np.flatnonzero(scores >= 0)
    order = live[np.lexsort((live, -scores[live]))][:c]
    order.sort()
    return rows[order], scores[order]


def _agreement_numpy(codes_q: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return ((codes & 3) == (codes_q & 3)).sum(axis=1)


@pytest.mark.parametrize("k", [64, 256, 480])
def test_agreement2_counts_equal_two_bit_codes(k):
    rng = np.random.default_rng(k)
    codes = rng.integers(0, 256, (300, k)).astype(np.uint16)
    q = codes[0].copy()
    q[: k // 3] = rng.integers(0, 256, k // 3)
    words = -(-k // SAMPLES_PER_WORD)
    S, qw = pack2(codes, words), pack2(q[None, :], words)[0]
    pad = words * SAMPLES_PER_WORD - k  # zero padding agrees on both sides
    rows = rng.permutation(300)[:100].astype(np.int64)
    got = agreement2(qw, S, rows)
    assert np.array_equal(got, _agreement_numpy(q, codes[rows]) + pad)


def _scores(rng, n: int, kind: str) -> np.ndarray:
    if kind == "spread":
        s = rng.binomial(256, 0.4, n)
    elif kind == "ties":  # a handful of distinct values: the cut lands inside a big tie
        s = rng.integers(100, 104, n)
    elif kind == "top_unsampled":  # the best rows all sit where the stride-8 sample never looks
        s = rng.binomial(256, 0.3, n)
        s[np.flatnonzero(np.arange(n) % 8 != 0)[:3000]] = 250
    elif kind == "top_sampled":  # the best rows all sit where the sample looks
        s = rng.binomial(256, 0.3, n)
        s[np.arange(0, n, 8)[:300]] = 250
    else:  # "few_live": most rows absent
        s = rng.binomial(256, 0.4, n)
        s[rng.random(n) < 0.99] = -1
    return s.astype(np.int32)


@pytest.mark.parametrize("kind", ["spread", "ties", "top_unsampled", "top_sampled", "few_live"])
@pytest.mark.parametrize("n,c", [(60_000, 1024), (20_000, 200), (5_000, 1024), (100, 10)])
def test_selection_is_exact_whatever_the_shortcut(kind, n, c):
    rng = np.random.default_rng(n + c)
    scores = _scores(rng, n, kind)
    want_rows, want_scores = _reference_best(scores, np.arange(n), c)
    rows, got = _best_of_all(scores, c, 256)
    assert np.array_equal(rows, want_rows) and np.array_equal(got, want_scores)
    rows2, got2 = _best(scores, np.arange(n), c, 256)
    assert np.array_equal(rows2, want_rows) and np.array_equal(got2, want_scores)


@pytest.mark.parametrize("k", [256, 480])
def test_top_by_agreement_matches_a_two_stage_numpy_ranking(k):
    rng = np.random.default_rng(7)
    n, c = 30_000, 50
    base = rng.integers(0, 256, k)
    # rows share a random share of the query's codes: agreements spread over the whole range
    share = rng.random((n, 1))
    codes = np.where(rng.random((n, k)) < share, base, rng.integers(0, 256, (n, k))).astype(np.uint16)
    words = -(-k // SAMPLES_PER_WORD)
    words += -words % FIRST_WORDS
    S = pack2(codes, words)
    F = first_words(S)
    q = pack2(base[None, :].astype(np.uint16), words)[0]
    have = (rng.random(n) > 0.05).astype(np.uint8)
    rows, scores = top_by_agreement(q, S, F, have, n, c)

    first = _agreement_numpy(base[: FIRST_WORDS * SAMPLES_PER_WORD], codes[:, : FIRST_WORDS * SAMPLES_PER_WORD])
    first = np.where(have > 0, first, -1).astype(np.int32)
    stage1, _ = _reference_best(first, np.arange(n), max(4 * c, 1024))
    full = (_agreement_numpy(base, codes[stage1]) + words * SAMPLES_PER_WORD - k).astype(np.int32)
    want_rows, want_scores = _reference_best(full, stage1, c)
    assert np.array_equal(np.sort(rows), np.sort(want_rows))
    assert np.array_equal(scores[np.argsort(rows)], want_scores[np.argsort(want_rows)])
