"""The default query in one compiled call: sketch → 2-bit codes → two-stage scan → exact rerank.

Each step is a kernel of its own module; called one by one from Python, the
calls, argument checks and temporaries between them cost about a third of a
query (measured: ~190 of ~590 µs on Fashion-MNIST). This chains the same kernels
on arrays, so the answer is the one the step-by-step path gives.
"""

from __future__ import annotations

import numpy as np
from gmmlsh.core.agreement import _pack2, top_by_agreement
from gmmlsh.core.gcws import _codes, _sample_dense_serial
from gmmlsh.core.gmm import _SERIAL
from gmmlsh.core.parallel import twin_kernels
from numba import njit, prange

_dense_scores = _SERIAL[0]


@njit(nogil=True, cache=True)
def best_by_score(rows, scores, exclude, budget):
    """The ``budget`` rows with the highest scores, ``exclude`` left out; ties in row order.

    ``rows`` ascend (as :func:`core.agreement.top_by_agreement` returns them), so a
    stable sort by score alone breaks ties by row.
    """
    keep = rows != exclude
    rows, scores = rows[keep], scores[keep]
    order = np.argsort(-scores.astype(np.int64), kind="mergesort")[:budget]
    return rows[order]


@njit(nogil=True, cache=True)
def rank_dense_query(q, table, walk_e, walk_c, k, bits, seed, words, S, F, have, n, budget, exclude, values, norms,
                     cached, qn):
    """(rows, exact GMMs, all cached) of the default lsh query for one dense float32 vector ``q``.

    ``table``/``walk_e``/``walk_c``: the full GCWS constant table of ``2·len(q)``
    coordinates and its walk lists (:func:`core.gcws.walk_table`); ``S``/``F``/``have``:
    the 2-bit ranking codes and first-stage words of the first ``n`` rows; ``values``/
    ``norms``/``cached``: the vector cache; ``qn``: the L1 norm of ``q`` (summed by numpy,
    as the step-by-step path sums it). When a chosen row is not cached yet the
    scores are not computed (third value False): the caller fetches and scores them.
    """
    d = q.shape[0]
    out_i = np.empty((1, k), dtype=np.int32)
    out_t = np.empty((1, 1), dtype=np.int64)
    _sample_dense_serial(q.reshape((1, d)), np.arange(2 * d), table, walk_e, walk_c, k, out_i, out_t, False)
    packed = _pack2(_codes(out_i, out_t, False, 0, bits, seed))
    qw = np.zeros(words, dtype=np.uint64)
    qw[: packed.shape[1]] = packed[0]
    rows, scores = top_by_agreement(qw, S, F, have, n, budget + 1)
    chosen = best_by_score(rows, scores, exclude, budget)
    sims = np.empty(chosen.shape[0])
    for r in chosen:
        if r >= cached.shape[0] or not cached[r]:
            return chosen, sims, False
    _dense_scores(q.astype(np.float64), qn, values, norms, chosen, sims)
    return chosen, sims, True


def _rank_dense_queries_impl(Q, qn, table, walk_e, walk_c, k, bits, seed, words, S, F, have, n, budget, values,
                             norms, cached, rows_out, sims_out, counts, complete):
    """:func:`rank_dense_query` for every row of ``Q``, into ``rows_out``/``sims_out`` (m, budget):
    row i's first ``counts[i]`` entries; ``complete[i]`` False where its sims are not computed."""
    for i in prange(Q.shape[0]):
        rows, sims, ok = rank_dense_query(Q[i], table, walk_e, walk_c, k, bits, seed, words, S, F, have, n,
                                          budget, -1, values, norms, cached, qn[i])
        c = rows.shape[0]
        counts[i] = c
        complete[i] = ok
        rows_out[i, :c] = rows
        if ok:
            sims_out[i, :c] = sims


#: A batch of default lsh queries in one call: parallel over queries, or serial. The
#: per-query Python work (validation, calls, temporaries) is paid once per batch.
rank_dense_queries_parallel, rank_dense_queries_serial = twin_kernels(_rank_dense_queries_impl, nogil=True,
                                                                      cache=True)
