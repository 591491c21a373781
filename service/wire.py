"""The binary protocol between the router and the search nodes (``POST /internal/search``).

A call carries a batch of queries, each with its own knobs, and its answer carries each
query's neighbours. The vectors and similarities travel as raw little-endian arrays (no
JSON numbers either way); the few knobs and counts as a short orjson header.

Request::

    b"GMQ2" | u32 header bytes | header | vectors and codes

    header  {"epoch": int | null, "q": [[k, mode, min_similarity, candidates, probes,
             exclude, filter, nnz, ncodes], ...]}   (nnz −1: a dense query of dim float32
             values; else nnz int32 indices, then nnz float32 values; then ncodes uint16: the
             query's codes when the router hashed it, 0: none; exclude: an id to leave out)

Answer::

    b"GMR1" | u32 header bytes | header | f8 similarities | u4 name lengths | u4 metadata
    lengths | names (UTF-8) | metadata (JSON, empty: none)

    header  {"r": [[mode, candidates, n], ...], "epoch": int}   (n neighbours of each query, in
             order, best first; the arrays hold every query's neighbours one after another)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import orjson

from gmmlsh.index.records import SparseRow

REQUEST, ANSWER = b"GMQ2", b"GMR1"
#: The media type of both.
MEDIA = "application/x-gmmlsh-batch"
_HEAD = struct.Struct("<4sI")


class WireError(ValueError):
    """A body that is not this protocol (or not its version)."""


@dataclass(frozen=True)
class NodeQuery:
    """One query as a node answers it: a validated vector (float32 dense row, or a sparse row)
    and the knobs (``exclude``: an id to leave out of the answer — a query by id)."""

    vector: np.ndarray | SparseRow
    k: int
    mode: str = "auto"
    min_similarity: float = 0.0
    candidates: int | None = None
    probes: int | None = None
    exclude: str | None = None
    filter: dict | None = None
    #: The vector's b-bit codes (uint16, one per sample) when the router hashed it, so that no
    #: group's node hashes it again; None: the node hashes it if its search needs them.
    codes: np.ndarray | None = None

    def knobs(self) -> tuple:
        return (self.k, self.mode, self.min_similarity, self.candidates, self.probes, self.exclude,
                orjson.dumps(self.filter, option=orjson.OPT_SORT_KEYS) if self.filter is not None else None)


@dataclass
class NodeAnswer:
    """One query's answer from one node: its neighbours best first, exact similarities."""

    mode: str
    candidates: int
    similarities: np.ndarray  # float64
    names: list[str]
    metadata: list[bytes]  # JSON, b"" for none


def _framed(magic: bytes, header: dict, parts: list[bytes]) -> bytes:
    head = orjson.dumps(header)
    return b"".join([_HEAD.pack(magic, len(head)), head, *parts])


def _unframed(magic: bytes, body: bytes) -> tuple[dict, memoryview]:
    if len(body) < _HEAD.size:
        raise WireError("body too short for the gmmlsh batch protocol")
    got, n = _HEAD.unpack_from(body)
    if got != magic:
        raise WireError(f"not a gmmlsh batch ({got!r}; expected {magic!r})")
    view = memoryview(body)
    try:
        header = orjson.loads(view[_HEAD.size:_HEAD.size + n])
    except orjson.JSONDecodeError as exc:
        raise WireError(f"bad header: {exc}") from None
    return header, view[_HEAD.size + n:]


def encode_queries(queries: list[NodeQuery], epoch: int | None) -> bytes:
    rows, parts = [], []
    for q in queries:
        if isinstance(q.vector, SparseRow):
            nnz = int(q.vector.indices.shape[0])
            parts += [q.vector.indices.astype("<i4").tobytes(), q.vector.values.astype("<f4").tobytes()]
        else:
            nnz = -1
            parts.append(np.asarray(q.vector, dtype="<f4").tobytes())
        ncodes = 0 if q.codes is None else int(q.codes.shape[0])
        if ncodes:
            parts.append(np.asarray(q.codes, dtype="<u2").tobytes())
        rows.append([q.k, q.mode, q.min_similarity, q.candidates, q.probes, q.exclude, q.filter, nnz, ncodes])
    return _framed(REQUEST, {"epoch": epoch, "q": rows}, parts)


def decode_queries(body: bytes, dim: int) -> tuple[list[NodeQuery], int | None]:
    header, rest = _unframed(REQUEST, body)
    out, at = [], 0
    for k, mode, min_sim, candidates, probes, exclude, flt, nnz, ncodes in header["q"]:
        if nnz < 0:
            vec: np.ndarray | SparseRow = np.frombuffer(rest[at:at + 4 * dim], "<f4").astype(np.float32)
            at += 4 * dim
        else:
            idx = np.frombuffer(rest[at:at + 4 * nnz], "<i4").astype(np.int32)
            val = np.frombuffer(rest[at + 4 * nnz:at + 8 * nnz], "<f4").astype(np.float32)
            vec, at = SparseRow(idx, val, dim), at + 8 * nnz
        codes = np.frombuffer(rest[at:at + 2 * ncodes], "<u2").astype(np.uint16) if ncodes else None
        at += 2 * ncodes
        out.append(NodeQuery(vec, k, mode, min_sim, candidates, probes, exclude, flt, codes))
    if at != len(rest):
        raise WireError(f"the vectors take {at} bytes; the body holds {len(rest)}")
    return out, header.get("epoch")


def encode_answers(answers: list[NodeAnswer], epoch: int | None) -> bytes:
    sims = [np.asarray(a.similarities, dtype="<f8") for a in answers]
    names = [n.encode("utf-8") for a in answers for n in a.names]
    metas = [m for a in answers for m in a.metadata]
    header = {"r": [[a.mode, int(a.candidates), len(a.names)] for a in answers], "epoch": epoch}
    return _framed(ANSWER, header, [
        np.concatenate(sims).tobytes() if sims else b"",
        np.array([len(n) for n in names], "<u4").tobytes(), np.array([len(m) for m in metas], "<u4").tobytes(),
        b"".join(names), b"".join(metas)])


def decode_answers(body: bytes) -> tuple[list[NodeAnswer], int | None]:
    header, rest = _unframed(ANSWER, body)
    counts = [r[2] for r in header["r"]]
    total = sum(counts)
    sims = np.frombuffer(rest[:8 * total], "<f8")
    at = 8 * total
    nlen = np.frombuffer(rest[at:at + 4 * total], "<u4")
    mlen = np.frombuffer(rest[at + 4 * total:at + 8 * total], "<u4")
    at += 8 * total
    blob = bytes(rest[at:])
    out, i, pos = [], 0, 0
    nends = np.cumsum(nlen, dtype=np.int64)
    mends = nends[-1] + np.cumsum(mlen, dtype=np.int64) if total else nends
    if total and int(mends[-1]) != len(blob):
        raise WireError("the names and metadata do not fill the answer")
    for (mode, candidates, n) in header["r"]:
        names, metas = [], []
        for j in range(i, i + n):
            a = int(nends[j - 1]) if j else 0
            names.append(blob[a:int(nends[j])].decode("utf-8"))
            b = int(mends[j - 1]) if j else int(nends[-1])
            metas.append(blob[b:int(mends[j])])
        out.append(NodeAnswer(mode, candidates, sims[pos:pos + n], names, metas))
        i += n
        pos += n
    return out, header.get("epoch")
