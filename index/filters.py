"""Metadata filters: Qdrant's shape, compiled to a row mask over the search mirror.

A filter is ``{"must": [...], "should": [...], "must_not": [...]}`` (every ``must``
condition, at least one ``should`` condition if there are any, no ``must_not`` one); a
condition is a nested filter or one of::

    {"key": "label", "match": {"value": 3}}          # equality (string, number or boolean)
    {"key": "label", "match": {"any": [1, 2]}}       # one of
    {"key": "price", "range": {"gte": 1, "lt": 5}}   # numeric range (gt, gte, lt, lte)
    {"key": "note", "exists": true}                  # the key is there, not null (false: absent)

A key names a top-level metadata field, or a nested one by a dotted path (``a.b``). A
list value matches when any of its elements does.

Evaluation reads per-field columns (:class:`MetaColumns`), built from the mirror's metadata
column once per process and extended as rows are added (a row's metadata never changes:
an upsert is a new row), so a filter costs a few vectorised passes over the rows. For the
fields declared *indexed* when a collection is created, the columns are built at start and
also hold a value → rows list, so that an equality on them yields its rows without a pass.
The result is a mask the search kernels take as their live flags (:mod:`gmmlsh.index.filtered`):
filtering happens inside the search, not after it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from gmmlsh.core.validate import VectorError

_RANGE_OPS = ("gt", "gte", "lt", "lte")
_LOGIC = ("must", "should", "must_not")


class FilterError(VectorError):
    """A malformed filter, or one that does not fit the stored values (422, naming the field)."""


# --- compiling ---------------------------------------------------------------------------------


def _scalar(v: Any, where: str) -> tuple:
    """A match value as its column key: numbers compare by value (3 == 3.0), booleans apart."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int | float) and not isinstance(v, bool):
        return ("n", _number(v, where, "must be a finite number, a string or a boolean"))
    if isinstance(v, str):
        return ("s", v)
    raise FilterError(where, f"must be a string, a number or a boolean, got {type(v).__name__}")


