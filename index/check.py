"""Integrity check of an index: everything a reader relies on, verified by a full scan.

**The store** (through its protocol, so both backends are checked alike): every id
of the id map names a whole record that names it back; every record decodes, carries
its true L1 norm, a sketch equal to a re-hash of its vector, JSON-object metadata and
NRFF features of the right size; no field outlives its record; the count equals the
scan. **The search mirror** of this machine, as it stands (the check writes nothing, so it runs
on a full disk too; a mirror behind the store is checked as of the store's state it follows,
and the records added since are counted, not reported): every live record has exactly one
live row holding the same vector, norm, sketch, name and metadata (and a coarse copy
encoding that vector), no live row belongs to a retired record, and the inverted lists
cover every listed live row once with its own first-stage row and bit planes. The mirror is
derived data: if it is damaged, delete its directory and it is rebuilt from the store.

Run it on a quiet index (or on a ``gmmlsh snapshot``): the reads are several
transactions or round trips, so a write landing between them can look like a problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import orjson

from gmmlsh.core.coarse import coarse_encode, coarse_sizes
from gmmlsh.core.codes import bit_planes, pack_codes, unpack_codes
from gmmlsh.core.ivf import FIRST_WORDS, first_rows, list_layout
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.mirror import View
from gmmlsh.index.records import as_hashed, codes_of, decode_rows, decode_vector, stored_payloads
from gmmlsh.index.store.base import FIELDS, Store

#: Stop listing problems of one kind after this many examples.
MAX_EXAMPLES = 10


@dataclass
class CheckReport:
    vectors: int = 0
    ids: int = 0
    mirror_rows: int = 0
    #: Live records written since the state the mirror follows (not in it yet: not problems).
    mirror_behind: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, example: str) -> None:
        items = self.problems.setdefault(kind, [])
        if len(items) < MAX_EXAMPLES:
            items.append(example)

    def summary(self) -> str:
        behind = (f" (the mirror is behind the store by {self.mirror_behind:,} vectors: not in it yet)"
                  if self.mirror_behind else "")
        head = f"{self.vectors:,} vectors, {self.ids:,} ids, {self.mirror_rows:,} mirror rows{behind}: "
        lines = [head + ("OK" if self.ok else f"{len(self.problems)} kind(s) of problem")]
        lines += [f"  {kind}: " + "; ".join(examples) for kind, examples in self.problems.items()]
        if any(k.startswith("mirror") for k in self.problems):
            lines.append("  (the mirror is derived data: delete its directory and it is rebuilt from the store)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "vectors": self.vectors, "ids": self.ids, "mirror_rows": self.mirror_rows,
                "mirror_behind": self.mirror_behind, "problems": self.problems}


def check_index(store: Store, cfg: IndexConfig, view: Callable[[], View] | None,
                batch_size: int = 4096) -> CheckReport:
    """Scan an index's ``store`` (of configuration ``cfg``) and then, when ``view`` is given, its
    search mirror as ``view()`` gives it after the scan — as it stands: the check writes nothing,
    and counts the vectors written since the mirror's state as ``mirror_behind``
    (:meth:`gmmlsh.index.index.Index.check` hands them over); report every inconsistency found."""
    rep = CheckReport()
    live = _check_records(store, cfg, rep, batch_size)
    _check_id_map(store, rep, live, batch_size)
    if view is not None:
        _check_mirror(store, cfg, view(), rep, live)
    return rep


def _check_records(store: Store, cfg: IndexConfig, rep: CheckReport, batch_size: int) -> dict[int, str]:
    """Every stored record; returns iid → name of the whole ones."""
    live: dict[int, str] = {}
    for iids, rec in store.scan(FIELDS, batch_size):
        whole = []
        for t, iid in enumerate(iids.tolist()):
            name, vec, sk = rec["name"][t], rec["vector"][t], rec["sketch"][t]
            if vec is None or name is None or sk is None:
                what = [f for f in ("name", "vector", "sketch") if rec[f][t] is not None] + \
                       [f for f in ("meta", "nrff") if rec[f][t] is not None]
                rep.add("partial record (a field without its record)", f"iid {iid} holds only {', '.join(what)}")
                continue
            why = _vector_problem(vec, cfg.dim)
            if why:
                rep.add("undecodable vector", f"iid {iid}: {why}")
                continue
            if len(sk) != cfg.sketch_bytes:
                rep.add("undecodable sketch", f"iid {iid}: {len(sk)} bytes, expected {cfg.sketch_bytes}")
                continue
            meta = rec["meta"][t]
            if meta is not None and not _is_object(meta):
                rep.add("metadata is not a JSON object", f"iid {iid}")
            nrff = rec["nrff"][t]
            if cfg.nrff_k and (nrff is None or len(nrff) != 4 * cfg.nrff_k):
                rep.add("missing or malformed NRFF features", f"iid {iid}")
            whole.append(t)
        rep.vectors += len(whole)
        if not whole:
            continue
        names = [rec["name"][t].decode("utf-8", "replace") for t in whole]
        back = store.lookup(names)
        for t, name, b in zip(whole, names, back.tolist(), strict=True):
            iid = int(iids[t])
            if b != iid:
                rep.add("record not named by the id map", f"{name!r} (iid {iid}; the id map says {b})")
            live[iid] = name
        X, norms = decode_rows([rec["vector"][t] for t in whole], cfg.dim)
        Xh = as_hashed(X, cfg)
        true = np.abs(Xh).sum(axis=1) if isinstance(Xh, np.ndarray) else np.asarray(abs(Xh).sum(axis=1)).ravel()
        for p in np.flatnonzero(~np.isclose(norms, true, rtol=1e-6, atol=0.0))[:MAX_EXAMPLES]:
            rep.add("stored L1 norm differs from the vector's", f"iid {int(iids[whole[p]])}")
        stored = np.frombuffer(b"".join(rec["sketch"][t] for t in whole), np.uint8).reshape(len(whole), -1)
        rehash = pack_codes(codes_of(Xh, cfg), cfg.bits)
        for p in np.flatnonzero((stored != rehash).any(axis=1))[:MAX_EXAMPLES]:
            rep.add("stored sketch differs from a re-hash of the stored vector", f"iid {int(iids[whole[p]])}")
    count = store.count()
    if count != rep.vectors:
        rep.add("count differs from a full scan", f"count() = {count}, scan found {rep.vectors}")
    return live


def _check_id_map(store: Store, rep: CheckReport, live: dict[int, str], batch_size: int) -> None:
    seen: dict[int, str] = {}
    for names, iids in store.scan_ids(batch_size):
        rep.ids += len(names)
        for name, iid in zip(names, iids.tolist(), strict=True):
            if iid not in live:
                rep.add("id without a record", f"{name!r} (iid {iid})")
            elif live[iid] != name:
                rep.add("id maps to another id's record", f"{name!r} → iid {iid} named {live[iid]!r}")
            if iid in seen:
                rep.add("two ids share one record", f"{seen[iid]!r} and {name!r} (iid {iid})")
            seen[iid] = name
    if rep.ids != rep.vectors:
        rep.add("count differs from the id map", f"{rep.vectors} records, {rep.ids} ids")


def _check_mirror(store: Store, cfg: IndexConfig, view: View, rep: CheckReport, live: dict[int, str]) -> None:
    added, retired = set(), set()  # since the state the mirror follows
    if view.token is None or tuple(view.token) != tuple(store.token()):
        since = store.changes(view.token)
        added, retired = set(since.added.tolist()), set(since.retired.tolist())
    rep.mirror_rows = view.rows
    alive_rows = view.live_rows()
    iids = view.iid[alive_rows].astype(np.int64)
    where: dict[int, int] = {}
    for r, iid in zip(alive_rows.tolist(), iids.tolist(), strict=True):
        if iid in where:
            rep.add("mirror: two live rows for one record", f"iid {iid} (rows {where[iid]}, {r})")
        where[iid] = r
        if iid not in live and iid not in retired:
            rep.add("mirror: live row of a retired or unknown record", f"row {r} (iid {iid})")
    for iid in live:
        if iid not in where:
            if iid in added:
                rep.mirror_behind += 1
            else:
                rep.add("mirror: record without a live row", f"iid {iid}")
    both = [(iid, r) for iid, r in where.items() if iid in live]
    for lo in range(0, len(both), 4096):
        part = both[lo:lo + 4096]
        rec = store.read(np.array([i for i, _ in part], dtype=np.int64), ["name", "vector", "sketch", "meta"])
        sk = np.frombuffer(b"".join(rec["sketch"]), np.uint8).reshape(len(part), -1)
        planes = bit_planes(unpack_codes(sk, cfg.samples, cfg.bits), cfg.bits)
        norms, payloads = stored_payloads(rec["vector"], cfg)
        for t, (iid, r) in enumerate(part):
            norm, payload = norms[t], payloads[t]
            off = int(view.voff[r])
            if view.norms[r] != norm or not np.array_equal(view.vi[off:off + payload.shape[0]].view(np.uint32),
                                                           payload):
                rep.add("mirror: vector differs from the store's", f"row {r} (iid {iid})")
            if not np.array_equal(view.planes[r], planes[t]):
                rep.add("mirror: sketch differs from the store's", f"row {r} (iid {iid})")
            if view.name(r) != rec["name"][t].decode("utf-8") or view.metadata(r) != rec["meta"][t]:
                rep.add("mirror: name or metadata differs from the store's", f"row {r} (iid {iid})")
    words = view.planes.shape[1] // cfg.bits
    if view.rows and not np.array_equal(view.first, first_rows(view.planes, words, cfg.bits)):
        rep.add("mirror: first-stage rows differ from the sketches", "rebuild the mirror")
    if view.rows:
        sizes = coarse_sizes(view.voff, view.vi, 0, view.rows)
        want = np.empty(int(sizes.sum()), np.uint8)
        coarse_encode(view.voff, view.vi, view.vf, view.norms, 0, view.rows, want)
        coff, cdata = view.row_bundle.coff, view.row_bundle.cdata
        if not (np.array_equal(coff[1:] - coff[:-1], sizes) and np.array_equal(cdata, want)):
            rep.add("mirror: coarse rows differ from the vectors", "rebuild the mirror")
    _check_segments(view, rep)


def _check_segments(view: View, rep: CheckReport) -> None:
    """The segments tile the listed rows, list every live one of them once, in range, and copy
    their rows' sketches; their postings name rows of their own."""
    if view.fit is None:
        return
    lists, post, nlist = view.lists, view.postings, view.fit.lists
    kept = lists.lplanes.shape[1]
    counts = np.zeros(view.rows, np.int64)
    end = 0
    for seg in view.segments:
        lo, hi, e0, n = seg["lo"], seg["hi"], seg["e"], seg["n"]
        where = f"segment of rows [{lo}, {hi})"
        if lo != end:
            rep.add("mirror: the segments do not tile the listed rows", where)
        end = hi
        listed = np.asarray(lists.lrows[e0:e0 + n], dtype=np.int64)
        starts = np.asarray(lists.lstarts[seg["ls"]:seg["ls"] + nlist + 1]) - e0
        if listed.shape[0] and (listed.min() < lo or listed.max() >= hi):
            rep.add("mirror: a segment lists a row outside it", where)
            continue
        if starts[0] != 0 or starts[-1] != n or (np.diff(starts) < 0).any():
            rep.add("mirror: a segment's list starts are out of order", where)
            continue
        counts += np.bincount(listed, minlength=view.rows)
        if not (np.array_equal(np.asarray(lists.lfirst[FIRST_WORDS * e0:FIRST_WORDS * (e0 + n)]),
                               list_layout(view.first[listed], starts))
                and np.array_equal(np.asarray(lists.lplanes[e0:e0 + n]), view.planes[listed, :kept])):
            rep.add("mirror: a list's copy of its rows' sketches differs from them", where)
        prows = np.asarray(post.prows[seg["p"]:seg["p"] + seg["np"]])
        if prows.shape[0] and (prows.min() < lo or prows.max() >= hi):
            rep.add("mirror: a segment's postings name a row outside it", where)
    for r in np.flatnonzero(counts > 1)[:MAX_EXAMPLES]:
        rep.add("mirror: a row listed twice", f"row {int(r)}")
    unlisted = np.flatnonzero((counts[:end] == 0) & (view.alive[:end] != 0))
    for r in unlisted[:MAX_EXAMPLES]:
        rep.add("mirror: a live row in no list", f"row {int(r)}")


def _vector_problem(blob: bytes, dim: int) -> str | None:
    try:
        _, kind, idx, val = decode_vector(blob)
    except ValueError as exc:
        return str(exc)
    if kind not in (0, 1, 2):
        return f"unknown kind {kind}"
    expected = 16 + 4 * val.shape[0] * (1 if idx is None else 2)
    if len(blob) != expected:
        return f"{len(blob)} bytes, expected {expected}"
    if idx is None and val.shape[0] != dim:
        return f"{val.shape[0]} values for dimension {dim}"
    if idx is not None and idx.shape[0] and (idx.min() < 0 or idx.max() >= dim or np.any(np.diff(idx) <= 0)):
        return "sparse indices out of range or not increasing"
    if not np.isfinite(val).all():
        return "non-finite value"
    return None


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False
