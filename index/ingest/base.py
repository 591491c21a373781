"""What every file reader shares: the error type, pieces of rows, fixed-size chunking, whole-line text blocks."""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import scipy.sparse as sp

#: Rows per chunk are chosen so that a chunk holds about this many values
#: (16 MiB as float64), within [_MIN_ROWS, _MAX_ROWS]. The index makes a few
#: working copies of a chunk while hashing it, so this sets most of the build's
#: memory beyond the libraries and the store's mapped pages.
CHUNK_VALUES = 2 << 20
_MIN_ROWS = 64
_MAX_ROWS = 8192
#: Bytes of text handed to a parser at a time (whole lines; a longer line makes a longer block).
BLOCK_BYTES = 1 << 20


class InputFormatError(ValueError):
    """Malformed input. The message names the file, the line or row, and the problem.

    ``data.svm:17: 'x3' is not an integer`` (text formats: 1-based line) or
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


#: Rows per chunk of sparse input: its size follows the nonzeros, not the dimension. Many
#: rows a chunk matter for text: a chunk's hashing computes the sampling constants of every
#: distinct term it holds once, and function words are in every chunk (at 64 rows a chunk,
#: as the dimension alone would give 47,000-dimensional text, that was half the build).
SPARSE_CHUNK_ROWS = 4096


def auto_chunk_rows(dim: int | None, sparse: bool = False) -> int:
    """Rows per chunk: dense, about :data:`CHUNK_VALUES` values; sparse, :data:`SPARSE_CHUNK_ROWS`."""
    if not dim or sparse:
        return SPARSE_CHUNK_ROWS
    return int(min(_MAX_ROWS, max(_MIN_ROWS, CHUNK_VALUES // max(dim, 1))))


@dataclass
class Piece:
    """Consecutive rows of one file, before ids from an ids file: what a file reader yields.

    ``ids`` come from an id column; ``lines`` are the rows' 1-based lines (text
    formats); the rows span bytes ``start_byte..end_byte`` of the file (for progress).
    """

    file_row: int
    X: np.ndarray | sp.csr_matrix
    metadata: list[dict | None] | None = None
    ids: list[str] | None = None
    lines: np.ndarray | None = None
    start_byte: int = 0
    end_byte: int = 0

    def __len__(self) -> int:
        return self.X.shape[0]

    def split(self, k: int) -> tuple[Piece, Piece]:
        """The first ``k`` rows and the rest; the byte span is shared out in proportion."""
        mid = self.start_byte + (self.end_byte - self.start_byte) * k // max(len(self), 1)

        def cut(v, a, b):
            return None if v is None else v[a:b]

        head = Piece(self.file_row, self.X[:k], cut(self.metadata, 0, k), cut(self.ids, 0, k),
                     cut(self.lines, 0, k), self.start_byte, mid)
        tail = Piece(self.file_row + k, self.X[k:], cut(self.metadata, k, None), cut(self.ids, k, None),
                     cut(self.lines, k, None), mid, self.end_byte)
        return head, tail


def stack(parts: Sequence) -> np.ndarray | sp.csr_matrix | None:
    """Row-stack dense arrays or sparse matrices (CSR out)."""
    if not parts:
        return None
    if any(sp.issparse(p) for p in parts):
        return sp.vstack([sp.csr_matrix(p) for p in parts], format="csr")
    return np.concatenate(parts, axis=0)


def _join(pieces: list[Piece]) -> Piece:
    """One piece of consecutive pieces (of one file, so all with or all without ids, metadata, lines)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first

    def cat(vals: list) -> list | None:
        return None if vals[0] is None else [x for v in vals for x in v]

    lines = None if first.lines is None else np.concatenate([p.lines for p in pieces])
    return Piece(first.file_row, stack([p.X for p in pieces]), cat([p.metadata for p in pieces]),
                 cat([p.ids for p in pieces]), lines, first.start_byte, pieces[-1].end_byte)


def rechunk(pieces: Iterator[Piece], step: int) -> Iterator[Piece]:
    """Pieces of exactly ``step`` rows (the last may be shorter), whatever sizes the parser produced.

    Chunk boundaries then depend only on the file and ``step`` — what a resumed
    build needs to find the chunks it already stored.
    """
    held: list[Piece] = []
    have = 0
    row = 0
    for p in pieces:
        if not len(p):
            continue
        held.append(replace(p, file_row=row + have))
        have += len(p)
        while have >= step:
            head, tail = held[-1].split(len(held[-1]) - (have - step))
            out = _join(held[:-1] + [head])
            yield out
            row += step
            have -= step
            held = [tail] if len(tail) else []
    if have:
        yield _join(held)


def dense_dtype(dtype: np.dtype, path: str) -> np.dtype:
    """Working dtype of numbers read: float32 stays, other numbers become float64 (exact)."""
    if dtype.kind == "f":
        return np.dtype(np.float32) if dtype.itemsize == 4 else np.dtype(np.float64)
    if dtype.kind in "biu":
        return np.dtype(np.float64)
    raise InputFormatError(path, f"array of dtype {dtype} is not numeric")


