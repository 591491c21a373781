"""Counter-based randomness: every random number is a pure function of its coordinates.

GCWS is only *consistent* if the constants drawn for coordinate ``i`` and sample
``j`` are the same in every process, batch, thread and release.  A stateful RNG
cannot promise that, so each uniform is ``mix64`` (SplitMix64's finaliser)
applied to the tuple ``(seed, i, j, stream)``.  Changing anything here changes
every stored sketch: bump ``GENERATOR_VERSION`` if you do.
"""

from __future__ import annotations

import numpy as np
from numba import float64, njit, uint64

#: 2: the per-(i, j) constants are rounded to float32 (half the table; rare samples differ from 1).
GENERATOR_VERSION = 2

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_S3 = np.uint64(3)
_TWO_M53 = 1.0 / 9007199254740992.0  # 2**-53


@njit(uint64(uint64), nogil=True, cache=True, inline="always")
def mix64(z):
    """SplitMix64 finaliser: a bijective 64-bit mixer with full avalanche."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(uint64(uint64, uint64), nogil=True, cache=True, inline="always")
def coord_key(seed, i):
    """Key of one coordinate under one seed; shared by all samples of that coordinate."""
    return mix64(mix64(seed ^ _GOLDEN) ^ i)


@njit(float64(uint64, uint64, uint64), nogil=True, cache=True, inline="always")
def uniform(ckey, j, stream):
    """Uniform on the open interval (0, 1), for (coordinate key, sample j, stream < 8)."""
    h = mix64(ckey ^ ((j << _S3) | stream) * _GOLDEN)
    return (np.float64(h >> _S11) + 0.5) * _TWO_M53


@njit(uint64(uint64, uint64, uint64), nogil=True, cache=True, inline="always")
def hash_code(seed, j, value):
    """64-bit hash of an integer value for sample j (used to spread b-bit codes)."""
    return mix64(mix64(seed ^ (j * _GOLDEN)) ^ value)
