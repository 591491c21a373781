"""b-bit codes of GCWS samples, their bit-plane layout, and sketch agreement.

A sample's code is the low ``b`` bits of a per-sample hash of ``i*`` (optionally
mixed with bits of ``t*``), so two different ``i*`` collide with probability
exactly ``2^-b`` and ``Pr[codes equal] = GMM + (1 − GMM)·2^-b`` on any data.

**Bit planes.** The search reads codes as *bit planes*: plane ``p`` of a sketch
holds bit ``p`` of every code, 64 samples to a ``uint64`` word, and a row is its
planes one after another, ``(b, words)``. Agreement on the low ``m`` bits of
every code is then ``popcount(~(x₀ | … | x_{m−1}))`` with ``x_p`` the XOR of
plane ``p`` — one OR per extra bit, one popcount per 64 samples — and the first
``m`` planes are a contiguous prefix of the row. So one stored layout serves a
cheap 2-bit pass (dense data, where random pairs already agree a lot) and an
8-bit pass (sparse text, where 2-bit chance agreement, 1/4, drowns a signal of
0.20 against 0.15), chosen per index by :mod:`gmmlsh.index.tuner`.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from gmmlsh.core.intrinsics import popcount
from gmmlsh.core.rng import hash_code

#: Samples per bit-plane word.
WORD = 64


@njit(nogil=True, cache=True)
def _codes(istar, tstar, use_t, t_bits, b, seed):
    n, k = istar.shape
    out = np.empty((n, k), dtype=np.uint16)
    mask = np.uint64((1 << b) - 1)
    tmask = np.int64((1 << t_bits) - 1)
    s = np.uint64(seed)
    for v in range(n):
        for j in range(k):
            val = np.uint64(istar[v, j])
            if use_t:
                val = val | (np.uint64(tstar[v, j] & tmask) << np.uint64(32))
            out[v, j] = np.uint16(hash_code(s, np.uint64(j), val) & mask)
    return out


def bbit_codes(istar, b: int = 8, seed: int = 0, tstar=None, t_bits: int = 0) -> np.ndarray:
    """Keep ``b`` bits per sample (uint16, b ≤ 16), optionally mixing in ``t_bits`` of t*.

    The bits are the low bits of a per-sample hash of ``i*`` rather than of
    ``i*`` itself: after the sign split the lowest bit of ``i*`` is the sign,
    which is constant on non-negative data, and the raw low bits of structured
    data (pixels, words) are far from uniform.
    """
    if not 1 <= b <= 16:
        raise ValueError(f"b: must be between 1 and 16, got {b}")
    if not 0 <= t_bits <= 16:
        raise ValueError(f"t_bits: must be between 0 and 16, got {t_bits}")
    ist = np.atleast_2d(np.asarray(istar, dtype=np.int32))
    use_t = tstar is not None and t_bits > 0
    tst = np.atleast_2d(np.asarray(tstar, dtype=np.int64)) if use_t else np.zeros((1, 1), np.int64)
    out = _codes(ist, tst, use_t, t_bits, b, np.uint64(seed))
    return out[0] if np.ndim(istar) == 1 else out


# --- packing for storage --------------------------------------------------------------


@njit(nogil=True, cache=True)
def _pack(codes, b, nbytes):
    n, k = codes.shape
    out = np.zeros((n, nbytes), dtype=np.uint8)
    for v in range(n):
        bit = 0
        for j in range(k):
            c = np.int64(codes[v, j])
            for q in range(b):
                if (c >> q) & 1:
                    out[v, (bit + q) >> 3] |= np.uint8(1 << ((bit + q) & 7))
            bit += b
    return out


@njit(nogil=True, cache=True)
def _unpack(packed, k, b):
    n = packed.shape[0]
    out = np.zeros((n, k), dtype=np.uint16)
    for v in range(n):
        bit = 0
        for j in range(k):
            c = 0
            for q in range(b):
                pos = bit + q
                if (packed[v, pos >> 3] >> (pos & 7)) & 1:
                    c |= 1 << q
            out[v, j] = c
            bit += b
    return out


def packed_bytes(k: int, b: int) -> int:
    """Bytes taken by ``k`` codes of ``b`` bits."""
    return (k * b + 7) // 8


def pack_codes(codes, b: int) -> np.ndarray:
    """Pack b-bit codes (n, k) into bytes (n, ceil(k·b/8)), least significant bit first: what a store keeps."""
    c = np.atleast_2d(np.asarray(codes))
    if b == 8:
        out = c.astype(np.uint8)
    elif b == 16:
        out = c.astype("<u2").view(np.uint8)
    else:
        out = _pack(c.astype(np.uint16), b, packed_bytes(c.shape[1], b))
    return out[0] if np.ndim(codes) == 1 else out


def unpack_codes(packed, k: int, b: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`."""
    p = np.atleast_2d(np.asarray(packed, dtype=np.uint8))
    if b == 8:
        out = p[:, :k].astype(np.uint16)
    elif b == 16:
        out = np.ascontiguousarray(p).view("<u2")[:, :k].astype(np.uint16)
    else:
        out = _unpack(p, k, b)
    return out[0] if np.ndim(packed) == 1 else out


