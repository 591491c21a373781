"""Integrity check of a stored index: everything a reader relies on, verified by a full scan.

Every id of the id map has a live vector that names it back; every vector blob
decodes, carries its true L1 norm, has a sketch equal to a re-hash of it and
exactly its L bucket entries; no bucket entry points at an unknown iid or
repeats; no sketch/metadata/NRFF blob outlives its vector; metadata is JSON;
the count equals the scan. Bucket entries are compared as sorted fixed-width
records (band key + iid), so millions of entries need no Python set.

Run it on a quiet index (or on a ``gmmlsh snapshot``): the reads are several
transactions / round trips, so a write landing between them can look like a
problem.

Redis keeps a write-ahead journal (see :mod:`index.redis_store`): a writer that
died mid-batch leaves *pending attempts* and *dead iids* whose bucket entries
may still exist. Readers never see them (the record is not committed, or is
retired), so the check counts them as ``leftovers`` rather than problems; the
next write to their shard, or :meth:`RedisStore.collect_garbage` (``gmmlsh
check --collect-garbage``), removes them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import orjson
from gmmlsh.core.gmm import l1_norms
from gmmlsh.index import codec

#: Stop listing problems of one kind after this many examples.
MAX_EXAMPLES = 10
_PEND = struct.Struct("<IIH")


@dataclass
class CheckReport:
    vectors: int = 0
    ids: int = 0
    bucket_entries: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)
    #: Redis: bucket entries of journaled (uncommitted or retired) iids, invisible to readers.
    leftovers: int = 0
    #: Redis: what the write-ahead journal holds (pending attempts, dead iids).
    journal: dict[str, int] = field(default_factory=dict)
    #: What garbage collection removed before the check, when asked for.
    collected: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, example: str) -> None:
        items = self.problems.setdefault(kind, [])
        if len(items) < MAX_EXAMPLES:
            items.append(example)

    def summary(self) -> str:
        head = f"{self.vectors:,} vectors, {self.ids:,} ids, {self.bucket_entries:,} bucket entries: "
        lines = [head + ("OK" if self.ok else f"{len(self.problems)} kind(s) of problem")]
        for kind, examples in self.problems.items():
            lines.append(f"  {kind}: " + "; ".join(examples))
        if self.collected is not None:
            lines.append("  garbage collected first: " + ", ".join(f"{k} {v}" for k, v in self.collected.items()))
        if self.leftovers or any(self.journal.values()):
            lines.append(
                f"  note: {self.leftovers:,} bucket entries of interrupted or retired writes "
                f"(journal: {', '.join(f'{k} {v}' for k, v in self.journal.items())}); invisible to queries, "
                "removed by the next write to their shard or by `gmmlsh check --collect-garbage`"
            )
        return "\n".join(lines)


def _records(keys: np.ndarray, iids: np.ndarray) -> np.ndarray:
    """(n, key_bytes) keys + iids → sortable fixed-width byte records."""
    n, kb = keys.shape
    rec = np.empty((n, kb + 4), dtype=np.uint8)
    rec[:, :kb] = keys
    rec[:, kb:] = iids.astype(">u4").view(np.uint8).reshape(n, 4)
    return np.ascontiguousarray(rec).view(f"V{kb + 4}").ravel()


def _blob_ok(blob: bytes, dim: int, storage: str) -> str | None:
    """Why a vector blob cannot be what an upsert wrote, or None."""
    if storage == "dense":
        want = codec.dense_dtype(dim).itemsize
        return None if len(blob) == want else f"{len(blob)} bytes, expected {want}"
    if len(blob) < 12:
        return f"{len(blob)} bytes, shorter than a sparse header"
    nnz = int(np.frombuffer(blob, "<u4", 1, 8)[0])
    if len(blob) != 12 + 8 * nnz:
        return f"{len(blob)} bytes for {nnz} nonzeros"
    idx = np.frombuffer(blob, "<u4", nnz, 12)
    if nnz and (int(idx[-1]) >= dim or np.any(np.diff(idx.astype(np.int64)) <= 0)):
        return "sparse indices out of order or out of range"
    return None


def scan_ids(store) -> Iterator[tuple[list[str], np.ndarray]]:
    """Every (external id, iid) of the store's id map, in chunks.

    LMDB has :meth:`LmdbStore.scan_ids`; for Redis the shard id hashes are read
    with HSCAN (the store's key layout, see :mod:`index.redis_store`).
    """
    own = getattr(store, "scan_ids", None)
    if own is not None:
        yield from own()
        return
    if type(store).__name__ != "RedisStore":
        raise TypeError(f"check: cannot list the ids of a {type(store).__name__}")
    from redis.exceptions import RedisError

    try:
        lay = store._get_layout(create=False)
        if lay is None:
            return
        r = store._r()
        for s in range(lay["shards"]):
            names, iids = [], []
            for k, v in r.hscan_iter(store._shard_keys(s)[0], count=1000):
                names.append(k.decode("utf-8", errors="replace"))
                iids.append(int(v))
            if names:
                yield names, np.array(iids, dtype=np.int64)
    except (RedisError, OSError) as e:
        raise store._translate(e) from None


def redis_journal(store) -> tuple[dict[str, int], np.ndarray]:
    """Redis: sizes of the write-ahead journal and every iid it names (pending or dead).

    Empty for other backends (an LMDB batch is one transaction: nothing to journal).
    """
    if type(store).__name__ != "RedisStore":
        return {}, np.zeros(0, np.int64)
    from redis.exceptions import RedisError

    try:
        lay = store._get_layout(create=False)
        if lay is None:
            return {"pending_attempts": 0, "dead_iids": 0}, np.zeros(0, np.int64)
        shards = range(lay["shards"])
        pends = store._pipeline([("HGETALL", store._shard_keys(s)[1]) for s in shards])
        gcs = store._pipeline([("HKEYS", store._shard_keys(s)[2]) for s in shards])
    except (RedisError, OSError) as e:
        raise store._translate(e) from None
    iids: list[int] = []
    attempts = 0
    for p in pends:
        for raw in p.values():
            o = 0
            while o + _PEND.size <= len(raw):
                iid, _, n = _PEND.unpack_from(raw, o)
                iids.append(iid)
                attempts += 1
                o += _PEND.size + n
    dead = [int(k) for g in gcs for k in g]
    return {"pending_attempts": attempts, "dead_iids": len(dead)}, np.array(iids + dead, dtype=np.int64)


def check_index(index, batch_size: int = 4096, collect_garbage: float | None = None) -> CheckReport:
    """Scan ``index`` (an :class:`index.index.Index`) and report every inconsistency found.

    ``collect_garbage``: on Redis, first cancel write attempts journaled more
    than this many seconds ago and remove the bucket entries of dead iids
    (:meth:`RedisStore.collect_garbage`; 0 is safe only when no writer runs).
    """
    store, cfg, banding = index.store, index.config, index.banding
    rep = CheckReport()
    gc = getattr(store, "collect_garbage", None)
    if collect_garbage is not None and gc is not None:
        rep.collected = gc(banding.keys_from_sketches, pending_older_than=collect_garbage)
    rep.journal, journaled = redis_journal(store)

    live_parts, expected_parts = [], []
    for iids, blobs in store.scan("vector", batch_size):
        rep.vectors += iids.shape[0]
        live_parts.append(iids)
        sketches = store.fetch(iids, "sketch")
        names = store.external_ids(iids)
        named = [n for n in names if n is not None]
        back = iter(store.lookup(named).tolist() if named else [])
        for i, name in zip(iids, names, strict=True):
            if name is None:
                rep.add("vector without an id", f"iid {int(i)}")
            elif next(back) != int(i):
                rep.add("id does not map back to its vector", f"{name!r} (iid {int(i)})")
        metas = store.fetch(iids, "meta")
        for i, m in zip(iids, metas, strict=True):
            if m is not None:
                try:
                    if not isinstance(orjson.loads(m), dict):
                        raise ValueError("not an object")
                except (orjson.JSONDecodeError, ValueError):
                    rep.add("metadata is not a JSON object", f"iid {int(i)}")
        keep = np.ones(iids.shape[0], dtype=bool)
        for t, (i, b, s) in enumerate(zip(iids, blobs, sketches, strict=True)):
            why = _blob_ok(b, cfg.dim, cfg.storage)
            if why is not None:
                rep.add("undecodable vector blob", f"iid {int(i)}: {why}")
                keep[t] = False
            elif s is None:
                rep.add("vector without a sketch", f"iid {int(i)}")
                keep[t] = False
            elif len(s) != cfg.sketch_bytes:
                rep.add("undecodable sketch blob", f"iid {int(i)}: {len(s)} bytes, expected {cfg.sketch_bytes}")
                keep[t] = False
        if not keep.all():
            iids = iids[keep]
            blobs = [b for b, k in zip(blobs, keep, strict=True) if k]
            sketches = [s for s, k in zip(sketches, keep, strict=True) if k]
        if not iids.shape[0]:
            continue
        X, norms = (codec.decode_dense if cfg.storage == "dense" else codec.decode_sparse)(blobs, cfg.dim)
        true_norms = l1_norms(index._hashable(X))
        bad = np.flatnonzero(~np.isclose(norms, true_norms, rtol=1e-12, atol=0.0))
        for b in bad[:MAX_EXAMPLES]:
            rep.add("stored L1 norm differs from the vector's", f"iid {int(iids[b])}")
        stored = np.frombuffer(b"".join(sketches), np.uint8).reshape(iids.shape[0], -1)
        rehash = index.sketch_stored(blobs)
        bad = np.flatnonzero((stored != rehash).any(axis=1))
        for b in bad[:MAX_EXAMPLES]:
            rep.add("stored sketch differs from a re-hash of the stored vector", f"iid {int(iids[b])}")
        keys = banding.keys_from_sketches(stored)  # the entries the stored sketch promises
        expected_parts.append(_records(keys.reshape(-1, banding.key_bytes), np.repeat(iids, cfg.bands)))
    live = np.concatenate(live_parts) if live_parts else np.zeros(0, np.int64)
    count = store.count()
    if count != rep.vectors:
        rep.add("count differs from a full scan", f"count() = {count}, scan found {rep.vectors}")
    if np.unique(live).shape[0] != live.shape[0]:
        rep.add("iid listed twice", "scan returned a repeated iid")

    # The id map, from its own side: an id whose vector is gone is invisible to the scan above.
    id_iids = []
    for names, iids in scan_ids(store):
        rep.ids += len(names)
        id_iids.append(iids)
        gone = ~np.isin(iids, live)
        for p in np.flatnonzero(gone)[:MAX_EXAMPLES]:
            rep.add("id without a vector", f"{names[p]!r} (iid {int(iids[p])})")
    all_ids = np.concatenate(id_iids) if id_iids else np.zeros(0, np.int64)
    uniq, times = np.unique(all_ids, return_counts=True)
    for i in uniq[times > 1][:MAX_EXAMPLES]:
        rep.add("two ids share one vector", f"iid {int(i)}")
    if rep.ids != count:
        rep.add("count differs from the id map", f"count() = {count}, {rep.ids} ids")

    # Blobs that outlived their vector (a half-done retire would leave them).
    for fld in ("sketch", "meta", "nrff"):
        for iids, _ in store.scan(fld, batch_size):
            for i in iids[~np.isin(iids, live)][:MAX_EXAMPLES]:
                rep.add(f"{fld} blob without a vector", f"iid {int(i)}")

    found_parts = []
    for key, members in store.scan_buckets():
        rep.bucket_entries += members.shape[0]
        keys = np.frombuffer(key, np.uint8)[None, :].repeat(members.shape[0], axis=0)
        found_parts.append(_records(keys, members.astype(np.int64)))
    expected = np.sort(np.concatenate(expected_parts)) if expected_parts else np.zeros(0, "V1")
    found = np.sort(np.concatenate(found_parts)) if found_parts else np.zeros(0, expected.dtype)
    if found.shape[0] and np.any(found[1:] == found[:-1]):
        rep.add("duplicate bucket entry", f"{int((found[1:] == found[:-1]).sum())} repeats")
        found = np.unique(found)
    if found.dtype == expected.dtype:
        extra = np.setdiff1d(found, expected, assume_unique=True)
        lost = np.setdiff1d(expected, found, assume_unique=True)
    else:  # an empty side
        extra, lost = found, expected
    kb = banding.key_bytes
    if extra.shape[0] and journaled.shape[0]:
        extra_iids = extra.view(np.uint8).reshape(-1, kb + 4)[:, kb:].copy().view(">u4").ravel().astype(np.int64)
        known = np.isin(extra_iids, journaled) & ~np.isin(extra_iids, live)
        rep.leftovers = int(known.sum())
        extra = extra[~known]
    for kind, recs in (("bucket entry for an unknown or retired vector", extra), ("missing bucket entry", lost)):
        if recs.shape[0]:
            raw = recs[:MAX_EXAMPLES].view(np.uint8).reshape(-1, kb + 4)
            ex = [f"band {int(r[0]) * 256 + int(r[1])} iid {int(r[kb:].view('>u4')[0])}" for r in raw]
            rep.add(kind, f"{recs.shape[0]} in all, e.g. " + ", ".join(ex))
    return rep
