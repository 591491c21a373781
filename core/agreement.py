"""Fast sketch agreement: how many samples two GCWS sketches share, on 2-bit codes.

Ranking thousands of bucket candidates by agreement over all k samples is what
keeps the exact rerank small. Two bits per sample (the low bits of the b-bit
code, itself a hash of i*) keep a row at k/4 bytes, so gathering candidate
rows stays cheap; chance agreement is 1/4, which shifts every score alike:
``E[agree] = k·(GMM + (1 − GMM)/4)`` — still monotone in GMM.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

_M01 = np.uint64(0x5555555555555555)
SAMPLES_PER_WORD = 32


@intrinsic
def _popcount(typingctx, x):
    """LLVM's ctpop: one instruction on any x86-64 with POPCNT."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)])
        return builder.call(fn, args)

    return sig, codegen


@njit(nogil=True, cache=True)
def _pack2(codes):
    n, k = codes.shape
    w = (k + SAMPLES_PER_WORD - 1) // SAMPLES_PER_WORD
    out = np.zeros((n, w), dtype=np.uint64)
    for v in range(n):
        for j in range(k):
            out[v, j >> 5] |= np.uint64(codes[v, j] & 3) << np.uint64(2 * (j & 31))
    return out


def pack2(codes: np.ndarray) -> np.ndarray:
    """b-bit codes (n, k) → their low 2 bits packed 32 per uint64 word (n, ceil(k/32))."""
    return _pack2(np.atleast_2d(np.asarray(codes, dtype=np.uint16)))


@njit(nogil=True, cache=True)
def agreement2(q, S, rows):
    """Samples on which query words ``q`` agree with rows ``rows`` of ``S`` (both from :func:`pack2`).

    Padding samples past k are zero on both sides and count for every row alike.
    """
    out = np.empty(rows.shape[0], dtype=np.int32)
    w = q.shape[0]
    for t in range(rows.shape[0]):
        r = rows[t]
        c = np.uint64(0)
        for j in range(w):
            x = S[r, j] ^ q[j]
            c += _popcount(~(x | (x >> np.uint64(1))) & _M01)
        out[t] = np.int32(c)
    return out
