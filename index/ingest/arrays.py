"""Binary arrays through numpy: .npy and .fvecs/.bvecs/.ivecs memory-mapped, .npz streamed from the zip.

No parsing of our own: numpy reads the headers, maps the rows and converts.
Errors name the file and the 0-based row.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import scipy.sparse as sp

from gmmlsh.index.ingest.base import FileReader, InputFormatError, Piece, dense_dtype


def _npy_header(f: BinaryIO) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy data starting at ``f``'s position."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    return np.lib.format.read_array_header_2_0(f)


class _MmapRowsReader(FileReader):
    """Rows at fixed byte offsets (.npy in C order, .fvecs): mapped one window at a time.

    Each window is its own ``np.memmap``, dropped once its rows are copied, so
    the pages it touched leave the resident set; one mapping of the whole file
    would keep every page read so far resident.
    """

    offset = 0
    row_bytes = 0

    def _window(self, a: int, b: int) -> np.ndarray:
        raise NotImplementedError

    def read_rows(self, a: int, b: int) -> np.ndarray:
        if not 0 <= a <= b <= (self.rows or 0):
            raise InputFormatError(self.name, f"rows {a}..{b} out of range (the file has {self.rows} rows)")
        return self._window(a, b)

    def blocks(self) -> Iterator[Piece]:
        step = self.rows_per_chunk()
        for a in range(0, self.rows or 0, step):
            b = min(a + step, self.rows or 0)
            yield Piece(a, self._window(a, b), start_byte=self.offset + a * self.row_bytes,
                        end_byte=self.offset + b * self.row_bytes)

    def sample(self, n: int):
        if not self.rows:
            return None
        pick = np.unique(np.linspace(0, self.rows - 1, num=min(n, self.rows)).astype(np.int64))
        return np.concatenate([self._window(int(i), int(i) + 1) for i in pick], axis=0)


class NpyReader(_MmapRowsReader):
    """A .npy array of rows; more than two dimensions are flattened per row (images)."""

    fmt = "npy"

    def __init__(self, path: Path, **kw):
        super().__init__(path, **kw)
        try:
            with open(path, "rb") as f:
                shape, self.fortran, self.dtype = _npy_header(f)
                self.offset = f.tell()
        except (ValueError, OSError) as exc:
            raise InputFormatError(self.name, f"not a .npy file ({exc})") from None
        if self.dtype.hasobject:
            raise InputFormatError(self.name, "holds Python objects; save a numeric array")
        if len(shape) < 2:
            raise InputFormatError(self.name, f"expected a 2-D array (rows × dimension), got shape {shape}")
        self.work_dtype = dense_dtype(self.dtype, self.name)
        self.rows = int(shape[0])
        self.dim = int(np.prod(shape[1:]))
        self.row_bytes = self.dim * self.dtype.itemsize
        need = self.offset + self.rows * self.row_bytes
        if self.size_bytes < need:
            raise InputFormatError(self.name, f"truncated: header says {shape} ({need} bytes), file has "
                                              f"{self.size_bytes} bytes")

    def _window(self, a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.zeros((0, self.dim), dtype=self.work_dtype)
        if self.fortran:  # rows are strided through the whole file: map it, copy, unmap
            mm = np.load(self.path, mmap_mode="r")
            order = "F" if mm.ndim > 2 else "C"
        else:
            mm = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset + a * self.row_bytes,
                           shape=(b - a, self.dim))
            a, b, order = 0, b - a, "C"
        try:
            return np.array(mm[a:b].reshape(b - a, -1, order=order), dtype=self.work_dtype, order="C")
        finally:
            del mm  # unmaps the window: its pages leave the resident set


class VecsReader(_MmapRowsReader):
    """.fvecs / .bvecs / .ivecs: per row a little-endian int32 dimension, then the values."""

    _VALUE = {"fvecs": "<f4", "bvecs": "u1", "ivecs": "<i4"}

    def __init__(self, path: Path, fmt: str, **kw):
        super().__init__(path, **kw)
        self.fmt = fmt
        vt = np.dtype(self._VALUE[fmt])
        if self.size_bytes < 4:
            raise InputFormatError(self.name, "empty file" if not self.size_bytes else "truncated: no row header")
        d = int(np.fromfile(path, dtype="<i4", count=1)[0])
        if d <= 0:
            raise InputFormatError(self.name, f"dimension field is {d}; not a .{fmt} file?", row=0)
        self.dim = d
        self.row_bytes = 4 + d * vt.itemsize
        if self.size_bytes % self.row_bytes:
            raise InputFormatError(self.name, f"size {self.size_bytes} is not a multiple of the row size "
                                              f"{self.row_bytes} (dimension {d}): truncated or mixed dimensions")
        self.rows = self.size_bytes // self.row_bytes
        self.rec = np.dtype([("d", "<i4"), ("v", vt, (d,))])
        self.work_dtype = np.dtype(np.float32) if fmt == "fvecs" else np.dtype(np.float64)

    def _window(self, a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.zeros((0, self.dim), dtype=self.work_dtype)
        mm = np.memmap(self.path, dtype=self.rec, mode="r", offset=a * self.row_bytes, shape=(b - a,))
        try:
            bad = np.flatnonzero(mm["d"] != self.dim)
            if bad.size:
                i = int(bad[0])
                raise InputFormatError(self.name, f"dimension field is {int(mm['d'][i])}, expected {self.dim}",
                                       row=a + i)
            return np.array(mm["v"], dtype=self.work_dtype)
        finally:
            del mm


class _NpyStream:
    """A .npy member of a zip read in order, compressed or not."""

    def __init__(self, f: BinaryIO, label: str):
        self.f = f
        self.label = label
        try:
            self.shape, self.fortran, self.dtype = _npy_header(f)
        except ValueError as exc:
            raise InputFormatError(label, f"not a .npy array ({exc})") from None
        if self.dtype.hasobject:
            raise InputFormatError(label, "holds Python objects; save a numeric array")
        self.per_row = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        self.done = 0

    def read(self, count: int) -> np.ndarray:
        """The next ``count`` leading-axis entries, flat per row."""
        nbytes = count * self.per_row * self.dtype.itemsize
        raw = self.f.read(nbytes)
        if len(raw) != nbytes:
            raise InputFormatError(self.label, f"truncated after {self.done} rows")
        self.done += count
        out = np.frombuffer(raw, dtype=self.dtype)
        return out.reshape(count, self.per_row) if len(self.shape) > 1 else out


class NpzReader(FileReader):
    """A dense member (``key``, default the first), or a scipy ``save_npz`` CSR matrix; ``label_key``: labels."""

    fmt = "npz"

    def __init__(self, path: Path, *, key: str | None = None, label_key: str | None = None, **kw):
        super().__init__(path, **kw)
        try:
            with zipfile.ZipFile(path) as zf:
                names = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
                self.csr = key is None and {"data", "indices", "indptr", "shape", "format"} <= set(names)
                if self.csr:
                    fmt, shape = (np.lib.format.read_array(zf.open(n + ".npy")) for n in ("format", "shape"))
        except (zipfile.BadZipFile, OSError) as exc:
            raise InputFormatError(self.name, f"not a .npz archive ({exc})") from None
        if not names:
            raise InputFormatError(self.name, "holds no arrays")
        self.label_key = label_key
        for k in (key, label_key):
            if k is not None and k not in names:
                raise InputFormatError(self.name, f"no array {k!r} (has: {', '.join(names)})")
        if self.csr:
            fmt = fmt.item().decode() if isinstance(fmt.item(), bytes) else str(fmt.item())
            if fmt != "csr":
                raise InputFormatError(self.name, f"sparse matrix in {fmt!r} format; only CSR streams "
                                                  "(save X.tocsr() with scipy.sparse.save_npz)")
            self.rows, self.dim = int(shape[0]), int(shape[1])
            self.sparse = True
            return
        self.key = key if key is not None else names[0]
        with zipfile.ZipFile(path) as zf, zf.open(self.key + ".npy") as f:
            s = _NpyStream(f, f"{self.name}[{self.key}]")
        if len(s.shape) < 2:
            raise InputFormatError(self.name, f"array {self.key!r} has shape {s.shape}; expected 2-D")
        if s.fortran and s.shape[0] > 1:
            raise InputFormatError(self.name, f"array {self.key!r} is Fortran-ordered and cannot be "
                                              "streamed by rows; save np.ascontiguousarray(X) or use .npy")
        self.rows, self.dim = int(s.shape[0]), s.per_row
        self.work_dtype = dense_dtype(s.dtype, self.name)

    def blocks(self) -> Iterator[Piece]:
        step = self.rows_per_chunk()
        with zipfile.ZipFile(self.path) as zf:
            labels = None
            if self.label_key is not None:
                labels = _NpyStream(zf.open(self.label_key + ".npy"), f"{self.name}[{self.label_key}]")
                if labels.shape[0] != self.rows:
                    raise InputFormatError(self.name, f"labels {self.label_key!r} have {labels.shape[0]} "
                                                      f"entries for {self.rows} rows")
            rows = self._dense(zf, step) if not self.csr else self._csr(zf, step)
            for a, X in zip(range(0, self.rows, step), rows, strict=False):
                b = a + X.shape[0]
                meta = None if labels is None else [{"label": v} for v in labels.read(b - a).tolist()]
                yield Piece(a, X, meta, start_byte=self.size_bytes * a // self.rows,
                            end_byte=self.size_bytes * b // self.rows)

    def _dense(self, zf: zipfile.ZipFile, step: int) -> Iterator[np.ndarray]:
        with zf.open(self.key + ".npy") as f:
            s = _NpyStream(f, f"{self.name}[{self.key}]")
            for a in range(0, self.rows, step):
                yield np.array(s.read(min(step, self.rows - a)), dtype=self.work_dtype)

    def _csr(self, zf: zipfile.ZipFile, step: int) -> Iterator[sp.csr_matrix]:
        with zf.open("indptr.npy") as fp, zf.open("indices.npy") as fi, zf.open("data.npy") as fd:
            ptrs, si, sd = (_NpyStream(f, f"{self.name}[{n}]") for f, n in
                            ((fp, "indptr"), (fi, "indices"), (fd, "data")))
            vdt = dense_dtype(sd.dtype, self.name)
            prev = int(ptrs.read(1)[0])
            for a in range(0, self.rows, step):
                ptr = np.concatenate([[prev], ptrs.read(min(step, self.rows - a))]).astype(np.int64)
                nnz = int(ptr[-1] - ptr[0])
                X = sp.csr_matrix((np.array(sd.read(nnz), dtype=vdt), si.read(nnz).astype(np.int64), ptr - ptr[0]),
                                  shape=(len(ptr) - 1, self.dim))
                X.sort_indices()
                prev = int(ptr[-1])
                yield X
