"""Exact top-k by GMM: the ground truth every benchmark compares an index's answers with.

Rows come in parts (each with the ids its rows stand for), so a truth can be found over
data larger than memory, or over whatever an index holds at the end of a run (rows
gathered from several places, under their ids). Scoring uses the engine's own exact
kernels (:mod:`gmmlsh.core.gmm`): all queries against a block of dense rows at once
(``gmm_matrix``, tiled, on every core), or one query at a time against sparse rows
(``gmm_many``, touching each row's nonzeros only). Sparse parts of low dimension are made
dense first, which is faster there.
"""

from __future__ import annotations

from collections.abc import Iterable

import numba
import numpy as np
import scipy.sparse as sp

from gmmlsh.core import parallel
from gmmlsh.core.gmm import gmm_many, gmm_matrix, l1_norms

#: Sparse rows of at most this dimension are scored dense (a dense block costs 4·dim bytes a row).
DENSIFY_DIM = 4096
#: Rows scored at once (a dense block of 20,000 × 784 float32 is 63 MB).
STEP = 20_000


def top_k(Q, parts: Iterable[tuple[np.ndarray, np.ndarray | sp.spmatrix]], k: int = 10
          ) -> tuple[np.ndarray, np.ndarray]:
    """Each query's ``k`` most similar rows: (ids, similarities), best first, ties in id order.

    ``Q``: dense 2-D or CSR queries; ``parts``: ``(ids, rows)`` pairs, ``rows`` dense 2-D
    or CSR with one id per row.
    """
    nq = Q.shape[0]
    Qd = np.asarray(Q.toarray() if sp.issparse(Q) else Q, dtype=np.float32)
    qn = l1_norms(Qd)
    best_s = np.full((nq, k), -1.0)
    best_i = np.full((nq, k), -1, np.int64)
    parallel.set_threads(numba.config.NUMBA_NUM_THREADS)
    for ids, X in parts:
        for lo in range(0, X.shape[0], STEP):
            block, bids = X[lo:lo + STEP], np.asarray(ids[lo:lo + STEP], np.int64)
            if sp.issparse(block) and block.shape[1] <= DENSIFY_DIM:
                block = block.toarray()
            if sp.issparse(block):
                block = sp.csr_matrix(block)
                xn = l1_norms(block)
                S = np.stack([gmm_many(Qd[i], block, xn) for i in range(nq)])
            else:
                block = np.ascontiguousarray(block, dtype=np.float32)
                S = gmm_matrix(Qd, block, qn, l1_norms(block))
            s = np.concatenate([best_s, S], axis=1)
            i = np.concatenate([best_i, np.broadcast_to(bids, (nq, bids.shape[0]))], axis=1)
            top = np.argpartition(-s, k - 1, axis=1)[:, :k]
            best_s, best_i = np.take_along_axis(s, top, 1), np.take_along_axis(i, top, 1)
    order = np.lexsort((best_i, -best_s), axis=1)
    return np.take_along_axis(best_i, order, 1), np.take_along_axis(best_s, order, 1)
