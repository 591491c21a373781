"""File readers: turn input files into bounded chunks of rows for the batch build.

One job: ``open_reader(paths, ...)`` gives a :class:`Reader` whose iteration
yields :class:`Chunk` objects (``start_row``, ``ids``, ``X``, ``metadata``). The
build never sees a whole file, so memory stays bounded whatever its size.

Formats (by extension, ``fmt=`` overrides; a ``.gz`` suffix is read through gzip
for the text formats):

* ``.npy`` — memory-mapped one window of rows at a time (a window is unmapped
  before the next, so resident memory does not grow with the file).
  Arrays of more than two dimensions are flattened per row (images).
* ``.npz`` — one member, streamed through the zip (compressed or not); the
  ``key`` option picks it (default: the first array). A CSR matrix written by
  ``scipy.sparse.save_npz`` is streamed too. ``label_key`` names an array of
  per-row labels kept as metadata.
* ``.csv`` / ``.tsv`` — numeric rows; a header is detected (or forced with
  ``header=``); ``id_column`` / ``label_column`` (name or 0-based position)
  supply ids and ``{"label": ...}`` metadata.
* LIBSVM / svmlight (``.svm``, ``.svmlight``, ``.libsvm``) —
  ``label [qid:N] index:value ... [# comment]``, sparse. Indices are 1-based by
  default (``zero_based=True`` or ``"auto"`` to change it); the label (and qid)
  become metadata.
* ``.fvecs`` / ``.bvecs`` / ``.ivecs`` — per row a little-endian int32 dimension
  then the values (float32 / uint8 / int32), memory-mapped like ``.npy``.

The text formats are parsed by numba kernels that handle well-formed lines
(exactly: a decimal is converted with one correctly rounded IEEE operation, or
handed over); any line they do not accept is re-read by a plain Python parser,
which is the authority: it either parses the line the same way or raises an
:class:`InputFormatError` naming the file, the line and the problem.

Ids are the global row numbers (``"0"``, ``"1"``, ... continuing across several
input files), an id column, or one id per line of an ``ids_file``.
"""

from __future__ import annotations

import csv
import gzip
import math
import os
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import scipy.sparse as sp
from numba import njit

#: Rows per chunk are chosen so that a chunk holds about this many values
#: (16 MiB as float64), within [_MIN_ROWS, _MAX_ROWS]. The index makes a few
#: working copies of a chunk while hashing it, so this sets most of the build's
#: memory beyond the libraries (~160 MB) and the store's mapped pages.
CHUNK_VALUES = 2 << 20
_MIN_ROWS = 64
_MAX_ROWS = 8192
#: Bytes of text parsed per block (a chunk never spans two blocks).
BLOCK_BYTES = 8 << 20
#: Most values per block whose conversion the kernels hand to Python; past it a
#: row goes to the (slower, still exact) per-line Python parser.
DEFER_CAP = 1 << 20

FORMATS = ("npy", "npz", "csv", "tsv", "svmlight", "fvecs", "bvecs", "ivecs")
_ALIASES = {"libsvm": "svmlight", "svm": "svmlight", "svmlight": "svmlight", "txt": None}
_EXT = {
    ".npy": "npy", ".npz": "npz", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
    ".svm": "svmlight", ".svmlight": "svmlight", ".libsvm": "svmlight", ".libsvm.txt": "svmlight",
    ".fvecs": "fvecs", ".bvecs": "bvecs", ".ivecs": "ivecs",
}


class InputFormatError(ValueError):
    """Malformed input. The message names the file, the line or row, and the problem.

    ``data.svm:17: index 'x3' is not an integer`` (text formats: 1-based line) or
    ``data.npy: row 17: ...`` (binary formats: 0-based row, as in row-number ids).
    """

    def __init__(self, path: str | os.PathLike | None, problem: str, *, line: int | None = None,
                 row: int | None = None):
        self.path = str(path) if path is not None else None
        self.line = line
        self.row = row
        self.problem = problem
        where = self.path or "input"
        if line is not None:
            where = f"{where}:{line}"
        elif row is not None:
            where = f"{where}: row {row}"
        super().__init__(f"{where}: {problem}")


@dataclass
class Chunk:
    """Consecutive rows of the input, ready for ``Index.upsert``.

    ``start_row`` is the global row number of the first row (row numbers run on
    across input files). ``lines`` (text formats) holds each row's 1-based line
    in ``source``; ``file_row`` is the first row's number within ``source``.
    ``end_byte`` is how far into the input (all files together) this chunk ends,
    for progress estimates when the row count is unknown.
    """

    start_row: int
    ids: list[str]
    X: np.ndarray | sp.csr_matrix
    metadata: list[dict | None] | None = None
    source: str = ""
    file_row: int = 0
    lines: np.ndarray | None = None
    end_byte: int = 0

    def __len__(self) -> int:
        return self.X.shape[0]

    def where(self, i: int) -> tuple[int | None, int | None]:
        """(line, row) of chunk row ``i`` for an error message: line for text, row otherwise."""
        if self.lines is not None:
            return int(self.lines[i]), None
        return None, self.file_row + i

    def error(self, i: int, problem: str) -> InputFormatError:
        line, row = self.where(i)
        return InputFormatError(self.source, problem, line=line, row=row)


# ============================================================================
# numba kernels for the text formats
# ============================================================================

_P10 = np.array([10.0 ** i for i in range(23)])  # exact doubles 1e0 .. 1e22


def _pow5_table() -> tuple[np.ndarray, np.ndarray]:
    """128-bit approximations of 5^q, q in [-342, 308], normalised to a set top bit (Eisel-Lemire).

    q ≥ 0: 5^q truncated; q < 0: 2^b / 5^-q rounded up, as in Lemire, "Number
    Parsing at a Gigabyte per Second" (2021). Built with exact integers at import.
    """
    hi, lo = [], []
    for q in range(-342, 309):
        if q < 0:
            p = 5 ** -q
            z = (p - 1).bit_length()  # smallest z with 2^z >= p
            if q >= -27:
                c = (1 << (z + 127)) // p + 1
            else:
                c = (1 << (2 * z + 128)) // p + 1
                while c >= 1 << 128:
                    c >>= 1
        else:
            c = 5 ** q
            while c < 1 << 127:
                c <<= 1
            while c >= 1 << 128:
                c >>= 1
        hi.append(c >> 64)
        lo.append(c & ((1 << 64) - 1))
    return np.array(hi, dtype=np.uint64), np.array(lo, dtype=np.uint64)


_POW5_HI, _POW5_LO = _pow5_table()
_U32 = np.uint64(0xFFFFFFFF)
_U64MAX = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(nogil=True, cache=True)
def _is_ws(c) -> bool:
    return c == 32 or c == 9 or c == 13


@njit(nogil=True, cache=True)
def _mul128(a, b):
    """Full 64×64 → 128-bit product of two uint64, as (low, high)."""
    a_lo = a & _U32
    a_hi = a >> np.uint64(32)
    b_lo = b & _U32
    b_hi = b >> np.uint64(32)
    p0 = a_lo * b_lo
    p1 = a_lo * b_hi
    p2 = a_hi * b_lo
    p3 = a_hi * b_hi
    mid = (p0 >> np.uint64(32)) + (p1 & _U32) + (p2 & _U32)
    low = (p0 & _U32) | (mid << np.uint64(32))
    high = p3 + (p1 >> np.uint64(32)) + (p2 >> np.uint64(32)) + (mid >> np.uint64(32))
    return low, high


