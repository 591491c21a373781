""".csv / .tsv (and .gz of them) through pyarrow's streaming CSV reader.

pyarrow parses (quoting, CRLF, a byte order mark, correctly rounded numbers);
this module adds what it lacks: ``#`` comment lines, the line of every row
(blank and comment lines are dropped before pyarrow sees them, so row *i* is
the *i*-th kept line), a header and delimiter guess from the first line, and
errors that name the line.
"""

from __future__ import annotations

import csv
import io
import re
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from gmmlsh.index.ingest import base
from gmmlsh.index.ingest.base import (
    FileReader,
    InputFormatError,
    Piece,
    TextBlock,
    first_bad,
    label_value,
    open_text,
    rechunk,
    split_lines,
    text_blocks,
)


class _Feed(io.RawIOBase):
    """The content lines of a text file as one byte stream for pyarrow; remembers each row's line.

    pyarrow may read ahead (from its own thread): blocks stay here until all
    their rows have been taken, so the error path can look at them again.
    Closing waits for a read under way, and later reads see the end.
    """

    def __init__(self, path: Path, skip_lines: int):
        super().__init__()
        self._blocks = text_blocks(path, skip_lines=skip_lines)
        self._view = memoryview(b"")
        self._pending: deque[TextBlock] = deque()
        self._taken = 0  # rows of _pending[0] already taken
        self._lock = threading.Lock()  # the pending blocks
        self._reading = threading.Lock()  # the file
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        """Fills ``b`` whole unless the file ends: pyarrow (26) ends the stream early after a short read
        holding only the LF of a CR LF."""
        got = 0
        while got < len(b):
            if not len(self._view):
                with self._reading:
                    blk = None if self._done else next(self._blocks, None)
                if blk is None:
                    break
                with self._lock:
                    self._pending.append(blk)
                self._view = memoryview(blk.data)
            n = min(len(b) - got, len(self._view))
            b[got:got + n] = self._view[:n]
            self._view = self._view[n:]
            got += n
        return got

    def take(self, n: int) -> tuple[np.ndarray, int]:
        """The lines of the next ``n`` rows, and about how far into the file they end."""
        parts, end = [], 0
        with self._lock:
            while n:
                blk = self._pending[0]
                k = min(n, len(blk.lines) - self._taken)
                parts.append(blk.lines[self._taken:self._taken + k])
                self._taken += k
                n -= k
                end = blk.start_byte + (blk.end_byte - blk.start_byte) * self._taken // max(len(blk.lines), 1)
                if self._taken == len(blk.lines):
                    self._pending.popleft()
                    self._taken = 0
        return np.concatenate(parts) if parts else np.zeros(0, np.int64), end

    def untaken(self) -> tuple[list[bytes], list[int]]:
        """The rows read but not taken yet, as (lines of text, line numbers): for the error path."""
        with self._lock:
            rows, nums = [], []
            for i, blk in enumerate(self._pending):
                skip = self._taken if i == 0 else 0
                rows += split_lines(blk.data)[skip:]
                nums += blk.lines[skip:].tolist()
            return rows, nums

    def close(self) -> None:
        with self._reading:
            self._done = True
            self._blocks.close()
        super().close()


