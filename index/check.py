"""Integrity check of a stored index: everything a reader relies on, verified by a full scan.

Every live id has a vector, a sketch and exactly its L bucket entries; no bucket
entry points at an unknown iid or repeats; the count equals the scan; stored
sketches equal a re-hash of the stored vectors. Bucket entries are compared as
sorted fixed-width records (band key + iid), so millions of entries need no
Python set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Stop listing problems of one kind after this many examples.
MAX_EXAMPLES = 10


@dataclass
class CheckReport:
    vectors: int = 0
    bucket_entries: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, example: str) -> None:
        items = self.problems.setdefault(kind, [])
        if len(items) < MAX_EXAMPLES:
            items.append(example)

    def summary(self) -> str:
        head = f"{self.vectors:,} vectors, {self.bucket_entries:,} bucket entries: "
        if self.ok:
            return head + "OK"
        lines = [head + f"{len(self.problems)} kind(s) of problem"]
        for kind, examples in self.problems.items():
            lines.append(f"  {kind}: " + "; ".join(examples))
        return "\n".join(lines)


def _records(keys: np.ndarray, iids: np.ndarray) -> np.ndarray:
    """(n, key_bytes) keys + iids → sortable fixed-width byte records."""
    n, kb = keys.shape
    rec = np.empty((n, kb + 4), dtype=np.uint8)
    rec[:, :kb] = keys
    rec[:, kb:] = iids.astype(">u4").view(np.uint8).reshape(n, 4)
    return np.ascontiguousarray(rec).view(f"V{kb + 4}").ravel()


def check_index(index, batch_size: int = 4096) -> CheckReport:
    """Scan ``index`` (an :class:`index.index.Index`) and report every inconsistency found."""
    store, cfg, banding = index.store, index.config, index.banding
    rep = CheckReport()
    live_parts, expected_parts = [], []
    for iids, blobs in store.scan("vector", batch_size):
        rep.vectors += iids.shape[0]
        live_parts.append(iids)
        sketches = store.fetch(iids, "sketch")
        missing = [int(i) for i, s in zip(iids, sketches, strict=True) if s is None]
        for i in missing:
            rep.add("vector without a sketch", f"iid {i}")
        names = store.external_ids(iids)
        named = [n for n in names if n is not None]
        back = iter(store.lookup(named).tolist() if named else [])
        for i, name in zip(iids, names, strict=True):
            if name is None:
                rep.add("vector without an id", f"iid {int(i)}")
            elif next(back) != int(i):
                rep.add("id does not map back to its vector", f"{name!r} (iid {int(i)})")
        if missing:
            keep = np.array([s is not None for s in sketches])
            iids = iids[keep]
            blobs = [b for b, k in zip(blobs, keep, strict=True) if k]
            sketches = [s for s in sketches if s is not None]
        if not iids.shape[0]:
            continue
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
    for kind, recs in (("bucket entry for an unknown or retired vector", extra), ("missing bucket entry", lost)):
        if recs.shape[0]:
            raw = recs[:MAX_EXAMPLES].view(np.uint8).reshape(-1, kb + 4)
            ex = [f"band {int(r[0]) * 256 + int(r[1])} iid {int(r[kb:].view('>u4')[0])}" for r in raw]
            rep.add(kind, f"{recs.shape[0]} in all, e.g. " + ", ".join(ex))
    return rep