@njit(nogil=True, cache=True)
def _clz(w):
    n = 0
    if (w >> np.uint64(32)) == 0:
        n += 32
        w = w << np.uint64(32)
    if (w >> np.uint64(48)) == 0:
        n += 16
        w = w << np.uint64(16)
    if (w >> np.uint64(56)) == 0:
        n += 8
        w = w << np.uint64(8)
    if (w >> np.uint64(60)) == 0:
        n += 4
        w = w << np.uint64(4)
    if (w >> np.uint64(62)) == 0:
        n += 2
        w = w << np.uint64(2)
    if (w >> np.uint64(63)) == 0:
        n += 1
    return n


@njit(nogil=True, cache=True)
def _eisel_lemire(q, w):
    """w·10^q (w a nonzero uint64) correctly rounded to a double: (value, ok).

    ok=False where 128 bits cannot decide the rounding (rare; Python decides).
    """
    if q < -342:
        return 0.0, True
    if q > 308:
        return np.inf, True
    lz = _clz(w)
    w = w << np.uint64(lz)
    idx = q + 342
    low, high = _mul128(w, _POW5_HI[idx])
    if (high & np.uint64(0x1FF)) == np.uint64(0x1FF):
        _, high2 = _mul128(w, _POW5_LO[idx])
        low = low + high2
        if high2 > low:
            high = high + np.uint64(1)
    if low == _U64MAX and (q < -27 or q > 55):
        return 0.0, False
    upper = np.int64(high >> np.uint64(63))
    shift = np.uint64(upper + 9)
    mantissa = high >> shift
    power2 = ((q * (152170 + 65536)) >> 16) + 63 + upper - lz + 1023
    if power2 <= 0:
        if -power2 + 1 >= 64:
            return 0.0, True
        mantissa = mantissa >> np.uint64(-power2 + 1)
        mantissa = mantissa + (mantissa & np.uint64(1))
        mantissa = mantissa >> np.uint64(1)
        return math.ldexp(float(mantissa), -1074), True
    if (low <= np.uint64(1) and q >= -4 and q <= 23 and (mantissa & np.uint64(3)) == np.uint64(1)
            and (mantissa << shift) == high):
        mantissa = mantissa & ~np.uint64(1)
    mantissa = mantissa + (mantissa & np.uint64(1))
    mantissa = mantissa >> np.uint64(1)
    if mantissa >= (np.uint64(2) << np.uint64(52)):
        mantissa = np.uint64(1) << np.uint64(52)
        power2 += 1
    if power2 >= 0x7FF:
        return np.inf, True
    return math.ldexp(float(mantissa), power2 - 1075), True


@njit(nogil=True, cache=True)
def _parse_float(buf, s, e, p10):
    """Parse ``buf[s:e]`` as a decimal number. Returns (value, ok).

    Exact or nothing. Up to 19 significant digits: Clinger's fast path (one
    correctly rounded IEEE operation on exact operands) or else Eisel-Lemire
    with 128-bit powers of five; more digits: Eisel-Lemire on the truncated
    and the rounded-up significand, accepted when both agree. The result then
    equals Python's ``float()``. Anything else (``nan``, an undecidable
    rounding, garbage) returns ok=False and is left to Python.
    """
    if s >= e:
        return 0.0, False
    neg = False
    c = buf[s]
    if c == 45:
        neg = True
        s += 1
    elif c == 43:
        s += 1
    m = np.uint64(0)
    nd = 0
    exp10 = 0
    digits = 0
    truncated = False
    while s < e:
        d = np.int64(buf[s]) - 48
        if d < 0 or d > 9:
            break
        digits += 1
        if m == 0 and d == 0:
            pass
        elif nd < 19:
            m = m * np.uint64(10) + np.uint64(d)
            nd += 1
        else:
            exp10 += 1
            if d != 0:
                truncated = True
        s += 1
    if s < e and buf[s] == 46:
        s += 1
        while s < e:
            d = np.int64(buf[s]) - 48
            if d < 0 or d > 9:
                break
            digits += 1
            if m == 0 and d == 0:
                exp10 -= 1
            elif nd < 19:
                m = m * np.uint64(10) + np.uint64(d)
                nd += 1
                exp10 -= 1
            elif d != 0:
                truncated = True
            s += 1
    if digits == 0:
        return 0.0, False
    if s < e and (buf[s] == 101 or buf[s] == 69):
        s += 1
        eneg = False
        if s < e and (buf[s] == 45 or buf[s] == 43):
            eneg = buf[s] == 45
            s += 1
        ed = 0
        ev = 0
        while s < e:
            d = np.int64(buf[s]) - 48
            if d < 0 or d > 9:
                break
            if ev < 100000:
                ev = ev * 10 + d
            ed += 1
            s += 1
        if ed == 0:
            return 0.0, False
        exp10 += -ev if eneg else ev
    if s != e:
        return 0.0, False
    if m == 0:
        return (-0.0 if neg else 0.0), True
    if not truncated and m <= np.uint64(9007199254740992) and -22 <= exp10 <= 22:
        v = float(m)
        if exp10 >= 0:
            v = v * p10[exp10]
        else:
            v = v / p10[-exp10]
        return (-v if neg else v), True
    v, ok = _eisel_lemire(exp10, m)
    if ok and truncated:
        v2, ok2 = _eisel_lemire(exp10, m + np.uint64(1))
        ok = ok2 and v2 == v
    if not ok:
        return 0.0, False
    return (-v if neg else v), True


@njit(nogil=True, cache=True)
def _svm_kernel(buf, p10, row_line, row_start, row_end, lab_s, lab_e, qid_s, qid_e, slow,
                indptr, indices, data, dpos, dsta, dend):
    """Parse svmlight lines of ``buf``; returns (rows, lines, deferred).

    Per row: its line (0-based in buf), byte span, label/qid spans (-1: none),
    and ``slow`` when the kernel did not accept it (the row then has no entries
    here; Python re-reads it). Accepted rows have strictly increasing indices.
    A value the exact fast path declines is *deferred*: ``data[dpos[t]]`` is to
    be converted by Python from ``buf[dsta[t]:dend[t]]``.
    """
    n = buf.shape[0]
    dcap = dpos.shape[0]
    nd = 0
    pos = 0
    line = 0
    r = 0
    k = 0
    indptr[0] = 0
    while pos < n:
        le = pos
        while le < n and buf[le] != 10:
            le += 1
        ce = pos
        while ce < le and buf[ce] != 35:
            ce += 1
        p = pos
        while p < ce and _is_ws(buf[p]):
            p += 1
        if p == ce:
            line += 1
            pos = le + 1
            continue
        row_line[r] = line
        row_start[r] = pos
        row_end[r] = le
        lab_s[r] = -1
        lab_e[r] = -1
        qid_s[r] = -1
        qid_e[r] = -1
        bad = False
        first = True
        last = -1
        k0 = k
        nd0 = nd
        while p < ce:
            ts = p
            while p < ce and not _is_ws(buf[p]):
                p += 1
            te = p
            while p < ce and _is_ws(buf[p]):
                p += 1
            cpos = -1
            for q in range(ts, te):
                if buf[q] == 58:
                    cpos = q
                    break
            if first:
                first = False
                if cpos < 0:
                    lab_s[r] = ts
                    lab_e[r] = te
                    continue
            if cpos < 0:
                bad = True
                break
            if cpos - ts == 3 and buf[ts] == 113 and buf[ts + 1] == 105 and buf[ts + 2] == 100:
                if qid_s[r] >= 0:
                    bad = True
                    break
                qid_s[r] = cpos + 1
                qid_e[r] = te
                continue
            if cpos == ts or cpos - ts > 18:
                bad = True
                break
            idx = 0
            for q in range(ts, cpos):
                d = np.int64(buf[q]) - 48
                if d < 0 or d > 9:
                    bad = True
                    break
                idx = idx * 10 + d
            if bad:
                break
            if idx <= last:
                bad = True
                break
            v, ok = _parse_float(buf, cpos + 1, te, p10)
            if not ok:
                if nd >= dcap or te == cpos + 1:
                    bad = True
                    break
                dpos[nd] = k
                dsta[nd] = cpos + 1
                dend[nd] = te
                nd += 1
                v = np.nan
            indices[k] = idx
            data[k] = v
            k += 1
            last = idx
        if bad:
            k = k0
            nd = nd0
        slow[r] = bad
        indptr[r + 1] = k
        r += 1
        line += 1
        pos = le + 1
    return r, line, nd