_NEW = object()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class CsvReader(FileReader):
    """Delimited numeric text with an optional header, id column and label column."""

    def __init__(self, path: Path, fmt: str = "csv", *, dim: int | None = None, delimiter: str | None = None,
                 header: bool | None = None, id_column: str | int | None = None,
                 label_column: str | int | None = None, **kw):
        super().__init__(path, **kw)
        self.fmt = fmt
        text, lineno = self._first_line()
        if delimiter is None:
            delimiter = "\t" if fmt == "tsv" else ","
            if delimiter not in text:
                delimiter = next((c for c in ("\t", ";", ",") if c in text), delimiter)
        if len(delimiter) != 1 or delimiter in "\"\r\n" or delimiter == " ":
            raise InputFormatError(self.name, f"delimiter {delimiter!r}: use one character other than a quote, "
                                              "space or newline")
        self.delimiter = delimiter
        names = [x.strip() for x in next(csv.reader([text], delimiter=delimiter))]
        self.ncols = len(names)
        positional = [int(c) % self.ncols for c in (id_column, label_column) if _is_position(c)]
        if header is None:
            header = any(not _is_number(x) for j, x in enumerate(names) if j not in positional)
            if not header and any(c is not None and not _is_position(c) for c in (id_column, label_column)):
                raise InputFormatError(self.name, "a column is named but the file has no header line", line=lineno)
        self.header_line = lineno if header else 0
        self.names = names if header else [str(j) for j in range(self.ncols)]
        self.id_col = self._resolve(id_column, "id column", lineno)
        self.label_col = self._resolve(label_column, "label column", lineno)
        if self.id_col is not None and self.id_col == self.label_col:
            raise InputFormatError(self.name, "the id column and the label column are the same column")
        self.value_cols = [j for j in range(self.ncols) if j not in (self.id_col, self.label_col)]
        if not self.value_cols:
            raise InputFormatError(self.name, "no value columns")
        self.dim = len(self.value_cols)
        if dim is not None and dim != self.dim:
            raise InputFormatError(self.name, f"has {self.dim} value columns, expected dim {dim}")

    def _first_line(self) -> tuple[str, int]:
        """The first line with content (header or data) and its number."""
        f, raw = open_text(self.path)
        with f, raw:
            for lineno, ln in enumerate(f, 1):
                ln = ln.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else ln
                s = ln.strip()
                if s and not s.startswith(b"#"):
                    return ln.rstrip(b"\r\n").decode("utf-8", errors="replace"), lineno
        raise InputFormatError(self.name, "no data rows")

    def _resolve(self, col: str | int | None, what: str, lineno: int) -> int | None:
        if col is None:
            return None
        if _is_position(col):
            c = int(col) + (self.ncols if int(col) < 0 else 0)
            if not 0 <= c < self.ncols:
                raise InputFormatError(self.name, f"{what} {col}: the file has {self.ncols} columns", line=lineno)
            return c
        if col not in self.names:
            raise InputFormatError(self.name, f"{what} {col!r} is not in the header ({', '.join(self.names[:8])}"
                                              f"{', ...' if len(self.names) > 8 else ''})", line=lineno)
        return self.names.index(col)

    @property
    def has_col_ids(self) -> bool:
        return self.id_col is not None

    def _options(self) -> dict:
        """pyarrow's options: every field by position (``c0``, ``c1``, ...), numbers as float64, "" as null."""
        types = {f"c{j}": pa.float64() for j in self.value_cols}
        for j in (self.id_col, self.label_col):
            if j is not None:
                types[f"c{j}"] = pa.string()
        return {"read_options": pacsv.ReadOptions(column_names=[f"c{j}" for j in range(self.ncols)],
                                                  block_size=base.BLOCK_BYTES, use_threads=False),
                "parse_options": pacsv.ParseOptions(delimiter=self.delimiter),
                "convert_options": pacsv.ConvertOptions(column_types=types, null_values=[""],
                                                        strings_can_be_null=False)}

    def blocks(self) -> Iterator[Piece]:
        return rechunk(self._pieces(), self.rows_per_chunk())

    def _pieces(self) -> Iterator[Piece]:
        feed = _Feed(self.path, self.header_line)
        opts = self._options()
        row, start = 0, 0
        labels: dict[str, object] = {}
        stream = None
        try:
            try:
                stream = pacsv.open_csv(feed, **opts)
            except pa.ArrowInvalid as exc:
                raise self._locate(feed, exc, opts) from None
            while True:
                try:
                    batch = stream.read_next_batch()
                except StopIteration:
                    return
                except pa.ArrowInvalid as exc:
                    raise self._locate(feed, exc, opts) from None
                lines, end = feed.take(batch.num_rows)
                yield Piece(row, self._values(batch, lines), self._labels(batch, lines, labels),
                            self._ids(batch, lines), lines, start, end)
                row += batch.num_rows
                start = end
        finally:
            if stream is not None:
                stream.close()
            feed.close()

    def _values(self, batch: pa.RecordBatch, lines: np.ndarray) -> np.ndarray:
        for j in self.value_cols:
            col = batch.column(j)
            if col.null_count:
                r = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise InputFormatError(self.name, f"column {j + 1} ({self.names[j]!r}) is empty", line=int(lines[r]))
        values = batch.select(self.value_cols) if len(self.value_cols) < self.ncols else batch
        return np.asarray(values.to_tensor(row_major=True))

    def _ids(self, batch: pa.RecordBatch, lines: np.ndarray) -> list[str] | None:
        if self.id_col is None:
            return None
        ids = pc.utf8_trim_whitespace(batch.column(self.id_col)).to_pylist()
        if "" in ids:
            raise InputFormatError(self.name, "empty id", line=int(lines[ids.index("")]))
        return ids

    def _labels(self, batch: pa.RecordBatch, lines: np.ndarray, cache: dict) -> list[dict | None] | None:
        if self.label_col is None:
            return None
        out: list[dict | None] = []
        for text in batch.column(self.label_col).to_pylist():
            v = cache.get(text, _NEW)
            if v is _NEW:
                v = label_value(text) if text.strip() else None
                if len(cache) < 100_000:
                    cache[text] = v
            out.append(None if v is None else {"label": v})
        return out

    def _locate(self, feed: _Feed, exc: pa.ArrowInvalid, opts: dict) -> InputFormatError:
        """pyarrow refused a block without naming the line: find the line by asking it again about halves."""
        rows, nums = feed.untaken()

        def parse(a: int, b: int) -> pa.ArrowInvalid | None:
            try:
                pacsv.read_csv(io.BytesIO(b"".join(rows[a:b])), **opts)
            except pa.ArrowInvalid as e:
                return e
            return None

        i = first_bad(len(rows), lambda a, b: parse(a, b) is None)
        if i is None:
            return InputFormatError(self.name, _problem(str(exc), self.names), line=nums[0] if nums else None)
        return InputFormatError(self.name, _problem(str(parse(i, i + 1)), self.names), line=nums[i])


def _is_position(col) -> bool:
    return isinstance(col, int) or (isinstance(col, str) and col.lstrip("-").isdigit())


def _problem(message: str, names: list[str]) -> str:
    """pyarrow's message about one line, in the words of the other readers."""
    m = re.search(r"column #(\d+): (?:Row #\d+: )?CSV conversion error to (\w+): invalid (value '.*'|UTF8 data)",
                  message)
    if m:
        j = int(m.group(1))
        if m.group(2) == "string":
            return f"column {j + 1} ({names[j]!r}) is not valid UTF-8"
        return f"column {j + 1} ({names[j]!r}): {m.group(3)[6:]} is not a number"
    m = re.search(r"Expected (\d+) columns, got (\d+)", message)
    if m:
        return f"expected {m.group(1)} fields, found {m.group(2)}"
    return re.sub(r"^CSV parse error: ", "", message)
