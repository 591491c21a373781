"""Parquet through ``pyarrow.parquet``: batches of rows from ``ParquetFile.iter_batches``.

The vector is one list column of numbers (``list``, ``large_list`` or
``fixed_size_list``) when the file has one, else every numeric column; the id
and label columns (name or 0-based position) are left out of it. Errors name
the file and the 0-based row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gmmlsh.index.ingest.base import FileReader, InputFormatError, Piece, rechunk


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _list_of_numbers(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
        and _numeric(t.value_type)


class ParquetReader(FileReader):
    """Rows of a Parquet file: a list column or the numeric columns as the vector, ids and labels beside."""

    fmt = "parquet"

    def __init__(self, path: Path, *, id_column: str | int | None = None, label_column: str | int | None = None,
                 **kw):
        super().__init__(path, **kw)
        try:
            with pq.ParquetFile(path) as pf:
                schema = pf.schema_arrow
                self.rows = pf.metadata.num_rows
                names = schema.names
                self.id_col = self._resolve(id_column, "id column", names)
                self.label_col = self._resolve(label_column, "label column", names)
                rest = [f for f in schema if f.name not in (self.id_col, self.label_col)]
                lists = [f.name for f in rest if _list_of_numbers(f.type)]
                if len(lists) > 1:
                    raise InputFormatError(self.name, f"several list columns ({', '.join(lists)}); keep one")
                if lists:
                    self.list_col, self.value_cols = lists[0], [lists[0]]
                    t = schema.field(self.list_col).type
                    self.dim = t.list_size if pa.types.is_fixed_size_list(t) else self._first_length(pf)
                    floats32 = t.value_type == pa.float32()
                else:
                    self.list_col, self.value_cols = None, [f.name for f in rest if _numeric(f.type)]
                    if not self.value_cols:
                        raise InputFormatError(self.name, "no numeric columns and no list column of numbers")
                    self.dim = len(self.value_cols)
                    floats32 = all(schema.field(c).type == pa.float32() for c in self.value_cols)
        except (pa.ArrowException, OSError) as exc:
            raise InputFormatError(self.name, f"not a readable Parquet file ({exc})") from None
        self.work_type = pa.float32() if floats32 else pa.float64()

    def _resolve(self, col: str | int | None, what: str, names: list[str]) -> str | None:
        if col is None:
            return None
        if isinstance(col, int) or (isinstance(col, str) and col.lstrip("-").isdigit() and col not in names):
            if not -len(names) <= int(col) < len(names):
                raise InputFormatError(self.name, f"{what} {col}: the file has {len(names)} columns")
            return names[int(col)]
        if col not in names:
            raise InputFormatError(self.name, f"{what} {col!r} is not a column ({', '.join(names[:8])}"
                                              f"{', ...' if len(names) > 8 else ''})")
        return col

    def _first_length(self, pf: pq.ParquetFile) -> int:
        if not self.rows:
            raise InputFormatError(self.name, "no rows: cannot tell the dimension of a list column")
        first = next(pf.iter_batches(batch_size=1, columns=[self.list_col])).column(0)
        if first.null_count:
            raise InputFormatError(self.name, f"{self.list_col!r} is null", row=0)
        return len(first[0])

    @property
    def has_col_ids(self) -> bool:
        return self.id_col is not None

    def blocks(self) -> Iterator[Piece]:
        return rechunk(self._pieces(), self.rows_per_chunk())

    def _pieces(self) -> Iterator[Piece]:
        cols = self.value_cols + [c for c in (self.id_col, self.label_col) if c is not None]
        row = 0
        with pq.ParquetFile(self.path) as pf:
            for batch in pf.iter_batches(batch_size=self.rows_per_chunk(), columns=cols):
                X = self._list_values(batch, row) if self.list_col else self._column_values(batch, row)
                ids = None if self.id_col is None else self._ids(batch.column(self.id_col), row)
                meta = None
                if self.label_col is not None:
                    meta = [None if v is None else {"label": v} for v in batch.column(self.label_col).to_pylist()]
                end = row + batch.num_rows
                yield Piece(row, X, meta, ids, None, self.size_bytes * row // max(self.rows, 1),
                            self.size_bytes * end // max(self.rows, 1))
                row = end

    def _null(self, arr: pa.Array, row: int, problem: str) -> None:
        if arr.null_count:
            i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputFormatError(self.name, problem, row=row + i)

    def _column_values(self, batch: pa.RecordBatch, row: int) -> np.ndarray:
        cols = []
        for c in self.value_cols:
            self._null(batch.column(c), row, f"column {c!r} is null")
            cols.append(pc.cast(batch.column(c), self.work_type))
        return np.asarray(pa.RecordBatch.from_arrays(cols, self.value_cols).to_tensor(row_major=True))

    def _list_values(self, batch: pa.RecordBatch, row: int) -> np.ndarray:
        col = batch.column(self.list_col)
        self._null(col, row, f"{self.list_col!r} is null")
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != self.dim)
        if wrong.size:
            i = int(wrong[0])
            raise InputFormatError(self.name, f"{self.list_col!r} has {lengths[i]} values, expected {self.dim}",
                                   row=row + i)
        values = col.flatten()
        if values.null_count:
            i = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputFormatError(self.name, f"{self.list_col!r} holds a null value", row=row + i // self.dim)
        flat = pc.cast(values, self.work_type).to_numpy(zero_copy_only=False, writable=True)
        return flat.reshape(batch.num_rows, self.dim)

    def _ids(self, col: pa.Array, row: int) -> list[str]:
        self._null(col, row, "empty id")
        ids = pc.cast(col, pa.string()).to_pylist()
        if "" in ids:
            raise InputFormatError(self.name, "empty id", row=row + ids.index(""))
        return ids