def _number(v: Any, where: str, reason: str) -> float:
    """``v`` as a float, if it is a finite number (an integer beyond float's range is not)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise FilterError(where, reason)
    try:
        x = float(v)
    except OverflowError:
        raise FilterError(where, reason) from None
    if not math.isfinite(x):
        raise FilterError(where, reason)
    return x


_KIND = {"b": "booleans", "n": "numbers", "s": "strings"}


@dataclass(frozen=True)
class Cond:
    """One condition on one key."""

    key: str
    op: str  # "match", "range", "exists"
    values: tuple = ()  # match: column keys; range: (gt, gte, lt, lte) with None where absent
    exists: bool = True
    where: str = ""


@dataclass(frozen=True)
class Filter:
    """A compiled filter: apply it with :meth:`mask`."""

    must: tuple = ()
    should: tuple = ()
    must_not: tuple = ()
    where: str = "filter"

    def keys(self) -> set[str]:
        out: set[str] = set()
        for c in (*self.must, *self.should, *self.must_not):
            out |= c.keys() if isinstance(c, Filter) else {c.key}
        return out

    def mask(self, cols: Columns) -> np.ndarray:
        """Rows (of ``cols``) that pass, as a bool array."""
        n = cols.rows
        out = np.ones(n, dtype=bool)
        for c in self.must:
            out &= _eval(c, cols)
        if self.should:
            any_ = np.zeros(n, dtype=bool)
            for c in self.should:
                any_ |= _eval(c, cols)
            out &= any_
        for c in self.must_not:
            out &= ~_eval(c, cols)
        return out

    def posting_rows(self, cols: Columns) -> np.ndarray | None:
        """The passing rows straight from an indexed field's value → rows lists, when the
        filter is one equality (or ``any``) on an indexed field; else None."""
        conds = self.must if not self.should and not self.must_not else ()
        if len(conds) != 1 or not isinstance(conds[0], Cond) or conds[0].op != "match":
            return None
        col = cols.field(conds[0].key)
        if not col.indexed:
            return None
        rows = col.rows_with(conds[0].values, cols.rows)
        _check_kind(conds[0], col, cols, bool(cols.alive[rows].any()))
        return rows


def compile_filter(spec: Any, where: str = "filter") -> Filter:
    """Check a filter's shape (every problem names its place, e.g. ``filter.must[1].range.gt``)
    and compile it."""
    if not isinstance(spec, dict):
        raise FilterError(where, "must be an object with must / should / must_not lists of conditions")
    extra = set(spec) - set(_LOGIC)
    if extra:
        raise FilterError(f"{where}.{sorted(extra)[0]}", "unknown clause; expected must, should or must_not")
    parts = {}
    for clause in _LOGIC:
        conds = spec.get(clause, [])
        if isinstance(conds, dict):
            conds = [conds]
        if not isinstance(conds, list):
            raise FilterError(f"{where}.{clause}", "must be a list of conditions")
        parts[clause] = tuple(_condition(c, f"{where}.{clause}[{i}]") for i, c in enumerate(conds))
    return Filter(parts["must"], parts["should"], parts["must_not"], where)


def _condition(c: Any, where: str):
    if isinstance(c, dict) and "key" not in c and set(c) & set(_LOGIC):
        return compile_filter(c, where)
    if not isinstance(c, dict):
        raise FilterError(where, "must be an object: a condition on a key, or a nested filter")
    key = c.get("key")
    if not isinstance(key, str) or not key:
        raise FilterError(f"{where}.key", "must be a non-empty string naming a metadata field")
    ops = [o for o in ("match", "range", "exists") if o in c]
    extra = set(c) - {"key", "match", "range", "exists"}
    if extra:
        raise FilterError(f"{where}.{sorted(extra)[0]}", "unknown field; a condition has key and one of "
                          "match, range, exists")
    if len(ops) != 1:
        raise FilterError(where, "give exactly one of match, range, exists")
    op = ops[0]
    body = c[op]
    if op == "exists":
        if not isinstance(body, bool):
            raise FilterError(f"{where}.exists", "must be true or false")
        return Cond(key, "exists", exists=body, where=where)
    if op == "match":
        if not isinstance(body, dict) or len(body) != 1 or not set(body) <= {"value", "any"}:
            raise FilterError(f"{where}.match", "must be {\"value\": v} or {\"any\": [v, ...]}")
        if "value" in body:
            return Cond(key, "match", (_scalar(body["value"], f"{where}.match.value"),), where=where)
        if not isinstance(body["any"], list) or not body["any"]:
            raise FilterError(f"{where}.match.any", "must be a non-empty list of values")
        return Cond(key, "match", tuple(_scalar(v, f"{where}.match.any[{i}]") for i, v in enumerate(body["any"])),
                    where=where)
    if not isinstance(body, dict) or not body or set(body) - set(_RANGE_OPS):
        raise FilterError(f"{where}.range", "must be an object of gt, gte, lt, lte bounds")
    bounds = [None if body.get(o) is None else _number(body[o], f"{where}.range.{o}", "must be a finite number")
              for o in _RANGE_OPS]
    return Cond(key, "range", tuple(bounds), where=where)


def _check_kind(c: Cond, col: FieldColumn, cols: Columns, found: bool) -> None:
    """A condition on values of a type the field does not hold is a mistake: say so (422). The
    types are those of the live rows' values (``found``: a live row passes the condition, so
    its type is there; only when none does are the live rows' types worked out)."""
    if found:
        return
    kinds = col.live_kinds(cols.alive)
    if not kinds:
        return
    if c.op == "range" and "n" not in kinds:
        raise FilterError(f"{c.where}.range", f"field {c.key!r} holds {_kinds(kinds)}, not numbers")
    if c.op == "match" and not {v[0] for v in c.values} & kinds:
        raise FilterError(f"{c.where}.match", f"field {c.key!r} holds {_kinds(kinds)}; the filter gives "
                          + ", ".join(sorted({_KIND[v[0]] for v in c.values})))


def _kinds(kinds: set[str]) -> str:
    return " and ".join(sorted(_KIND.get(k, "objects") for k in kinds))


