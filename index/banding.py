"""LSH banding: cut k b-bit codes into L bands of r and turn each band into a bucket key.

Key of band ``ℓ`` = ``ℓ`` as 2 big-endian bytes + the band's r codes packed
into ``ceil(r·b/8)`` bytes. Two vectors share a bucket iff all r codes of that
band agree, which happens with probability ``p^r`` for per-sample collision
probability ``p ≈ GMM + (1 − GMM)·2^-b``.
"""

from __future__ import annotations

import numpy as np
from gmmlsh.core.gcws import pack_codes, unpack_codes


class Banding:
    """Band-key maker for one (L, r, b) layout."""

    def __init__(self, bands: int, rows: int, bits: int):
        self.bands, self.rows, self.bits = bands, rows, bits
        self.band_bytes = (rows * bits + 7) // 8
        self.key_bytes = 2 + self.band_bytes
        self._prefix = np.array([[(band >> 8) & 0xFF, band & 0xFF] for band in range(bands)], dtype=np.uint8)

    def keys_from_codes(self, codes: np.ndarray) -> np.ndarray:
        """(n, L·r) uint16 codes → (n, L, key_bytes) uint8 keys."""
        codes = np.atleast_2d(codes)
        n = codes.shape[0]
        per_band = codes[:, : self.bands * self.rows].reshape(n * self.bands, self.rows)
        packed = pack_codes(per_band, self.bits).reshape(n, self.bands, self.band_bytes)
        keys = np.empty((n, self.bands, self.key_bytes), dtype=np.uint8)
        keys[:, :, :2] = self._prefix
        keys[:, :, 2:] = packed
        return keys

    def keys_from_sketches(self, sketches: np.ndarray) -> np.ndarray:
        """Packed sketches (n, sketch_bytes) → band keys; what a store calls on old records."""
        sk = np.atleast_2d(sketches)
        codes = unpack_codes(sk, self.bands * self.rows, self.bits)
        return self.keys_from_codes(codes)

    def key_list(self, keys_row: np.ndarray, bands: int | None = None) -> list[bytes]:
        """One vector's (L, key_bytes) keys → list of bytes, optionally only the first ``bands``."""
        raw = keys_row[: bands or self.bands].tobytes()
        kb = self.key_bytes
        return [raw[i : i + kb] for i in range(0, len(raw), kb)]
