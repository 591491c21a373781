"""Upsert bodies as Arrow IPC streams (``Content-Type: application/vnd.apache.arrow.stream``).

Why: JSON spells every number in decimal, and the server turns each into a Python float:
a batch of 500 rows of 784 values (1.9 MB) costs a worker 30–70 ms of its one interpreter
lock, during which its queries wait. An Arrow stream carries the same rows as raw arrays,
read in place from the body (~0.2 ms), and goes through the same checks as JSON after that.

The stream holds one schema and its record batches, uncompressed (HTTP can compress the
body), with these columns:

``id``        string or integer, no nulls
``values``    list (or fixed-size list) of numbers: a dense row's ``dim`` values, or a sparse
              row's nonzero values
``indices``   optional, list of integers: a sparse row's positions (strictly increasing);
              null for a dense row
``metadata``  optional, string: a JSON object, or null

An error names the field as the JSON body would (``vectors[3].values``), or the column.
"""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pyarrow as pa

from gmmlsh.service.errors import ApiError

MEDIA = "application/vnd.apache.arrow.stream"
COLUMNS = ("id", "values", "indices", "metadata")

#: The Arrow message header type of a record batch (``MessageHeader`` in Arrow's Message.fbs).
_RECORD_BATCH = 3


def read_table(body: bytes) -> pa.Table:
    """The body's rows as a table whose buffers are the body's own bytes. Compressed batches
    are refused before they are read: a few MB could otherwise declare gigabytes."""
    schema, batches = None, []
    try:
        for message in pa.ipc.MessageReader.open_stream(pa.py_buffer(body)):
            if message.type == "schema" and schema is None:
                schema = pa.ipc.read_schema(message)
            elif message.type == "record batch" and schema is not None:
                if _compressed(message.metadata.to_pybytes()):
                    raise ApiError(422, "compressed Arrow record batches are not taken: send the stream "
                                   "uncompressed (compress the HTTP body instead)", field="body")
                batch = pa.ipc.read_record_batch(message, schema)
                batch.validate(full=True)  # offsets, lengths, UTF-8: no read below may run past the body
                batches.append(batch)
            else:
                raise ApiError(422, f"expected an Arrow stream of one schema and its record batches, found a "
                               f"{message.type} message", field="body")
        names = schema.names if schema is not None else []
    except (pa.ArrowException, OSError, ValueError, struct.error, IndexError) as exc:
        raise ApiError(422, f"not a readable Arrow IPC stream: {exc}", field="body") from None
    if schema is None:
        raise ApiError(422, "an empty Arrow stream: no schema", field="body")
    unknown = [name for name in names if name not in COLUMNS]
    if unknown:
        raise ApiError(422, f"unknown column {unknown[0]!r}; the columns are {', '.join(COLUMNS)}", field=unknown[0])
    if len(set(names)) != len(names):
        raise ApiError(422, "a column is named twice", field="body")
    for name in ("id", "values"):
        if name not in names:
            raise ApiError(422, f"the column {name!r} is required", field=name)
    return pa.Table.from_batches(batches, schema)


def rows_of(table: pa.Table) -> tuple[list[str], list, list[dict | None] | None]:
    """(ids, rows, metadata) of a table from :func:`read_table`, as the index takes them
    (:meth:`~gmmlsh.index.index.Index.prepare_rows`): each row a dense array, or an
    ``(indices, values)`` pair where ``indices`` is given."""
    n = table.num_rows
    ids = _ids(table.column("id").combine_chunks())
    values = _lists(table.column("values").combine_chunks(), "values", "numbers", n)
    if "indices" in table.column_names:
        indices = _lists(table.column("indices").combine_chunks(), "indices", "integers", n, nulls=True)
    else:
        indices = None
    rows = [values[i] if indices is None or indices[i] is None else (indices[i], values[i]) for i in range(n)]
    meta = _metadata(table.column("metadata").combine_chunks()) if "metadata" in table.column_names else None
    return ids, rows, meta


def _ids(col: pa.Array) -> list[str]:
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_integer(col.type)):
        raise ApiError(422, f"ids are strings or integers, not {col.type}", field="id")
    if col.null_count:
        raise ApiError(422, "an id is null", field=f"vectors[{_first_null(col)}].id")
    return [str(i) for i in col.to_pylist()]


def _lists(col: pa.Array, name: str, kind: str, n: int, nulls: bool = False) -> list[np.ndarray | None]:
    """Each row's list as a numpy array read in place (None for a null row where ``nulls``)."""
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
            or pa.types.is_fixed_size_list(col.type)):
        raise ApiError(422, f"{name}: a list of {kind} a row, not {col.type}", field=name)
    item = col.type.value_type
    wanted = pa.types.is_integer(item) if kind == "integers" else (pa.types.is_integer(item)
                                                                    or pa.types.is_floating(item))
    if not wanted:
        raise ApiError(422, f"{name}: {kind}, not {item}", field=name)
    if col.null_count and not nulls:
        raise ApiError(422, f"a row's {name} is null", field=f"vectors[{_first_null(col)}].{name}")
    child = col.values  # the whole child array: the offsets below point into it
    if child.null_count:
        raise ApiError(422, f"{name}: null is not a number", field=name)
    data = child.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(col.type):
        offsets = (col.offset + np.arange(n + 1, dtype=np.int64)) * col.type.list_size
    else:
        offsets = col.offsets.to_numpy().astype(np.int64, copy=False)
    valid = col.is_valid().to_numpy(zero_copy_only=False) if col.null_count else None
    return [None if valid is not None and not valid[i] else data[offsets[i]:offsets[i + 1]] for i in range(n)]


def _metadata(col: pa.Array) -> list[dict | None]:
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise ApiError(422, f"metadata: a JSON object as a string a row, not {col.type}", field="metadata")
    out: list[dict | None] = []
    for i, text in enumerate(col.to_pylist()):
        if text is None:
            out.append(None)
            continue
        try:
            meta = orjson.loads(text)
        except orjson.JSONDecodeError:
            raise ApiError(422, "not valid JSON", field=f"vectors[{i}].metadata") from None
        if not isinstance(meta, dict):
            raise ApiError(422, "a JSON object is expected", field=f"vectors[{i}].metadata")
        out.append(meta)
    return out


def _first_null(col: pa.Array) -> int:
    return int(np.flatnonzero(~col.is_valid().to_numpy(zero_copy_only=False))[0])


def _compressed(meta: bytes) -> bool:
    """Whether a record batch message (its flatbuffer metadata: Arrow's Message.fbs) says its
    buffers are compressed: the ``compression`` field (the 4th) of its ``RecordBatch`` table."""

    def fields(pos: int):
        vtable = pos - struct.unpack_from("<i", meta, pos)[0]
        size = struct.unpack_from("<H", meta, vtable)[0]
        return lambda i: struct.unpack_from("<H", meta, vtable + 4 + 2 * i)[0] if 4 + 2 * i < size else 0

    root = struct.unpack_from("<I", meta, 0)[0]
    message = fields(root)
    if not message(1) or not message(2) or meta[root + message(1)] != _RECORD_BATCH:
        return False
    at = root + message(2)
    header = at + struct.unpack_from("<I", meta, at)[0]
    return fields(header)(3) != 0
