"""LIBSVM / svmlight text (``label[,label...] [qid:N] index:value ... [# comment]``) through scikit-learn.

``sklearn.datasets.load_svmlight_file`` parses blocks of whole lines (plain or
.gz alike); this module adds the line of every row, one index base for the
whole file (``zero_based="auto"`` is decided by a scan of all of it, never per
block), range checks against the dimension, labels and qids as metadata, and
errors that name the line.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.datasets import load_svmlight_file

from gmmlsh.index.ingest.base import (
    FileReader,
    InputFormatError,
    Piece,
    TextBlock,
    first_bad,
    rechunk,
    split_lines,
    text_blocks,
)


def _load(data: bytes):
    """(X with the file's own indices, labels as tuples, qids of the rows that have one)."""
    return load_svmlight_file(io.BytesIO(data), zero_based=True, multilabel=True, query_id=True)


def _label(t: tuple) -> object:
    vals = [int(v) if v.is_integer() else v for v in t]
    return vals[0] if len(vals) == 1 else vals


class SvmlightReader(FileReader):
    """LIBSVM / svmlight text: sparse rows, indices from 1 unless ``zero_based`` (True or "auto")."""

    fmt = "svmlight"
    sparse = True
    takes_dim = True

    def __init__(self, path: Path, *, dim: int | None = None, zero_based: bool | str = False, **kw):
        super().__init__(path, **kw)
        if zero_based not in (True, False, "auto"):
            raise ValueError(f"zero_based: expected True, False or 'auto', got {zero_based!r}")
        self.dim = dim
        self.zero_based = zero_based
        self._min_index: int | None = None

    @property
    def base(self) -> int:
        """What the file's first index is: 0 or 1 (for "auto": 0 when index 0 occurs anywhere in the file)."""
        if self.zero_based == "auto":
            if self._min_index is None:
                raise RuntimeError("svmlight: zero_based='auto' needs scan() first")
            return 0 if self._min_index == 0 else 1
        return 0 if self.zero_based else 1

    def needs_scan(self) -> bool:
        return self.dim is None or (self.zero_based == "auto" and self._min_index is None)

    def scan(self) -> None:
        """One pass over the file for its smallest and largest index: base and dimension."""
        lo, hi = None, None
        for _, X, _ in self._parsed():
            if X.nnz:
                lo = int(X.indices.min()) if lo is None else min(lo, int(X.indices.min()))
                hi = int(X.indices.max()) if hi is None else max(hi, int(X.indices.max()))
        self._min_index = lo
        if hi is None:
            raise InputFormatError(self.name, "no features in the whole file; cannot tell its dimension")
        need = hi - self.base + 1
        if self.dim is None:
            self.dim = need
        elif need > self.dim:
            raise InputFormatError(self.name, f"has index {hi} but dim is {self.dim}")

    def blocks(self) -> Iterator[Piece]:
        if self.zero_based == "auto" and self._min_index is None:
            self.scan()
        if self.dim is None:
            raise InputFormatError(self.name, "dimension unknown: give dim or call scan() first")
        return rechunk(self._pieces(), self.rows_per_chunk())

    def _parsed(self) -> Iterator[tuple[TextBlock, sp.csr_matrix, list[dict | None]]]:
        """Per block of lines: the block, its rows with the file's indices, and their metadata."""
        for blk in text_blocks(self.path):
            try:
                X, y, qid = _load(blk.data)
            except ValueError as exc:
                raise self._locate(blk, exc) from None
            if X.shape[0] != len(blk.lines):
                raise InputFormatError(self.name, f"{X.shape[0]} rows parsed from {len(blk.lines)} lines "
                                                  "(a NUL byte?)", line=int(blk.lines[0]))
            meta: list[dict | None] = [{"label": _label(t)} if t else None for t in y]
            if len(qid):
                rows = (range(len(meta)) if len(qid) == len(meta) else
                        [i for i, ln in enumerate(split_lines(blk.data)) if b"qid" in ln.split(b"#", 1)[0]])
                for i, q in zip(rows, qid.tolist(), strict=True):
                    meta[i] = {**(meta[i] or {}), "qid": q}
            yield blk, X, meta

    def _pieces(self) -> Iterator[Piece]:
        base, row = self.base, 0
        for blk, X, meta in self._parsed():
            indices = X.indices.astype(np.int64) - base
            for bad, problem in ((indices < 0, "is not valid with 1-based indices (use zero-based indices)"),
                                 (indices >= self.dim, f"is out of range for dimension {self.dim}")):
                if bad.any():
                    k = int(np.flatnonzero(bad)[0])
                    r = int(np.searchsorted(X.indptr, k, "right") - 1)
                    raise InputFormatError(self.name, f"index {int(indices[k]) + base} {problem}",
                                           line=int(blk.lines[r]))
            X = sp.csr_matrix((X.data, indices, X.indptr), shape=(X.shape[0], self.dim))
            yield Piece(row, X, meta, None, blk.lines, blk.start_byte, blk.end_byte)
            row += X.shape[0]

    def _locate(self, blk: TextBlock, exc: ValueError) -> InputFormatError:
        """scikit-learn refused the block without naming the line: find it by asking about halves."""
        rows = split_lines(blk.data)

        def parse(a: int, b: int) -> ValueError | None:
            try:
                _load(b"".join(rows[a:b]))
            except ValueError as e:
                return e
            return None

        i = first_bad(len(rows), lambda a, b: parse(a, b) is None)
        if i is None:
            return InputFormatError(self.name, str(exc), line=int(blk.lines[0]) if len(blk.lines) else None)
        return InputFormatError(self.name, _problem(str(parse(i, i + 1)), rows[i]), line=int(blk.lines[i]))


def _problem(message: str, line: bytes) -> str:
    """scikit-learn's message about one line, said for a person."""
    m = re.search(r"could not convert string to float: b?'(.*)'", message)
    if m:
        return f"{m.group(1)!r} is not a number"
    m = re.search(r"invalid literal for int\(\) with base 10: b?'(.*)'", message)
    if m:
        return f"{m.group(1)!r} is not an integer"
    m = re.search(r"Invalid index (-?\d+)", message)
    if m:
        return f"index {m.group(1)} is negative"
    if "sorted and unique" in message:
        return "indices must increase along the line (sorted, each once)"
    if "to unpack" in message:
        tok = next((t for t in line.split(b"#", 1)[0].split()[1:] if b":" not in t), b"?")
        return f"expected index:value, got {tok.decode(errors='replace')!r}"
    return message