def _eval(c, cols: Columns) -> np.ndarray:
    if isinstance(c, Filter):
        return c.mask(cols)
    col = cols.field(c.key)
    if c.op == "exists":
        return col.present[:cols.rows].astype(bool) if c.exists else ~col.present[:cols.rows].astype(bool)
    out = col.matches(c.values, cols.rows) if c.op == "match" else col.in_range(c.values, cols.rows)
    _check_kind(c, col, cols, bool(np.logical_and(out, cols.alive).any()))
    return out


# --- columns -------------------------------------------------------------------------------------


def _get(meta: dict, key: str) -> Any:
    if key in meta:
        return meta[key]
    node: Any = meta
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@dataclass
class FieldColumn:
    """One metadata field over the mirror's rows: presence, numeric value, value code."""

    key: str
    indexed: bool = False
    present: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    num: np.ndarray = field(default_factory=lambda: np.zeros(0))
    code: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    vocab: dict = field(default_factory=dict)  # column key (kind, value) → code
    multi: dict = field(default_factory=dict)  # row → codes of a list value's scalars
    multi_num: dict = field(default_factory=dict)  # row → numbers of a list value
    kinds: set = field(default_factory=set)  # of every value seen, live or not
    code_kind: list = field(default_factory=list)  # code → its kind
    _postings: tuple | None = None  # (rows sorted by code, code starts), for indexed fields

    def grow(self, n: int) -> None:
        if self.present.shape[0] >= n:
            return
        cap = max(n, 2 * self.present.shape[0], 1024)
        for name, fill in (("present", 0), ("num", np.nan), ("code", -1)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype)
            new[:old.shape[0]] = old
            setattr(self, name, new)

    def put(self, row: int, value: Any) -> None:
        if value is None:
            return
        self.present[row] = 1
        if isinstance(value, list):
            codes, nums = [], []
            for v in value:
                k = self._key(v)
                if k is not None:
                    codes.append(self._code(k))
                    if k[0] == "n":
                        nums.append(k[1])
            self.multi[row], self.multi_num[row] = codes, nums
            return
        k = self._key(value)
        if k is None:
            self.kinds.add("o")
            return
        self.code[row] = self._code(k)
        if k[0] == "n":
            self.num[row] = k[1]

    def _key(self, v: Any) -> tuple | None:
        if isinstance(v, bool):
            k = ("b", v)
        elif isinstance(v, int | float):
            try:
                k = ("n", float(v))
            except OverflowError:  # an integer beyond float's range: not comparable as a number
                return None
        elif isinstance(v, str):
            k = ("s", v)
        else:
            return None
        self.kinds.add(k[0])
        return k

    def _code(self, k: tuple) -> int:
        c = self.vocab.get(k)
        if c is None:
            c = self.vocab[k] = len(self.vocab)
            self.code_kind.append(k[0])
            self._postings = None
        return c

    def live_kinds(self, alive: np.ndarray) -> set[str]:
        """The kinds of value the rows flagged in ``alive`` hold ("o": an object)."""
        n = alive.shape[0]
        live = alive != 0
        codes = self.code[:n]
        held = np.unique(codes[live & (codes >= 0)])
        kinds = {self.code_kind[c] for c in held.tolist()}
        for r, cs in list(self.multi.items()):
            if r < n and live[r]:
                kinds.update(self.code_kind[c] for c in cs)
        if "o" in self.kinds:  # a scalar value that is none of the kinds: present, with no code
            objects = live & (self.present[:n] != 0) & (codes < 0)
            if any(r not in self.multi for r in np.flatnonzero(objects).tolist()):
                kinds.add("o")
        return kinds

    def matches(self, values: tuple, n: int) -> np.ndarray:
        codes = [self.vocab[v] for v in values if v in self.vocab]
        col = self.code[:n]
        if len(codes) <= 8:  # a few comparisons beat isin's sort
            out = np.zeros(n, dtype=bool)
            for c in codes:
                out |= col == c
        else:
            out = np.isin(col, codes)
        if self.multi and codes:
            wanted = set(codes)
            for r, cs in list(self.multi.items()):
                if r < n and wanted.intersection(cs):
                    out[r] = True
        return out

    def in_range(self, bounds: tuple, n: int) -> np.ndarray:
        gt, gte, lt, lte = bounds
        x = self.num[:n]
        out = ~np.isnan(x)
        for b, test in ((gt, np.greater), (gte, np.greater_equal), (lt, np.less), (lte, np.less_equal)):
            if b is not None:
                out &= test(x, b)
        for r, nums in list(self.multi_num.items()):
            if r < n and any((gt is None or v > gt) and (gte is None or v >= gte) and (lt is None or v < lt)
                             and (lte is None or v <= lte) for v in nums):
                out[r] = True
        return out

    def rows_with(self, values: tuple, n: int) -> np.ndarray:
        """Rows ``< n`` holding any of these values, ascending, from the value → rows lists."""
        if self._postings is None or self._postings[2] != n:
            order = np.argsort(self.code[:n], kind="stable")
            starts = np.searchsorted(self.code[:n][order], np.arange(-1, len(self.vocab) + 1))
            self._postings = (order, starts, n)
        order, starts, _ = self._postings
        parts = [order[starts[c + 1]:starts[c + 2]] for c in (self.vocab.get(v) for v in values) if c is not None]
        if self.multi:
            wanted = {self.vocab.get(v) for v in values}
            parts.append(np.array([r for r, cs in list(self.multi.items()) if r < n and wanted.intersection(cs)],
                                  dtype=np.int64))
        if not parts:
            return np.zeros(0, np.int64)
        if len(parts) == 1:  # one value: its rows, ascending (the sort is stable)
            return parts[0]
        return np.unique(np.concatenate(parts))