def label_value(text: str) -> object:
    """A label as metadata: int when written as one, else float, a list for ``1,3``, else the text."""
    text = text.strip()
    if "," in text:
        return [label_value(t) for t in text.split(",") if t.strip()]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


class FileReader:
    """One input file. Subclasses set ``dim``/``rows``/``sparse`` and implement :meth:`blocks`."""

    fmt = ""
    sparse = False
    #: Whether the reader adopts a dimension given later (svmlight) instead of checking it.
    takes_dim = False

    def __init__(self, path: Path, *, chunk_rows: int | None = None):
        self.path = path
        self.name = str(path)
        self.dim: int | None = None
        self.rows: int | None = None
        self.chunk_rows = chunk_rows
        if path.is_dir():
            raise InputFormatError(self.name, "is a directory, not a file")
        try:
            self.size_bytes = path.stat().st_size
        except OSError as exc:
            raise InputFormatError(self.name, f"cannot read: {exc.strerror or exc}") from None

    @property
    def has_col_ids(self) -> bool:
        return False

    def rows_per_chunk(self) -> int:
        return self.chunk_rows or auto_chunk_rows(self.dim, self.sparse)

    def blocks(self) -> Iterator[Piece]:
        """The file's rows in pieces of exactly :meth:`rows_per_chunk` rows (the last may be shorter)."""
        raise NotImplementedError

    def sample(self, n: int):
        """Up to ``n`` rows for the planner (the first ones; readers with addressable rows spread them)."""
        parts, got = [], 0
        for b in self.blocks():
            parts.append(b.X[: n - got])
            got += parts[-1].shape[0]
            if got >= n:
                break
        return stack(parts)

    def needs_scan(self) -> bool:
        return False

    def scan(self) -> None:
        """Learn what a streaming reader cannot know up front (svmlight: dimension)."""


# --- text files ----------------------------------------------------------------------------

_BLANK = np.zeros(256, dtype=bool)
_BLANK[[9, 10, 11, 12, 13, 32]] = True  # what bytes.strip() strips


@dataclass
class TextBlock:
    """Whole lines of a text file: ``data`` holds the lines with content, ``lines`` their 1-based numbers.

    A line has content unless it is blank or a ``#`` comment. ``data`` is the
    raw block when every non-empty line has content, else those lines joined.
    """

    data: bytes
    lines: np.ndarray
    start_byte: int
    end_byte: int


def open_text(path: Path) -> tuple[BinaryIO, BinaryIO]:
    """(reader, raw file): the raw file's position measures progress through a .gz too."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def text_blocks(path: Path, *, skip_lines: int = 0, size: int | None = None) -> Iterator[TextBlock]:
    """The lines of ``path`` after the first ``skip_lines``, in blocks of about ``size`` bytes.

    A UTF-8 byte order mark at the start of the file is dropped.
    """
    size = size or BLOCK_BYTES
    f, raw = open_text(path)
    with f, raw:
        for _ in range(skip_lines):
            f.readline()
        line0 = skip_lines + 1
        first = skip_lines == 0
        start = raw.tell()
        while True:
            block = f.read(size)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()
            if first and block.startswith(b"\xef\xbb\xbf"):
                block = block[3:]
            first = False
            data, lines, count = _content_lines(block, line0)
            end = raw.tell()
            yield TextBlock(data, lines, start, end)
            line0 += count
            start = end


def _content_lines(block: bytes, line0: int) -> tuple[bytes, np.ndarray, int]:
    """(lines with content, their numbers, how many lines ``block`` has) — see :class:`TextBlock`."""
    buf = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)
    if not block.endswith(b"\n"):
        ends = np.append(ends, len(block))
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    first = buf[np.minimum(starts, len(block) - 1)]
    keep = ~_BLANK[first] & (first != 35)
    odd = np.flatnonzero(_BLANK[first] & (ends > starts)).tolist()  # leading blank: look closer
    for i in odd:
        s = block[starts[i]:ends[i]].strip()
        keep[i] = bool(s) and not s.startswith(b"#")
    empty = ends - starts <= (buf[np.maximum(ends - 1, 0)] == 13)  # "" or "\r": the parsers skip these
    if not (keep | empty).all():
        block = b"".join(block[s:e + 1] for s, e in zip(starts[keep].tolist(), ends[keep].tolist(), strict=True))
    return block, np.flatnonzero(keep) + line0, len(starts)


def split_lines(data: bytes) -> list[bytes]:
    """The lines of a :class:`TextBlock`'s ``data`` (blank ones dropped), each with its newline."""
    return [ln + b"\n" for ln in data.split(b"\n") if ln.strip()]


def first_bad(n: int, ok: Callable[[int, int], bool]) -> int | None:
    """The first of ``n`` items that fails, by bisection; ``ok(a, b)`` tells whether items ``a..b-1`` all pass.

    For the error path: a parser that rejects a block without saying where is
    asked again about halves of it, about log2(n) times, instead of line by line.
    """
    if ok(0, n):
        return None
    lo, hi = 0, n  # items[:lo] pass, items[:hi] fail
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo
