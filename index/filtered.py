"""Filtered search, scroll and delete by filter: the engine's side of metadata filters.

A compiled filter (:mod:`gmmlsh.index.filters`) becomes a per-row flag array over the
mirror's rows — live *and* matching — which the search kernels take as their live flags, so
the filter acts inside the search, on every stage, never as a post-pass:

* few matching rows (at most :data:`~gmmlsh.index.config.FILTER_EXACT_ROWS`, e.g. a rare
  label, often found straight from an indexed field's value → rows list): they are all
  scored by exact GMM — the exact filtered answer, cheaper than any sketch search;
* more: the tuned sketch search runs with its scan widened in proportion to how rare
  the condition is (``probes`` and ``shortlist`` divided by the matching share), since
  the first-stage scan keeps rows before the flags are read; the rank and exact stages
  see only matching rows.

Scroll pages through live ids in id order (a cursor is the last id of a page), so an id
stored throughout the scroll comes exactly once whatever is written meanwhile.
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
from dataclasses import replace

import numpy as np
import orjson

from gmmlsh.core.bundles import frozen
from gmmlsh.core.search import exact_rows
from gmmlsh.index import segments
from gmmlsh.index.config import (
    FILTER_EXACT_ROWS,
    FILTER_SUBSET_BYTES,
    FILTER_SUBSET_SHARE,
    MAX_CANDIDATES,
    SearchParams,
)
from gmmlsh.index.filters import Filter, MetaColumns
from gmmlsh.index.search import answer, found_by, run, run_sketch
from gmmlsh.results import QueryResult


def matching(view, flt: Filter, columns: MetaColumns) -> tuple[np.ndarray, np.ndarray]:
    """(live-and-matching flags as uint8 over the view's rows, those rows ascending)."""
    cols = columns.at(view, flt.keys())
    rows = flt.posting_rows(cols)
    alive = np.zeros(view.rows, np.uint8)
    if rows is not None:
        rows = rows[view.alive[rows] != 0]
        alive[rows] = 1
    else:
        np.logical_and(view.alive[:view.rows] != 0, flt.mask(cols), out=alive.view(bool))
        rows = np.flatnonzero(alive)
    return alive, rows


def widened(params: SearchParams, view, share: float) -> SearchParams:
    """The search parameters with the scan widened for a condition matching ``share`` of the rows."""
    lists = view.list_count
    probes = params.probes
    if probes > 0:
        probes = math.ceil(probes / share)
        probes = 0 if probes >= lists else probes
    return replace(params, probes=probes, shortlist=max(params.shortlist, min(view.rows, math.ceil(
        params.shortlist / share))))


def _gathered_offsets(offs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Offsets of ``rows`` of a variable-length column (and the last one's end). Row ``i`` of the
    gathered view starts at ``out[i]``; the kernels read its length from its own header
    (``out[i + 1]`` is another row's start: they use it only to bound what they prefetch)."""
    out = np.empty(rows.shape[0] + 1, dtype=offs.dtype)
    out[:-1] = offs[rows]
    out[-1] = offs[rows[-1] + 1] if rows.shape[0] else 0
    return out


def subset_view(view, rows: np.ndarray):
    """A view of just ``rows``: their first-stage rows, bit planes and norms gathered (the
    vectors and their coarse copies stay where they are: the offsets point into the mirror's
    columns), no lists, every row live. The sketch search over it scans only matching rows,
    however the condition correlates with the query's neighbourhood (a label does, strongly)."""
    m = int(rows.shape[0])
    alive, norms, planes, first = np.ones(m, np.uint8), view.norms[rows], view.planes[rows], view.first[rows]
    voff, coff = _gathered_offsets(view.voff, rows), _gathered_offsets(view.row_bundle.coff, rows)
    bundle = view.row_bundle._replace(alive=frozen(alive), norms=frozen(norms),
                                      norms32=frozen(norms.astype(np.float32)), planes=frozen(planes),
                                      first=frozen(first), voff=frozen(voff), coff=frozen(coff))
    lists, post = segments.bundles(None, None, m, view.lists.profiles.shape[0] // 2)
    return replace(view, rows=m, live=m, iid=view.iid[rows], alive=alive, norms=norms, planes=planes, first=first,
                   voff=voff, row_bundle=bundle, lists=lists, postings=post, fit=None, segments=())


def _subset(view, flt: Filter, rows: np.ndarray, cache: dict):
    """The subset view of a filter's rows, gathered once while the mirror holds still (a filter
    repeated over queries, as an application filtering on a category sends them), the most
    recently used kept up to :data:`~gmmlsh.index.config.FILTER_SUBSET_BYTES`."""
    key = (flt, view.rows, view.token)
    sub = cache.pop(key, None)
    if sub is None:
        sub = subset_view(view, rows)
    cache[key] = sub  # last: the most recently used
    size = sum(_nbytes(v) for v in cache.values())
    while size > FILTER_SUBSET_BYTES and len(cache) > 1:
        size -= _nbytes(cache.pop(next(iter(cache))))
    return sub


def _nbytes(sub) -> int:
    return sum(a.nbytes for a in (sub.planes, sub.first, sub.norms, sub.voff, sub.row_bundle.coff, sub.alive))


def _subset_params(params: SearchParams) -> SearchParams:
    """The tuned search, deepened for a subset: a condition moves the neighbours away from the
    query (another label's best match stands less above the rest than the query's own class's),
    and the subset is small enough that scoring twice the rows costs little."""
    return replace(params, shortlist=2 * params.shortlist, candidates=min(MAX_CANDIDATES, 2 * params.candidates))


def run_filtered(view, qs, k: int, mode: str, min_similarity: float, params: SearchParams, config,
                 flt: Filter, columns: MetaColumns) -> list[QueryResult]:
    """Answers to prepared queries among the rows that pass ``flt`` (see the module docstring)."""
    alive, rows = matching(view, flt, columns)
    m = int(rows.shape[0])
    fview = view.restricted(alive, m)
    if mode == "nrff":
        return run(fview, qs, k, mode, min_similarity, params, config)
    if m <= FILTER_EXACT_ROWS:  # few rows pass: all of them scored exactly (the exact filtered answer)
        return [answer(fview, "exact", k, *_exact_of(fview, q, rows), min_similarity) for q in qs]
    if mode != "sketch":
        return run(fview, qs, k, "exact", min_similarity, params, config)
    share = m / max(view.live, 1)
    found: list = [None] * len(qs)
    if share > FILTER_SUBSET_SHARE:  # most rows pass: the mask, with the scan widened a little
        found = run_sketch(fview, qs, widened(params, view, share), config, k)
        # Fewer candidates than the rerank budget: the scan kept too few passing rows (the
        # query's neighbourhood is mostly excluded, e.g. its own label): search the subset.
        found = [f if f[2] >= min(params.candidates, m - 1) else None for f in found]
    redo = [i for i, f in enumerate(found) if f is None]
    if redo:
        sub = _subset(view, flt, rows, columns.subsets)
        at = [int(np.searchsorted(rows, qs[i].exclude)) if qs[i].exclude >= 0 and alive[qs[i].exclude] else -1
              for i in redo]
        again = found_by(sub, [qs[i].excluding(e) for i, e in zip(redo, at, strict=True)], k, "sketch",
                         _subset_params(params), config)
        for i, (r, s, ranked) in zip(redo, again, strict=True):
            found[i] = (rows[r], s, ranked)
    return [answer(fview, mode, k, r, s, ranked, min_similarity) for r, s, ranked in found]


def _exact_of(view, q, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Exact GMM of a query against the given rows (the few a filter passes)."""
    out_rows, out_sims = np.empty(rows.shape[0], np.int64), np.empty(rows.shape[0])
    n = exact_rows(q.q, view.row_bundle, rows, out_rows, out_sims)
    return out_rows[:n], out_sims[:n], n


class NameOrder:
    """The mirror's rows sorted by external id (per process, extended as rows are added)."""

    def __init__(self):
        self.names: list[bytes] = []
        self.rows: list[int] = []
        self.covered = 0
        self._last_iid = -1  # the iid of the last row covered, to notice a rebuilt mirror
        self._lock = threading.Lock()

    def at(self, view) -> tuple[list[bytes], list[int]]:
        with self._lock:
            if self.covered and (view.rows < self.covered or int(view.iid[self.covered - 1]) != self._last_iid):
                self.names, self.rows, self.covered = [], [], 0  # a rebuilt mirror (or an older view)
            if view.rows > self.covered:
                lo, hi = self.covered, view.rows
                offs, data = view.names
                new = sorted((data[offs[r]:offs[r + 1]].tobytes(), r) for r in range(lo, hi))
                merged = list(heapq.merge(zip(self.names, self.rows, strict=True), new))
                self.names = [n for n, _ in merged]
                self.rows = [r for _, r in merged]
                self.covered, self._last_iid = hi, int(view.iid[hi - 1])
            return self.names, self.rows


def scroll(view, order: NameOrder, columns: MetaColumns, flt: Filter | None, cursor: str | None, limit: int
           ) -> tuple[list[tuple[str, dict | None]], str | None]:
    """Up to ``limit`` live (matching) ``(id, metadata)`` after id ``cursor``, in id order, and
    the cursor of the next page (None at the end)."""
    names, rows = order.at(view)
    keep = matching(view, flt, columns)[0] if flt is not None else view.alive[:view.rows]
    i = bisect.bisect_right(names, cursor.encode("utf-8", "surrogatepass")) if cursor is not None else 0
    out: list[int] = []
    while i < len(rows) and len(out) <= limit:  # one more than the page: is there a next page?
        r = rows[i]
        if r < keep.shape[0] and keep[r]:
            out.append(r)
        i += 1
    more = len(out) > limit
    out = out[:limit]
    metas = view.metadata_of(out)
    page = [(n, orjson.loads(m) if m else None) for n, m in zip(view.names_of(out), metas, strict=True)]
    return page, (page[-1][0] if page and more else None)