@dataclass(frozen=True)
class Columns:
    """The field columns as of one view: rows ``< rows`` (later rows may be filled meanwhile),
    and which of them are live (the view's flags)."""

    rows: int
    fields: dict
    alive: np.ndarray

    def field(self, key: str) -> FieldColumn:
        return self.fields[key]


class MetaColumns:
    """The metadata fields a process has filtered on (and the indexed ones), over the mirror's
    rows, kept up to date incrementally; :meth:`at` gives them as of a view."""

    def __init__(self, indexed: tuple[str, ...] = ()):
        self.indexed = tuple(indexed)
        self.rows = 0
        self._fields: dict[str, FieldColumn] = {}
        self._iids = np.zeros(0, np.uint32)  # the iid of each row covered, to notice a rebuilt mirror
        #: Views of the rows passing recent filters (:func:`gmmlsh.index.filtered.subset_view`).
        self.subsets: dict = {}
        self._lock = threading.Lock()

    def at(self, view, keys: set[str] | None = None) -> Columns:
        """The columns as of ``view`` (its new rows parsed first), with ``keys`` among them."""
        with self._lock:
            n = view.rows
            wanted = set(self.indexed) | (keys or set())
            new = [k for k in wanted if k not in self._fields]
            at = min(n, self.rows)
            if self.rows and (at == 0 or int(view.iid[at - 1]) != int(self._iids[at - 1]) or (new and n < self.rows)):
                self._fields, self.rows = {}, 0  # the mirror was rebuilt (rows are other vectors now), or
                new = list(wanted)               # an older view asks for a new field: start again from it
            for k in new:
                self._fields[k] = FieldColumn(k, indexed=k in self.indexed)
            if new and self.rows:
                self._fill([self._fields[k] for k in new], view, 0, self.rows)
            if n > self.rows:
                self._fill(list(self._fields.values()), view, self.rows, n)
                if n > self._iids.shape[0]:
                    iids = np.empty(max(n, 2 * self._iids.shape[0]), np.uint32)
                    iids[:self.rows] = self._iids[:self.rows]
                    self._iids = iids
                self._iids[self.rows:n] = view.iid[self.rows:n]
                self.rows = n
            rows = min(n, self.rows)
            return Columns(rows, dict(self._fields), view.alive[:rows])

    @staticmethod
    def _fill(cols: list[FieldColumn], view, lo: int, hi: int) -> None:
        if not cols:
            return
        for col in cols:
            col.grow(hi)
        step = 8192
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            for r, blob in zip(range(a, b), view.metadata_of(list(range(a, b))), strict=True):
                if not blob:
                    continue
                try:
                    meta = orjson.loads(blob)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(meta, dict):
                    for col in cols:
                        col.put(r, _get(meta, col.key))