# --- bit planes and agreement ----------------------------------------------------------


def plane_words(k: int) -> int:
    """Words per bit plane for ``k`` samples."""
    return -(-k // WORD)


@njit(nogil=True, cache=True)
def _planes(codes, b, words):
    n, k = codes.shape
    out = np.zeros((n, b * words), dtype=np.uint64)
    for v in range(n):
        for w in range(words):
            hi = min(k, (w + 1) * WORD)
            for p in range(b):
                acc = np.uint64(0)  # one plane word built in a register
                for j in range(w * WORD, hi):
                    acc |= ((np.uint64(codes[v, j]) >> np.uint64(p)) & np.uint64(1)) << np.uint64(j - w * WORD)
                out[v, p * words + w] = acc
    return out


#: Bit 0 of each byte of a word, and the multiplier that gathers those 8 bits into the top byte
#: (byte ``i``'s bit lands on bit ``56 + i``; no two partial products meet, so nothing carries).
_BYTE_LSB = np.uint64(0x0101010101010101)
_GATHER = np.uint64(0x0102040810204080)


@njit(nogil=True, cache=True)
def _planes_bytes(codes, b, words):
    """:func:`_planes` for codes of at most 8 bits, given as their bytes viewed as words
    ``(n, words·8)`` (8 samples a word, zero past ``k``): bit ``p`` of 8 codes at a time, by
    one multiplication, instead of one shift per code."""
    n = codes.shape[0]
    out = np.zeros((n, b * words), dtype=np.uint64)
    for v in range(n):
        for w in range(words):
            for p in range(b):
                acc = np.uint64(0)
                for g in range(8):
                    lsb = (codes[v, w * 8 + g] >> np.uint64(p)) & _BYTE_LSB
                    acc |= ((lsb * _GATHER) >> np.uint64(56)) << np.uint64(8 * g)
                out[v, p * words + w] = acc
    return out


def bit_planes(codes, b: int) -> np.ndarray:
    """b-bit codes (n, k) → bit planes (n, b·words) uint64: plane ``p`` (bit ``p`` of every code)
    at words ``[p·words, (p+1)·words)``; samples past ``k`` are 0 on every row (they agree
    everywhere alike: a constant offset)."""
    c = np.atleast_2d(np.asarray(codes, dtype=np.uint16))
    words = plane_words(c.shape[1])
    if b <= 8 and sys.byteorder == "little":
        padded = np.zeros((c.shape[0], words * WORD), dtype=np.uint8)
        padded[:, :c.shape[1]] = c
        out = _planes_bytes(padded.view(np.uint64), b, words)
    else:
        out = _planes(c, b, words)
    return out[0] if np.ndim(codes) == 1 else out


@njit(nogil=True, cache=True, inline="always")
def agreement(a, b, words, planes, first_words):
    """Samples among the first ``first_words·64`` on which the low ``planes`` bits of two
    plane rows agree (``a``, ``b``: 1-D rows laid out as :func:`bit_planes` makes them)."""
    total = 0
    stride = np.uint64(words)
    for w in range(first_words):
        d = a[w] ^ b[w]
        for p in range(1, planes):
            i = np.uint64(p) * stride + np.uint64(w)  # unsigned: no wrap-around check per read
            d |= a[i] ^ b[i]
        total += popcount(~d)
    return total


# --- estimators ---------------------------------------------------------------------


def collision_rate(a, b) -> np.ndarray | float:
    """Share of samples on which two sketches agree (last axis)."""
    return np.mean(np.asarray(a) == np.asarray(b), axis=-1)


def corrected_rate(rate, bits: int):
    """Undo the ``2^-b`` chance collisions of b-bit codes: ``GMM = (Pr − 2^-b)/(1 − 2^-b)``."""
    chance = 2.0**-bits
    return (np.asarray(rate) - chance) / (1.0 - chance)


def estimate_gmm(a, b, bits: int | None = None):
    """GMM estimate from two sketches; with ``bits`` corrects the b-bit chance collisions."""
    rate = collision_rate(a, b)
    return rate if bits is None else corrected_rate(rate, bits)


def bbit_collision_probability(gmm, bits: int):
    """Expected collision probability of b-bit codes for a pair with this GMM."""
    return np.asarray(gmm) + (1.0 - np.asarray(gmm)) * 2.0**-bits
