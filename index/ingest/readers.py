"""File readers: input files as bounded chunks of rows for the batch build.

``open_reader(paths, ...)`` gives a :class:`Reader` whose iteration yields
:class:`Chunk` objects (``start_row``, ``ids``, ``X``, ``metadata``). The build
never sees a whole file, so memory stays bounded whatever its size. Parsing is
left to libraries made for it; the readers add chunking, ids, line numbers and
errors of the form ``file:line: problem`` (text) or ``file: row N: problem``.

=====================================  ==============================================  ===============
format (by extension; ``fmt=``)        parsed by                                       module
=====================================  ==============================================  ===============
.csv, .tsv (and .gz)                   pyarrow.csv.open_csv, streaming                 delimited.py
svmlight: .svm .svmlight .libsvm       sklearn.datasets.load_svmlight_file,            svmlight.py
(and .gz)                              on blocks of whole lines
.parquet                               pyarrow.parquet.ParquetFile.iter_batches        parquet.py
.npy, .fvecs .bvecs .ivecs             numpy.memmap, one window of rows at a time      arrays.py
.npz (a dense member or scipy CSR)     numpy .npy headers, streamed from the zip       arrays.py
=====================================  ==============================================  ===============

Ids are the global row numbers (``"0"``, ``"1"``, ... continuing across input
files; from ``id_start`` if given), an id column (csv, parquet), or one id per line of an
``ids_file``; ``id_prefix`` goes in front of each (so a second build adds rows instead of
replacing the first's).
Chunks hold ``chunk_rows`` rows each (the last of a file may hold fewer), so
the chunks of a file are the same on every run: a resumed build finds those it
already stored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from gmmlsh.index.ingest.base import FileReader, InputFormatError, Piece, auto_chunk_rows, stack

FORMATS = ("npy", "npz", "csv", "tsv", "svmlight", "parquet", "fvecs", "bvecs", "ivecs")
_ALIASES = {"libsvm": "svmlight", "svm": "svmlight", "pq": "parquet"}
_EXT = {
    ".npy": "npy", ".npz": "npz", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
    ".svm": "svmlight", ".svmlight": "svmlight", ".libsvm": "svmlight", ".libsvm.txt": "svmlight",
    ".parquet": "parquet", ".pq": "parquet", ".fvecs": "fvecs", ".bvecs": "bvecs", ".ivecs": "ivecs",
}
_TEXT = ("csv", "tsv", "svmlight")


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


class _IdStream:
    """One id per line of a text file, handed out alongside the rows."""

    def __init__(self, path: Path):
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

    def __init__(self, files: list[FileReader], *, ids_file: str | os.PathLike | None = None,
                 chunk_rows: int | None = None, id_prefix: str = "", id_start: int = 0):
        self.files = files
        self.ids_file = Path(ids_file) if ids_file is not None else None
        self._chunk_rows = chunk_rows
        self.id_prefix, self.id_start = id_prefix, id_start
        if self.ids_file is not None and any(f.has_col_ids for f in files):
            raise InputFormatError(str(self.ids_file), "ids come from both an ids file and an id column; give one")
        if id_start and (self.ids_file is not None or any(f.has_col_ids for f in files)):
            raise ValueError("id_start: numbers rows, but the ids come from an ids file or an id column")
        if id_start < 0:
            raise ValueError(f"id_start: must be ≥ 0, got {id_start}")
        if self.ids_file is not None and not self.ids_file.is_file():
            raise InputFormatError(str(self.ids_file), "ids file not found")
        self._check_dims()

    def _check_dims(self) -> None:
        if len({f.dim for f in self.files if f.dim is not None}) > 1:
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
            if f.dim is None or f.takes_dim:
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
        return self._chunk_rows or auto_chunk_rows(self.dim, self.sparse)

    @chunk_rows.setter
    def chunk_rows(self, value: int | None) -> None:
        self._chunk_rows = value
        for f in self.files:
            f.chunk_rows = value

    def needs_scan(self) -> bool:
        return any(f.needs_scan() for f in self.files)

    def scan(self) -> int:
        """Read svmlight inputs once to learn the dimension (and index base); returns it."""
        for f in self.files:
            if f.needs_scan():
                f.scan()
        svm = [f for f in self.files if f.takes_dim]
        if svm:
            d = max(f.dim for f in svm)
            others = {f.dim for f in self.files if not f.takes_dim}
            if others and max(others) < d:
                raise InputFormatError(None, f"svmlight input needs dimension {d}, other inputs have {max(others)}")
            for f in svm:
                f.dim = max(others) if others else d
        self._check_dims()
        return self.dim

    def sample(self, n: int = 2000):
        """Up to ``n`` rows spread over the inputs, for the planner (dense or CSR)."""
        if self.dim is None:
            self.scan()
        per = max(1, -(-n // len(self.files)))
        parts = [p for p in (f.sample(per) for f in self.files) if p is not None and p.shape[0]]
        return stack(parts)

    def __iter__(self) -> Iterator[Chunk]:
        return self.chunks()

    def chunks(self) -> Iterator[Chunk]:
        """All rows in order, as chunks of ``chunk_rows`` rows (a file's last chunk may be shorter)."""
        if self.dim is None:
            self.scan()
        ids = _IdStream(self.ids_file) if self.ids_file is not None else None
        try:
            base = 0
            bytes_before = 0
            for f in self.files:
                n_file = 0
                for p in f.blocks():
                    n = len(p)
                    start = base + p.file_row
                    if p.ids is not None:
                        chunk_ids = p.ids
                    elif ids is not None:
                        chunk_ids = ids.take(n, start)
                    else:
                        chunk_ids = [str(i) for i in range(self.id_start + start, self.id_start + start + n)]
                    if self.id_prefix:
                        chunk_ids = [self.id_prefix + i for i in chunk_ids]
                    if len(set(chunk_ids)) != n:
                        self._duplicate(chunk_ids, p, f, ids)
                    n_file = p.file_row + n
                    yield Chunk(start, chunk_ids, p.X, p.metadata, f.name, p.file_row, p.lines,
                                bytes_before + p.end_byte)
                base += n_file
                bytes_before += f.size_bytes
            if ids is not None:
                ids.finish(base)
        finally:
            if ids is not None:
                ids.close()

    def _duplicate(self, chunk_ids: list[str], p: Piece, f: FileReader, ids: _IdStream | None):
        seen: dict[str, int] = {}
        for i, s in enumerate(chunk_ids):
            if s in seen:
                if ids is not None:
                    line = ids.line - len(chunk_ids) + i + 1
                    first = ids.line - len(chunk_ids) + seen[s] + 1
                    raise InputFormatError(ids.name, f"id {s!r} repeats line {first}", line=line)
                where = f"line {int(p.lines[seen[s]])}" if p.lines is not None else f"row {p.file_row + seen[s]}"
                ln = int(p.lines[i]) if p.lines is not None else None
                raise InputFormatError(f.name, f"id {s!r} repeats {where}", line=ln,
                                       row=None if ln is not None else p.file_row + i)
            seen[s] = i

    def read_row(self, row: int):
        """One row (global number) as a 1-row dense array or CSR matrix: for ``gmmlsh query``."""
        if row < 0:
            raise InputFormatError(None, f"row {row}: rows are numbered from 0")
        if self.dim is None:
            self.scan()
        base = 0
        for f in self.files:
            if hasattr(f, "read_rows"):
                if row < base + (f.rows or 0):
                    return f.read_rows(row - base, row - base + 1)
                base += f.rows or 0
                continue
            seen = 0
            for p in f.blocks():
                seen = p.file_row + len(p)
                if row < base + seen:
                    i = row - base - p.file_row
                    return p.X[i:i + 1]
            base += seen
        raise InputFormatError(self.files[-1].name if len(self.files) == 1 else None,
                               f"row {row} does not exist (the input has {base} rows)")

    def close(self) -> None:
        """Readers hold no open files between chunks; kept for symmetry with other resources."""


def detect_format(path: str | os.PathLike, fmt: str | None = None) -> str:
    """The format name of a path from ``fmt`` or its extension."""
    if fmt is not None:
        f = fmt.lower().lstrip(".")
        f = _ALIASES.get(f, f)
        if f not in FORMATS:
            raise InputFormatError(path, f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
        return f
    name = str(path).lower().removesuffix(".gz")
    for ext in sorted(_EXT, key=len, reverse=True):
        if name.endswith(ext):
            return _EXT[ext]
    raise InputFormatError(path, f"cannot tell the format from the file name; pass the format ({', '.join(FORMATS)})")


def open_reader(paths: str | os.PathLike | Sequence[str | os.PathLike], *, fmt: str | None = None,
                dim: int | None = None, ids_file: str | os.PathLike | None = None,
                chunk_rows: int | None = None, key: str | None = None, label_key: str | None = None,
                delimiter: str | None = None, header: bool | None = None, id_column: str | int | None = None,
                label_column: str | int | None = None, zero_based: bool | str = False, id_prefix: str = "",
                id_start: int = 0) -> Reader:
    """A :class:`Reader` over one or several files of the same dimension.

    Options apply where they make sense: ``key``/``label_key`` to .npz,
    ``delimiter``/``header`` to .csv/.tsv, ``id_column``/``label_column`` to
    .csv/.tsv and .parquet, ``zero_based`` (False, True or "auto") to svmlight; ``id_prefix``
    and ``id_start`` to the ids (see the module docstring).
    ``dim`` is checked against dense inputs and fixes the dimension of svmlight ones.
    The format modules (and their libraries) are imported only when needed.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not paths:
        raise InputFormatError(None, "no input files")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows: must be ≥ 1, got {chunk_rows}")
    files: list[FileReader] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise InputFormatError(str(p), "file not found")
        kind = detect_format(path, fmt)
        if path.name.endswith(".gz") and kind not in _TEXT:
            raise InputFormatError(str(p), f"gzip is supported for text formats only, not {kind}")
        kw = {"chunk_rows": chunk_rows}
        if kind in ("npy", "npz", "fvecs", "bvecs", "ivecs"):
            from gmmlsh.index.ingest import arrays

            r: FileReader = (arrays.NpyReader(path, **kw) if kind == "npy" else
                             arrays.NpzReader(path, key=key, label_key=label_key, **kw) if kind == "npz" else
                             arrays.VecsReader(path, kind, **kw))
        elif kind in ("csv", "tsv"):
            from gmmlsh.index.ingest.delimited import CsvReader

            r = CsvReader(path, kind, dim=dim, delimiter=delimiter, header=header, id_column=id_column,
                          label_column=label_column, **kw)
        elif kind == "parquet":
            from gmmlsh.index.ingest.parquet import ParquetReader

            r = ParquetReader(path, id_column=id_column, label_column=label_column, **kw)
        else:
            from gmmlsh.index.ingest.svmlight import SvmlightReader

            r = SvmlightReader(path, dim=dim, zero_based=zero_based, **kw)
        if dim is not None and r.dim is not None and r.dim != dim:
            raise InputFormatError(str(p), f"has dimension {r.dim}, expected {dim}")
        files.append(r)
    return Reader(files, ids_file=ids_file, chunk_rows=chunk_rows, id_prefix=id_prefix, id_start=id_start)


__all__ = [
    "FORMATS", "Chunk", "InputFormatError", "Reader", "auto_chunk_rows", "detect_format", "open_reader",
]