@njit(nogil=True, cache=True)
def _csv_kernel(buf, p10, delim, colmap, out, row_line, row_start, row_end, id_s, id_e, lab_s, lab_e, slow,
                dpos, dsta, dend):
    """Parse delimited numeric lines of ``buf`` into ``out``; returns (rows, lines).

    ``colmap[c]``: the output column of field ``c``, -1 for the id column, -2
    for the label column. Blank lines and lines starting with ``#`` are skipped.
    A field may be wrapped in one pair of double quotes; any other quote, a
    wrong field count marks the row slow. A value the exact fast path declines
    is deferred to Python (``out.flat[dpos[t]]`` from ``buf[dsta[t]:dend[t]]``).
    Returns (rows, lines, deferred).
    """
    n = buf.shape[0]
    ncols = colmap.shape[0]
    dim = out.shape[1]
    dcap = dpos.shape[0]
    nd = 0
    pos = 0
    line = 0
    r = 0
    while pos < n:
        le = pos
        while le < n and buf[le] != 10:
            le += 1
        p = pos
        while p < le and _is_ws(buf[p]):
            p += 1
        if p == le or buf[p] == 35:
            line += 1
            pos = le + 1
            continue
        row_line[r] = line
        row_start[r] = pos
        row_end[r] = le
        id_s[r] = -1
        id_e[r] = -1
        lab_s[r] = -1
        lab_e[r] = -1
        bad = False
        nd0 = nd
        f = 0
        fs = pos
        while True:
            fe = fs
            while fe < le and buf[fe] != delim:
                fe += 1
            if f >= ncols:
                bad = True
                break
            s = fs
            e = fe
            while s < e and _is_ws(buf[s]):
                s += 1
            while e > s and _is_ws(buf[e - 1]):
                e -= 1
            if e - s >= 2 and buf[s] == 34 and buf[e - 1] == 34:
                s += 1
                e -= 1
            for q in range(s, e):
                if buf[q] == 34:
                    bad = True
            if bad:
                break
            role = colmap[f]
            if role >= 0:
                v, ok = _parse_float(buf, s, e, p10)
                if not ok:
                    if nd >= dcap or e == s:
                        bad = True
                        break
                    dpos[nd] = r * dim + role
                    dsta[nd] = s
                    dend[nd] = e
                    nd += 1
                out[r, role] = v
            elif role == -1:
                id_s[r] = s
                id_e[r] = e
            else:
                lab_s[r] = s
                lab_e[r] = e
            f += 1
            if fe >= le:
                break
            fs = fe + 1
        if f != ncols:
            bad = True
        if bad:
            nd = nd0
        slow[r] = bad
        r += 1
        line += 1
        pos = le + 1
    return r, line, nd


# ============================================================================
# helpers
# ============================================================================


def _decode_label(raw: bytes, cache: dict) -> object:
    """A label as metadata: int when integral, else float, a list for ``1,3``, else text."""
    got = cache.get(raw)
    if got is not None or raw in cache:
        return got
    text = raw.decode("utf-8", errors="replace").strip()
    val: object
    if "," in text:
        val = [_scalar(t) for t in text.split(",") if t.strip()]
    else:
        val = _scalar(text)
    if len(cache) < 100_000:
        cache[raw] = val
    return val


def _scalar(text: str) -> object:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        f = float(text)
    except ValueError:
        return text
    if math.isfinite(f) and f == int(f) and "." not in text and "e" not in text.lower():
        return int(f)
    return f


def _convert_deferred(name: str, block: bytes, target: np.ndarray, dpos: np.ndarray, dsta: np.ndarray,
                      dend: np.ndarray, where: Callable[[int], tuple[int, str]]) -> None:
    """Convert the values the kernel deferred with Python's ``float`` (the authority).

    ``where(position)`` gives the line and a message template with ``{tok}``.
    """
    try:
        vals = [float(block[a:b]) for a, b in zip(dsta.tolist(), dend.tolist(), strict=True)]
    except ValueError:
        for t, (a, b) in enumerate(zip(dsta.tolist(), dend.tolist(), strict=True)):
            try:
                float(block[a:b])
            except ValueError:
                line, template = where(int(dpos[t]))
                tok = block[a:b].decode("utf-8", errors="replace")
                raise InputFormatError(name, template.format(tok=repr(tok)), line=line) from None
        raise
    target[dpos] = vals


def _dense_dtype(dtype: np.dtype, path: str) -> np.dtype:
    """Working dtype of a binary array: float32 stays, other numbers become float64 (exact)."""
    if dtype.kind == "f":
        return np.dtype(np.float32) if dtype.itemsize <= 4 and dtype.itemsize != 2 else np.dtype(np.float64)
    if dtype.kind in "biu":
        return np.dtype(np.float64)
    raise InputFormatError(path, f"array of dtype {dtype} is not numeric")


def auto_chunk_rows(dim: int | None) -> int:
    """Rows per chunk so that one chunk holds about :data:`CHUNK_VALUES` values."""
    if not dim:
        return 4096
    return int(min(_MAX_ROWS, max(_MIN_ROWS, CHUNK_VALUES // max(dim, 1))))


def _open_text(path: Path) -> tuple[BinaryIO, BinaryIO]:
    """(reader, raw file): the raw file's position measures progress through a .gz too."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def _read_block(f: BinaryIO, size: int) -> bytes:
    """About ``size`` bytes ending at a line end (or at end of file)."""
    block = f.read(size)
    if block and not block.endswith(b"\n"):
        block += f.readline()
    return block


@dataclass
class _Block:
    """What a file reader produces: rows of one file (no ids from the ids file yet)."""

    file_row: int
    X: np.ndarray | sp.csr_matrix
    metadata: list[dict | None] | None
    col_ids: list[str] | None
    lines: np.ndarray | None
    end_byte: int


# ============================================================================
# file readers
# ============================================================================


class _FileReader:
    """One input file. Subclasses set dim/rows/sparse and implement ``blocks``."""

    fmt = ""
    sparse = False

    def __init__(self, path: Path, *, chunk_rows: int | None = None):
        self.path = path
        self.name = str(path)
        self.dim: int | None = None
        self.rows: int | None = None
        self.chunk_rows = chunk_rows
        try:
            self.size_bytes = path.stat().st_size
        except OSError as exc:
            raise InputFormatError(self.name, f"cannot read: {exc.strerror or exc}") from None
        if path.is_dir():
            raise InputFormatError(self.name, "is a directory, not a file")

    @property
    def has_col_ids(self) -> bool:
        return False

    def rows_per_chunk(self) -> int:
        return self.chunk_rows or auto_chunk_rows(self.dim)

    def blocks(self) -> Iterator[_Block]:
        raise NotImplementedError

    def sample(self, n: int):
        """Up to ``n`` rows for the planner: evenly spread where rows are addressable."""
        parts, got = [], 0
        for b in self.blocks():
            parts.append(b.X[: n - got])
            got += parts[-1].shape[0]
            if got >= n:
                break
        return _stack(parts)

    def scan(self) -> None:
        """Learn what a streaming reader cannot know up front (svmlight: dimension)."""


def _stack(parts):
    if not parts:
        return None
    if sp.issparse(parts[0]):
        return sp.vstack(parts, format="csr")
    return np.concatenate(parts, axis=0)


class _MmapRowsReader(_FileReader):
    """Rows at fixed byte offsets (.npy C-order, .fvecs): mapped one window at a time.

    Each window is its own ``np.memmap`` and is dropped after its rows are
    copied, so the pages it touched leave the process's resident set; a single
    mapping of the whole file would keep every page read so far resident.
    """

    offset = 0
    row_bytes = 0

    def _window(self, a: int, b: int) -> np.ndarray:
        raise NotImplementedError

    def read_rows(self, a: int, b: int) -> np.ndarray:
        if not 0 <= a <= b <= (self.rows or 0):
            raise InputFormatError(self.name, f"rows {a}..{b} out of range (the file has {self.rows} rows)")
        return self._window(a, b)

    def blocks(self) -> Iterator[_Block]:
        step = self.rows_per_chunk()
        for a in range(0, self.rows or 0, step):
            b = min(a + step, self.rows or 0)
            X = self._window(a, b)
            yield _Block(a, X, None, None, None, self.offset + b * self.row_bytes)

    def sample(self, n: int):
        if not self.rows:
            return None
        pick = np.unique(np.linspace(0, self.rows - 1, num=min(n, self.rows)).astype(np.int64))
        return np.concatenate([self._window(int(i), int(i) + 1) for i in pick], axis=0)


class NpyReader(_MmapRowsReader):
    fmt = "npy"

    def __init__(self, path: Path, **kw):
        super().__init__(path, **kw)
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                self.offset = f.tell()
        except (ValueError, OSError) as exc:
            raise InputFormatError(self.name, f"not a .npy file ({exc})") from None
        if dtype.hasobject:
            raise InputFormatError(self.name, "holds Python objects; save a numeric array")
        if len(shape) < 2:
            raise InputFormatError(self.name, f"expected a 2-D array (rows × dimension), got shape {shape}")
        self.shape = shape
        self.fortran = fortran
        self.dtype = dtype
        self.work_dtype = _dense_dtype(dtype, self.name)
        self.rows = int(shape[0])
        self.dim = int(np.prod(shape[1:]))
        self.row_bytes = self.dim * dtype.itemsize
        need = self.offset + self.rows * self.row_bytes
        if self.size_bytes < need:
            raise InputFormatError(self.name, f"truncated: header says {shape} ({need} bytes), file has "
                                              f"{self.size_bytes} bytes")

    def _window(self, a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.zeros((0, self.dim), dtype=self.work_dtype)
        if self.fortran:
            # Rows are strided through the whole file: map it, copy, unmap.
            mm = np.load(self.path, mmap_mode="r")
            try:
                return np.array(mm[a:b].reshape(b - a, -1, order="F" if mm.ndim > 2 else "C"),
                                dtype=self.work_dtype, order="C")
            finally:
                del mm
        mm = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset + a * self.row_bytes,
                       shape=(b - a, self.dim))
        try:
            return np.array(mm, dtype=self.work_dtype)
        finally:
            del mm  # unmaps the window: its pages leave the resident set


class VecsReader(_MmapRowsReader):
    """.fvecs / .bvecs / .ivecs: ``<i4 dim`` then ``dim`` values, per row."""

    _VALUE = {"fvecs": "<f4", "bvecs": "u1", "ivecs": "<i4"}

    def __init__(self, path: Path, fmt: str, **kw):
        super().__init__(path, **kw)
        self.fmt = fmt
        vt = np.dtype(self._VALUE[fmt])
        if self.size_bytes == 0:
            raise InputFormatError(self.name, "empty file")
        if self.size_bytes < 4:
            raise InputFormatError(self.name, "truncated: shorter than one row header")
        d = int(np.fromfile(path, dtype="<i4", count=1)[0])
        if d <= 0:
            raise InputFormatError(self.name, f"row 0: dimension field is {d}; not a .{fmt} file?", )
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
            dims = np.array(mm["d"])
            bad = np.flatnonzero(dims != self.dim)
            if bad.size:
                i = int(bad[0])
                raise InputFormatError(self.name, f"dimension field is {int(dims[i])}, expected {self.dim}",
                                       row=a + i)
            return np.array(mm["v"], dtype=self.work_dtype)
        finally:
            del mm


class _NpyStream:
    """A .npy member of a zip read sequentially (works for compressed members too)."""

    def __init__(self, f: BinaryIO, label: str):
        self.f = f
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                self.shape, self.fortran, self.dtype = np.lib.format.read_array_header_1_0(f)
            else:
                self.shape, self.fortran, self.dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as exc:
            raise InputFormatError(label, f"not a .npy array ({exc})") from None
        if self.dtype.hasobject:
            raise InputFormatError(label, "holds Python objects; save a numeric array")
        self.label = label
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


class NpzReader(_FileReader):
    """A dense member, or a scipy ``save_npz`` CSR matrix, streamed from the archive."""

    fmt = "npz"

    def __init__(self, path: Path, *, key: str | None = None, label_key: str | None = None, **kw):
        super().__init__(path, **kw)
        try:
            with zipfile.ZipFile(path) as zf:
                names = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
        except (zipfile.BadZipFile, OSError) as exc:
            raise InputFormatError(self.name, f"not a .npz archive ({exc})") from None
        if not names:
            raise InputFormatError(self.name, "holds no arrays")
        self.names = names
        self.csr = key is None and {"data", "indices", "indptr", "shape", "format"} <= set(names)
        self.label_key = label_key
        if label_key is not None and label_key not in names:
            raise InputFormatError(self.name, f"no array {label_key!r} (has: {', '.join(names)})")
        if self.csr:
            with zipfile.ZipFile(path) as zf:
                fmt = self._small(zf, "format")
                shape = self._small(zf, "shape")
            fmt = fmt.item().decode() if isinstance(fmt.item(), bytes) else str(fmt.item())
            if fmt != "csr":
                raise InputFormatError(self.name, f"sparse matrix in {fmt!r} format; only CSR streams "
                                                  "(save X.tocsr() with scipy.sparse.save_npz)")
            self.rows, self.dim = int(shape[0]), int(shape[1])
            self.sparse = True
            self.key = None
        else:
            self.key = key if key is not None else names[0]
            if self.key not in names:
                raise InputFormatError(self.name, f"no array {self.key!r} (has: {', '.join(names)})")
            with zipfile.ZipFile(path) as zf, zf.open(self.key + ".npy") as f:
                s = _NpyStream(f, f"{self.name}[{self.key}]")
            if len(s.shape) < 2:
                raise InputFormatError(self.name, f"array {self.key!r} has shape {s.shape}; expected 2-D")
            if s.fortran and len(s.shape) > 1 and s.shape[0] > 1:
                raise InputFormatError(self.name, f"array {self.key!r} is Fortran-ordered and cannot be "
                                                  "streamed by rows; save np.ascontiguousarray(X) or use .npy")
            self.rows, self.dim = int(s.shape[0]), s.per_row
            self.work_dtype = _dense_dtype(s.dtype, self.name)

    def _small(self, zf: zipfile.ZipFile, name: str) -> np.ndarray:
        with zf.open(name + ".npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)

    def blocks(self) -> Iterator[_Block]:
        step = self.rows_per_chunk()
        with zipfile.ZipFile(self.path) as zf:
            labels = None
            if self.label_key is not None:
                labels = _NpyStream(zf.open(self.label_key + ".npy"), f"{self.name}[{self.label_key}]")
                if labels.shape[0] != self.rows:
                    raise InputFormatError(self.name, f"labels {self.label_key!r} have {labels.shape[0]} "
                                                      f"entries for {self.rows} rows")

            def meta(count: int) -> list[dict | None] | None:
                if labels is None:
                    return None
                return [{"label": v} for v in labels.read(count).tolist()]

            if not self.csr:
                with zf.open(self.key + ".npy") as f:
                    s = _NpyStream(f, f"{self.name}[{self.key}]")
                    for a in range(0, self.rows, step):
                        b = min(a + step, self.rows)
                        X = np.array(s.read(b - a), dtype=self.work_dtype)
                        yield _Block(a, X, meta(b - a), None, None, int(self.size_bytes * b / self.rows))
                return
            with zf.open("indptr.npy") as fp, zf.open("indices.npy") as fi, zf.open("data.npy") as fd:
                sp_ = _NpyStream(fp, f"{self.name}[indptr]")
                si = _NpyStream(fi, f"{self.name}[indices]")
                sd = _NpyStream(fd, f"{self.name}[data]")
                vdt = _dense_dtype(sd.dtype, self.name)
                prev = int(sp_.read(1)[0])
                for a in range(0, self.rows, step):
                    b = min(a + step, self.rows)
                    ptr = np.concatenate([[prev], sp_.read(b - a)]).astype(np.int64)
                    nnz = int(ptr[-1] - ptr[0])
                    idx = si.read(nnz).astype(np.int64)
                    val = np.array(sd.read(nnz), dtype=vdt)
                    prev = int(ptr[-1])
                    X = sp.csr_matrix((val, idx, ptr - ptr[0]), shape=(b - a, self.dim))
                    if not X.has_sorted_indices:
                        X.sort_indices()
                    yield _Block(a, X, meta(b - a), None, None, int(self.size_bytes * b / self.rows))


class _TextReader(_FileReader):
    """Shared block loop of the text formats."""

    def _blocks_from(self, f: BinaryIO, raw: BinaryIO, first_line: int, parse: Callable) -> Iterator[_Block]:
        line0 = first_line
        row = 0
        step = self.rows_per_chunk()
        start = raw.tell()
        while True:
            block = _read_block(f, BLOCK_BYTES)
            if not block:
                return
            X, meta, ids, lines, nlines = parse(block, line0)
            end = raw.tell()
            line0 += nlines
            n = X.shape[0]
            for a in range(0, n, step):
                b = min(a + step, n)
                # progress: the share of the block's bytes these rows stand for
                yield _Block(row + a, X[a:b], None if meta is None else meta[a:b],
                             None if ids is None else ids[a:b], lines[a:b], start + (end - start) * b // n)
            row += n
            start = end


class SvmlightReader(_TextReader):
    """LIBSVM / svmlight text: ``label [qid:N] index:value ... [# comment]``."""

    fmt = "svmlight"
    sparse = True

    def __init__(self, path: Path, *, dim: int | None = None, zero_based: bool | str = False, **kw):
        super().__init__(path, **kw)
        if zero_based not in (True, False, "auto"):
            raise ValueError(f"zero_based: expected True, False or 'auto', got {zero_based!r}")
        self.dim = dim
        self.zero_based = zero_based
        self._max_index: int | None = None
        self._min_index: int | None = None

    def rows_per_chunk(self) -> int:
        return self.chunk_rows or 4096

    @property
    def base(self) -> int:
        if self.zero_based == "auto":
            if self._min_index is None:
                raise RuntimeError("svmlight: zero_based='auto' needs scan() first")
            return 0 if self._min_index == 0 else 1
        return 0 if self.zero_based else 1

    def scan(self) -> None:
        """One parsing pass for the largest (and smallest) index: dimension and base."""
        lo, hi = None, None
        saved, self.dim = self.dim, None
        for blk in self._raw_blocks(check=False):
            X = blk.X
            if X.nnz:
                lo = int(X.indices.min()) if lo is None else min(lo, int(X.indices.min()))
                hi = int(X.indices.max()) if hi is None else max(hi, int(X.indices.max()))
        self._min_index, self._max_index = lo, hi
        self.dim = saved
        if hi is None:
            raise InputFormatError(self.name, "no features in the whole file; cannot tell its dimension")
        need = hi - self.base + 1
        if self.dim is None:
            self.dim = need
        elif need > self.dim:
            raise InputFormatError(self.name, f"has index {hi} but dim is {self.dim}")

    def blocks(self) -> Iterator[_Block]:
        if self.zero_based == "auto" and self._min_index is None:
            self.scan()
        if self.dim is None:
            raise InputFormatError(self.name, "dimension unknown: give dim or call scan() first")
        return self._raw_blocks(check=True)

    def _raw_blocks(self, check: bool) -> Iterator[_Block]:
        """Blocks with raw (file) indices when ``check`` is False, based and range-checked when True."""
        f, raw = _open_text(self.path)
        with f, raw:
            cache: dict = {}
            yield from self._blocks_from(f, raw, 1, lambda b, l0: self._parse(b, l0, cache, check))

    def _parse(self, block: bytes, line0: int, cache: dict, check: bool):
        buf = np.frombuffer(block, dtype=np.uint8)
        maxr = block.count(b"\n") + 1
        maxk = block.count(b":")
        row_line = np.empty(maxr, np.int64)
        row_start = np.empty(maxr, np.int64)
        row_end = np.empty(maxr, np.int64)
        lab_s = np.empty(maxr, np.int64)
        lab_e = np.empty(maxr, np.int64)
        qid_s = np.empty(maxr, np.int64)
        qid_e = np.empty(maxr, np.int64)
        slow = np.empty(maxr, np.bool_)
        indptr = np.empty(maxr + 1, np.int64)
        indices = np.empty(maxk, np.int64)
        data = np.empty(maxk, np.float64)
        dpos, dsta, dend = (np.empty(min(maxk, DEFER_CAP), np.int64) for _ in range(3))
        nr, nlines, nd = _svm_kernel(buf, _P10, row_line, row_start, row_end, lab_s, lab_e, qid_s, qid_e,
                                     slow, indptr, indices, data, dpos, dsta, dend)
        lines = row_line[:nr] + line0
        indptr = indptr[: nr + 1]
        indices = indices[: indptr[nr]]
        data = data[: indptr[nr]]
        if nd:
            def where(pos: int) -> tuple[int, str]:
                r = int(np.searchsorted(indptr, pos, "right") - 1)
                return int(lines[r]), "value {tok} of index " + str(int(indices[pos])) + " is not a number"

            _convert_deferred(self.name, block, data, dpos[:nd], dsta[:nd], dend[:nd], where)
        slow_rows = np.flatnonzero(slow[:nr])
        qids: dict[int, int] = {}
        labels: dict[int, object] = {}
        if slow_rows.size:
            indptr, indices, data = self._splice(block, slow_rows, row_start, row_end, lines, indptr,
                                                 indices, data, labels, qids, cache)
        if check:
            indices = indices - self.base
            if indices.size:
                neg = np.flatnonzero(indices < 0)
                if neg.size:
                    r = int(np.searchsorted(indptr, neg[0], "right") - 1)
                    raise InputFormatError(self.name, f"index {int(indices[neg[0]]) + self.base} is not "
                                                      "valid with 1-based indices (use zero-based indices)",
                                           line=int(lines[r]))
                over = np.flatnonzero(indices >= self.dim)
                if over.size:
                    r = int(np.searchsorted(indptr, over[0], "right") - 1)
                    raise InputFormatError(self.name, f"index {int(indices[over[0]]) + self.base} is out "
                                                      f"of range for dimension {self.dim}", line=int(lines[r]))
        dim = self.dim if check else (int(indices.max()) + 1 if indices.size else 1)
        X = sp.csr_matrix((data, indices, indptr), shape=(nr, dim))
        meta: list[dict | None] = []
        ls, le, qs, qe = lab_s[:nr].tolist(), lab_e[:nr].tolist(), qid_s[:nr].tolist(), qid_e[:nr].tolist()
        for r in range(nr):
            m: dict | None = None
            if r in labels:
                m = {"label": labels[r]}
            elif ls[r] >= 0:
                m = {"label": _decode_label(block[ls[r]:le[r]], cache)}
            if qs[r] >= 0 and r not in qids:
                tok = block[qs[r]:qe[r]]
                try:
                    q = int(tok)
                except ValueError:
                    raise InputFormatError(self.name, f"qid {tok.decode(errors='replace')!r} is not an integer",
                                           line=int(lines[r])) from None
                qids[r] = q
            if r in qids:
                m = dict(m or {})
                m["qid"] = qids[r]
            meta.append(m)
        return X, meta, None, lines, nlines

    def _splice(self, block, slow_rows, row_start, row_end, lines, indptr, indices, data, labels, qids, cache):
        """Re-read the kernel's declined rows in Python and splice them into the CSR arrays."""
        counts = np.diff(indptr)
        parts_i, parts_v = [], []
        fixed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for r in slow_rows.tolist():
            line = block[row_start[r]:row_end[r]]
            lab, qid, idx, val = self._parse_line_py(line, int(lines[r]), cache)
            fixed[r] = (idx, val)
            counts[r] = idx.size
            if lab is not _NO_LABEL:
                labels[r] = lab
            if qid is not None:
                qids[r] = qid
        new_ptr = np.zeros(indptr.size, np.int64)
        np.cumsum(counts, out=new_ptr[1:])
        prev = 0
        for r in sorted(fixed):
            parts_i.append(indices[indptr[prev]:indptr[r]])
            parts_v.append(data[indptr[prev]:indptr[r]])
            parts_i.append(fixed[r][0])
            parts_v.append(fixed[r][1])
            prev = r + 1
        parts_i.append(indices[indptr[prev]:indptr[-1]])
        parts_v.append(data[indptr[prev]:indptr[-1]])
        return new_ptr, np.concatenate(parts_i).astype(np.int64), np.concatenate(parts_v).astype(np.float64)

    def _parse_line_py(self, line: bytes, lineno: int, cache: dict):
        """The reference parser of one line: (label, qid, indices, values) or InputFormatError."""

        def fail(problem: str):
            return InputFormatError(self.name, problem, line=lineno)

        content = line.split(b"#", 1)[0]
        toks = content.split()
        label: object = _NO_LABEL
        qid = None
        idx: list[int] = []
        val: list[float] = []
        for j, tok in enumerate(toks):
            name, sep, rest = tok.partition(b":")
            text = tok.decode("utf-8", errors="replace")
            if j == 0 and not sep:
                label = _decode_label(tok, cache)
                continue
            if not sep:
                raise fail(f"expected index:value, got {text!r}")
            if name == b"qid":
                if qid is not None:
                    raise fail("more than one qid")
                try:
                    qid = int(rest)
                except ValueError:
                    raise fail(f"qid {rest.decode(errors='replace')!r} is not an integer") from None
                continue
            sname = name.decode("utf-8", errors="replace")
            if not name.isdigit():
                if name.startswith(b"-") and name[1:].isdigit():
                    raise fail(f"index {sname} is negative")
                raise fail(f"index {sname!r} is not an integer")
            try:
                v = float(rest)
            except ValueError:
                raise fail(f"value {rest.decode(errors='replace')!r} of index {sname} is not a number") from None
            idx.append(int(name))
            val.append(v)
        ia = np.array(idx, dtype=np.int64)
        va = np.array(val, dtype=np.float64)
        if ia.size > 1 and not (np.diff(ia) > 0).all():
            order = np.argsort(ia, kind="stable")
            ia, va = ia[order], va[order]
            dup = np.flatnonzero(np.diff(ia) == 0)
            if dup.size:
                raise fail(f"index {int(ia[dup[0]])} appears twice")
        return label, qid, ia, va


_NO_LABEL = object()


class CsvReader(_TextReader):
    """Delimited numeric text with optional header, id column and label column."""

    sparse = False

    def __init__(self, path: Path, fmt: str = "csv", *, dim: int | None = None, delimiter: str | None = None,
                 header: bool | None = None, id_column: str | int | None = None,
                 label_column: str | int | None = None, **kw):
        super().__init__(path, **kw)
        self.fmt = fmt
        f, raw = _open_text(path)
        with f, raw:
            first, lineno = b"", 0
            for ln in f:
                lineno += 1
                s = ln.strip()
                if s and not s.startswith(b"#"):
                    first = ln
                    break
        if not first:
            raise InputFormatError(self.name, "no data rows")
        if lineno == 1 and first.startswith(b"\xef\xbb\xbf"):
            first = first[3:]
        text = first.decode("utf-8", errors="replace").rstrip("\r\n")
        if delimiter is None:
            delimiter = "\t" if fmt == "tsv" else ","
            if delimiter not in text:
                for cand in ("\t", ";", ","):
                    if cand in text:
                        delimiter = cand
                        break
        if len(delimiter) != 1 or delimiter in "\"\r\n" or delimiter == " ":
            raise InputFormatError(self.name, f"delimiter {delimiter!r}: use one character other than a quote, "
                                              "space or newline")
        self.delimiter = delimiter
        fields = next(csv.reader([text], delimiter=delimiter))
        names = [x.strip() for x in fields]
        self.ncols = len(fields)

        def resolve(col, what: str) -> int | None:
            if col is None:
                return None
            if isinstance(col, int) or (isinstance(col, str) and col.lstrip("-").isdigit()):
                c = int(col)
                if c < 0:
                    c += self.ncols
                if not 0 <= c < self.ncols:
                    raise InputFormatError(self.name, f"{what} {col}: the file has {self.ncols} columns",
                                           line=lineno)
                return c
            if col not in names:
                raise InputFormatError(self.name, f"{what} {col!r} is not in the header ({', '.join(names[:8])}"
                                                  f"{', ...' if len(names) > 8 else ''})", line=lineno)
            return names.index(col)

        if header is None:
            skip = set()
            for col in (id_column, label_column):
                if isinstance(col, int) or (isinstance(col, str) and col.lstrip("-").isdigit()):
                    skip.add(int(col) % self.ncols)
            header = any(not _is_number(x) for j, x in enumerate(names) if j not in skip)
            if not header and any(isinstance(c, str) and not c.lstrip("-").isdigit()
                                  for c in (id_column, label_column) if c is not None):
                raise InputFormatError(self.name, "a column is named but the file has no header line",
                                       line=lineno)
        self.header = bool(header)
        self.header_line = lineno if self.header else 0
        if not self.header:
            names = [str(j) for j in range(self.ncols)]
        self.names = names
        self.id_col = resolve(id_column, "id column")
        self.label_col = resolve(label_column, "label column")
        if self.id_col is not None and self.id_col == self.label_col:
            raise InputFormatError(self.name, "the id column and the label column are the same column")
        colmap = np.empty(self.ncols, np.int64)
        out = 0
        for j in range(self.ncols):
            if j == self.id_col:
                colmap[j] = -1
            elif j == self.label_col:
                colmap[j] = -2
            else:
                colmap[j] = out
                out += 1
        if out == 0:
            raise InputFormatError(self.name, "no value columns")
        self.colmap = colmap
        self.dim = out
        self.value_cols = [j for j in range(self.ncols) if colmap[j] >= 0]
        if dim is not None and dim != self.dim:
            raise InputFormatError(self.name, f"has {self.dim} value columns, expected dim {dim}")

    @property
    def has_col_ids(self) -> bool:
        return self.id_col is not None

    def blocks(self) -> Iterator[_Block]:
        f, raw = _open_text(self.path)
        with f, raw:
            start = 1
            if self.header:
                for _ in range(self.header_line):
                    f.readline()
                start = self.header_line + 1
            first = [True]

            def parse(block: bytes, l0: int):
                if first[0] and not self.header and block.startswith(b"\xef\xbb\xbf"):
                    block = b"   " + block[3:]  # keep byte offsets; spaces are trimmed
                first[0] = False
                return self._parse(block, l0)

            yield from self._blocks_from(f, raw, start, parse)

    def _parse(self, block: bytes, line0: int):
        buf = np.frombuffer(block, dtype=np.uint8)
        # A data row has ncols - 1 delimiters and a newline: this bounds the rows
        # (and the output array) even for a block of mostly blank lines.
        maxr = min(block.count(b"\n"), len(block) // max(self.ncols, 1)) + 1
        out = np.empty((maxr, self.dim), dtype=np.float64)
        row_line = np.empty(maxr, np.int64)
        row_start = np.empty(maxr, np.int64)
        row_end = np.empty(maxr, np.int64)
        id_s = np.empty(maxr, np.int64)
        id_e = np.empty(maxr, np.int64)
        lab_s = np.empty(maxr, np.int64)
        lab_e = np.empty(maxr, np.int64)
        slow = np.empty(maxr, np.bool_)
        dpos, dsta, dend = (np.empty(min(maxr * self.dim, DEFER_CAP), np.int64) for _ in range(3))
        nr, nlines, nd = _csv_kernel(buf, _P10, ord(self.delimiter), self.colmap, out, row_line, row_start,
                                     row_end, id_s, id_e, lab_s, lab_e, slow, dpos, dsta, dend)
        X = out[:nr]
        lines = row_line[:nr] + line0
        if nd:
            def where(pos: int) -> tuple[int, str]:
                r, c = divmod(pos, self.dim)
                j = self.value_cols[c]
                return int(lines[r]), f"column {j + 1} ({self.names[j]!r}): {{tok}} is not a number"

            _convert_deferred(self.name, block, out.reshape(-1), dpos[:nd], dsta[:nd], dend[:nd], where)
        fixed_ids: dict[int, str] = {}
        fixed_labels: dict[int, str] = {}
        for r in np.flatnonzero(slow[:nr]).tolist():
            vals, rid, rlab = self._parse_line_py(block[row_start[r]:row_end[r]], int(lines[r]))
            X[r] = vals
            if rid is not None:
                fixed_ids[r] = rid
            if rlab is not None:
                fixed_labels[r] = rlab
        ids = None
        if self.id_col is not None:
            ids = []
            starts, ends = id_s[:nr].tolist(), id_e[:nr].tolist()
            for r in range(nr):
                if r in fixed_ids:
                    s = fixed_ids[r]
                else:
                    try:
                        s = block[starts[r]:ends[r]].decode("utf-8")
                    except UnicodeDecodeError:
                        raise InputFormatError(self.name, "id is not valid UTF-8", line=int(lines[r])) from None
                if not s:
                    raise InputFormatError(self.name, "empty id", line=int(lines[r]))
                ids.append(s)
        meta = None
        if self.label_col is not None:
            cache: dict = {}
            meta = []
            starts, ends = lab_s[:nr].tolist(), lab_e[:nr].tolist()
            for r in range(nr):
                raw = fixed_labels[r].encode() if r in fixed_labels else block[starts[r]:ends[r]]
                meta.append({"label": _decode_label(raw, cache)} if raw.strip() else None)
        return X, meta, ids, lines, nlines

    def _parse_line_py(self, line: bytes, lineno: int):
        """Reference parser of one row (csv module quoting rules): (values, id, label)."""
        try:
            text = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise InputFormatError(self.name, "not valid UTF-8", line=lineno) from None
        try:
            fields = next(csv.reader([text], delimiter=self.delimiter))
        except csv.Error as exc:
            raise InputFormatError(self.name, f"malformed quoting ({exc})", line=lineno) from None
        if len(fields) != self.ncols:
            raise InputFormatError(self.name, f"expected {self.ncols} fields, found {len(fields)}", line=lineno)
        vals = np.empty(self.dim)
        for j in self.value_cols:
            tok = fields[j].strip()
            if not tok:
                raise InputFormatError(self.name, f"column {j + 1} ({self.names[j]!r}) is empty", line=lineno)
            try:
                vals[self.colmap[j]] = float(tok)
            except ValueError:
                raise InputFormatError(self.name, f"column {j + 1} ({self.names[j]!r}): {tok!r} is not a number",
                                       line=lineno) from None
        rid = fields[self.id_col].strip() if self.id_col is not None else None
        lab = fields[self.label_col].strip() if self.label_col is not None else None
        return vals, rid, lab


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ============================================================================
# the reader: files in sequence, plus ids
# ============================================================================


class _IdStream:
    """One id per line of a text file, handed out alongside the rows."""

    def __init__(self, path: Path):
        self.path = path
        self.name = str(path)
        try:
            self.f = open(path, encoding="utf-8", newline="")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise InputFormatError(self.name, f"cannot read: {exc.strerror or exc}") from None
        self.line = 0

    def take(self, n: int, rows_before: int) -> list[str]:
        out = []
        for _ in range(n):
            try:
                s = self.f.readline()
            except UnicodeDecodeError:
                raise InputFormatError(self.name, "not valid UTF-8", line=self.line + 1) from None
            if not s:
                raise InputFormatError(self.name, f"has {self.line} ids but the input has more rows "
                                                  f"(row {rows_before + len(out)} has no id)")
            self.line += 1
            s = s.rstrip("\r\n")
            if not s:
                raise InputFormatError(self.name, "empty id", line=self.line)
            out.append(s)
        return out

    def skip(self, n: int) -> None:
        for _ in range(n):
            if not self.f.readline():
                raise InputFormatError(self.name, f"has {self.line} ids but the input has more rows")
            self.line += 1

    def finish(self, rows: int) -> None:
        rest = [ln for ln in self.f.read().splitlines() if ln.strip()]
        if rest:
            raise InputFormatError(self.name, f"has {self.line + len(rest)} ids but the input has {rows} rows")

    def close(self) -> None:
        self.f.close()


class Reader:
    """Input files read in sequence as one stream of :class:`Chunk` objects.

    ``dim`` is None only for svmlight input whose dimension is not given and
    not yet scanned (:meth:`scan`). ``rows`` is None when counting them would
    mean reading the files (text formats). ``sparse`` is True when any input is.
    """

    def __init__(self, files: list[_FileReader], *, ids_file: str | os.PathLike | None = None,
                 chunk_rows: int | None = None):
        self.files = files
        self.ids_file = Path(ids_file) if ids_file is not None else None
        self._chunk_rows = chunk_rows
        if self.ids_file is not None and any(f.has_col_ids for f in files):
            raise InputFormatError(str(self.ids_file), "ids come from both an ids file and an id column; "
                                                       "give one")
        if self.ids_file is not None and not self.ids_file.is_file():
            raise InputFormatError(str(self.ids_file), "ids file not found")
        self._check_dims()

    def _check_dims(self) -> None:
        dims = {f.dim for f in self.files if f.dim is not None}
        if len(dims) > 1:
            listing = ", ".join(f"{f.name}: {f.dim}" for f in self.files)
            raise InputFormatError(None, f"inputs have different dimensions ({listing})")

    @property
    def paths(self) -> list[str]:
        return [f.name for f in self.files]

    @property
    def fmt(self) -> str:
        return ",".join(dict.fromkeys(f.fmt for f in self.files))

    @property
    def dim(self) -> int | None:
        dims = [f.dim for f in self.files]
        return None if any(d is None for d in dims) else dims[0]

    @dim.setter
    def dim(self, value: int) -> None:
        """Fix the dimension (e.g. from an existing index): svmlight readers take it, others must match."""
        for f in self.files:
            if f.dim is None or isinstance(f, SvmlightReader):
                f.dim = value
            elif f.dim != value:
                raise InputFormatError(f.name, f"has dimension {f.dim}, expected {value}")

    @property
    def rows(self) -> int | None:
        rows = [f.rows for f in self.files]
        return None if any(r is None for r in rows) else sum(rows)

    @property
    def sparse(self) -> bool:
        return any(f.sparse for f in self.files)

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def chunk_rows(self) -> int:
        return self._chunk_rows or auto_chunk_rows(self.dim)

    @chunk_rows.setter
    def chunk_rows(self, value: int | None) -> None:
        self._chunk_rows = value
        for f in self.files:
            f.chunk_rows = value

    def needs_scan(self) -> bool:
        return any(isinstance(f, SvmlightReader) and (f.dim is None or f.zero_based == "auto") for f in self.files)

    def scan(self) -> int:
        """Read svmlight inputs once to learn the dimension; returns it."""
        for f in self.files:
            if isinstance(f, SvmlightReader) and (f.dim is None or f.zero_based == "auto"):
                f.scan()
        svm = [f for f in self.files if isinstance(f, SvmlightReader)]
        if svm:
            d = max(f.dim for f in svm)
            others = {f.dim for f in self.files if not isinstance(f, SvmlightReader)}
            if others and max(others) < d:
                raise InputFormatError(None, f"svmlight input needs dimension {d}, other inputs have {max(others)}")
            if others:
                d = max(others)
            for f in svm:
                f.dim = d
        self._check_dims()
        return self.dim

    def sample(self, n: int = 2000):
        """Up to ``n`` rows spread over the inputs, for the planner (dense or CSR)."""
        if self.dim is None:
            self.scan()
        per = max(1, -(-n // len(self.files)))
        parts = [p for p in (f.sample(per) for f in self.files) if p is not None and p.shape[0]]
        if not parts:
            return None
        if any(sp.issparse(p) for p in parts):
            parts = [sp.csr_matrix(p) for p in parts]
        return _stack(parts)

    def __iter__(self) -> Iterator[Chunk]:
        return self.chunks()

    def chunks(self) -> Iterator[Chunk]:
        """All rows in order, as chunks of at most ``chunk_rows`` rows."""
        if self.dim is None:
            self.scan()
        ids = _IdStream(self.ids_file) if self.ids_file is not None else None
        try:
            base = 0
            bytes_before = 0
            for f in self.files:
                n_file = 0
                for blk in f.blocks():
                    n = blk.X.shape[0]
                    start = base + blk.file_row
                    if blk.col_ids is not None:
                        chunk_ids = blk.col_ids
                    elif ids is not None:
                        chunk_ids = ids.take(n, start)
                    else:
                        chunk_ids = [str(i) for i in range(start, start + n)]
                    if len(set(chunk_ids)) != n:
                        self._duplicate(chunk_ids, blk, f, ids)
                    n_file = blk.file_row + n
                    yield Chunk(start, chunk_ids, blk.X, blk.metadata, f.name, blk.file_row, blk.lines,
                                bytes_before + blk.end_byte)
                base += n_file
                bytes_before += f.size_bytes
            if ids is not None:
                ids.finish(base)
        finally:
            if ids is not None:
                ids.close()

    def _duplicate(self, chunk_ids: list[str], blk: _Block, f: _FileReader, ids: _IdStream | None):
        seen: dict[str, int] = {}
        for i, s in enumerate(chunk_ids):
            if s in seen:
                if ids is not None:
                    line = ids.line - len(chunk_ids) + i + 1
                    first = ids.line - len(chunk_ids) + seen[s] + 1
                    raise InputFormatError(ids.name, f"id {s!r} repeats line {first}", line=line)
                where = f"line {int(blk.lines[seen[s]])}" if blk.lines is not None else f"row {seen[s]}"
                ln = int(blk.lines[i]) if blk.lines is not None else None
                raise InputFormatError(f.name, f"id {s!r} repeats {where}", line=ln,
                                       row=None if ln is not None else blk.file_row + i)
            seen[s] = i

    def read_row(self, row: int):
        """One row (global number) as a 1-row dense array or CSR matrix: for ``gmmlsh query``."""
        if row < 0:
            raise InputFormatError(None, f"row {row}: rows are numbered from 0")
        base = 0
        for f in self.files:
            if isinstance(f, _MmapRowsReader):
                if row < base + (f.rows or 0):
                    return f.read_rows(row - base, row - base + 1)
                base += f.rows or 0
                continue
            if self.dim is None:
                self.scan()
            seen = 0
            for blk in f.blocks():
                seen = blk.file_row + blk.X.shape[0]
                if row < base + seen:
                    i = row - base - blk.file_row
                    return blk.X[i:i + 1]
            base += seen
        raise InputFormatError(self.files[-1].name if len(self.files) == 1 else None,
                               f"row {row} does not exist (the input has {base} rows)")

    def close(self) -> None:
        """Readers hold no open files between chunks; kept for symmetry with other resources."""


def detect_format(path: str | os.PathLike, fmt: str | None = None) -> str:
    """The format name of a path from ``fmt`` or its extension."""
    if fmt is not None:
        f = fmt.lower().lstrip(".")
        f = _ALIASES.get(f, f) if f in _ALIASES and _ALIASES[f] else f
        if f not in FORMATS:
            raise InputFormatError(path, f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
        return f
    name = str(path).lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for ext in sorted(_EXT, key=len, reverse=True):
        if name.endswith(ext):
            return _EXT[ext]
    raise InputFormatError(path, "cannot tell the format from the file name; pass the format "
                                 f"({', '.join(FORMATS)})")


def open_reader(paths: str | os.PathLike | Sequence[str | os.PathLike], *, fmt: str | None = None,
                dim: int | None = None, ids_file: str | os.PathLike | None = None,
                chunk_rows: int | None = None, key: str | None = None, label_key: str | None = None,
                delimiter: str | None = None, header: bool | None = None, id_column: str | int | None = None,
                label_column: str | int | None = None, zero_based: bool | str = False) -> Reader:
    """A :class:`Reader` over one or several files of the same dimension.

    Options apply where they make sense: ``key``/``label_key`` to .npz,
    ``delimiter``/``header``/``id_column``/``label_column`` to .csv/.tsv,
    ``zero_based`` (False, True or "auto") to svmlight. ``dim`` is checked
    against dense inputs and fixes the dimension of svmlight ones.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not paths:
        raise InputFormatError(None, "no input files")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows: must be ≥ 1, got {chunk_rows}")
    files: list[_FileReader] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise InputFormatError(str(p), "file not found")
        kind = detect_format(path, fmt)
        if path.name.endswith(".gz") and kind not in ("csv", "tsv", "svmlight"):
            raise InputFormatError(str(p), f"gzip is supported for text formats only, not {kind}")
        kw = {"chunk_rows": chunk_rows}
        if kind == "npy":
            r: _FileReader = NpyReader(path, **kw)
        elif kind == "npz":
            r = NpzReader(path, key=key, label_key=label_key, **kw)
        elif kind in ("csv", "tsv"):
            r = CsvReader(path, kind, dim=dim, delimiter=delimiter, header=header, id_column=id_column,
                          label_column=label_column, **kw)
        elif kind == "svmlight":
            r = SvmlightReader(path, dim=dim, zero_based=zero_based, **kw)
        else:
            r = VecsReader(path, kind, **kw)
        if dim is not None and r.dim is not None and r.dim != dim:
            raise InputFormatError(str(p), f"has dimension {r.dim}, expected {dim}")
        files.append(r)
    return Reader(files, ids_file=ids_file, chunk_rows=chunk_rows)


__all__ = [
    "FORMATS", "Chunk", "InputFormatError", "Reader", "auto_chunk_rows", "detect_format", "open_reader",
]
