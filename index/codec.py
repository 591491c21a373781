"""How one vector is stored as bytes: its L1 norm first, then the values.

Dense: ``<f8 norm`` + ``<f4 × dim``. Sparse: ``<f8 norm`` + ``<u4 nnz`` +
``<u4 × nnz`` indices + ``<f4 × nnz`` values. The norm is of the (centred)
vector GMM is computed on, so a rerank never recomputes it.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def dense_dtype(dim: int) -> np.dtype:
    return np.dtype([("norm", "<f8"), ("values", "<f4", (dim,))])


def encode_dense(X32: np.ndarray, norms: np.ndarray) -> list[bytes]:
    """Rows of a float32 (n, dim) array → one blob each."""
    rec = np.empty(X32.shape[0], dtype=dense_dtype(X32.shape[1]))
    rec["norm"] = norms
    rec["values"] = X32
    raw = rec.tobytes()
    size = rec.dtype.itemsize
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def decode_dense(blobs: list[bytes], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Blobs → (float32 (n, dim) values, float64 norms); zero-copy views of one buffer."""
    rec = np.frombuffer(b"".join(blobs), dtype=dense_dtype(dim))
    return rec["values"], rec["norm"]


def encode_sparse(X: sp.csr_matrix, norms: np.ndarray) -> list[bytes]:
    """Rows of a CSR matrix (float32 values) → one blob each."""
    out = []
    for v in range(X.shape[0]):
        lo, hi = X.indptr[v], X.indptr[v + 1]
        head = np.array([norms[v]], "<f8").tobytes() + np.array([hi - lo], "<u4").tobytes()
        out.append(head + X.indices[lo:hi].astype("<u4").tobytes() + X.data[lo:hi].astype("<f4").tobytes())
    return out


def decode_sparse(blobs: list[bytes], dim: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """Blobs → (CSR float32 rows, float64 norms)."""
    norms = np.empty(len(blobs))
    indptr = np.zeros(len(blobs) + 1, dtype=np.int64)
    idx_parts, val_parts = [], []
    for v, blob in enumerate(blobs):
        norms[v] = np.frombuffer(blob, "<f8", 1)[0]
        nnz = int(np.frombuffer(blob, "<u4", 1, 8)[0])
        idx_parts.append(np.frombuffer(blob, "<u4", nnz, 12))
        val_parts.append(np.frombuffer(blob, "<f4", nnz, 12 + 4 * nnz))
        indptr[v + 1] = indptr[v] + nnz
    indices = np.concatenate(idx_parts).astype(np.int32) if idx_parts else np.zeros(0, np.int32)
    data = np.concatenate(val_parts) if val_parts else np.zeros(0, np.float32)
    return sp.csr_matrix((data, indices, indptr), shape=(len(blobs), dim)), norms
