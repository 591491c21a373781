"""The tuner: an index reads its own data and queries, and chooses how to search.

Data differ in how far a true neighbour stands above the background (Fashion-MNIST:
10th neighbour GMM ≈ 0.77 against ≈ 0.32 for a random pair; bag-of-words text ≈ 0.20
against ≈ 0.15), and the right search differs with them: dense images rank well on
2-bit codes and need few lists; text needs 8-bit codes, many more candidates, or
exact search. So the tuner takes sample queries, finds their true top
``NEIGHBORS`` by exact search, then times a ladder of :class:`SearchParams` on them —
sketch searches, and on text-like data postings searches — and keeps the cheapest whose
recall reaches the target (:data:`TARGET_RECALL`), or exact search, when no setting
reaches it or exact is cheaper. Recall counts ties at the 10th
neighbour as hits (text has many).

The sample queries are the ones the index has served (:class:`QuerySample`, a
reservoir) once there are enough; until then, stored vectors, each leaving itself
out. Stored vectors can be much easier queries than new ones: where the data hold
near-copies (augmented images, resampled documents) a stored vector's neighbours are
its own copies. Measured: Brown passages resampled to 200,000 rows, settings reaching
recall 1.0 on stored vectors gave 0.19 on held-out passages — so an index re-tunes on
its real queries as soon as it has :data:`MIN_QUERIES` of them, and a build can be given
sample queries to tune on from the start (:func:`sample_queries`).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import numpy as np

from gmmlsh.core.validate import VectorError
from gmmlsh.index.config import RANK_BITS_MAX, IndexConfig, SearchParams
from gmmlsh.index.mirror import View
from gmmlsh.index.records import SparseRow, as_stored, codes_of
from gmmlsh.index.search import (
    Prepared,
    prepare_row,
    prepare_vectors,
    run_exact,
    run_exact_many,
    run_lsh,
    run_postings,
)

#: Recall@10 the tuner plans for: the lower confidence bound of its sample's recall must reach
#: it (:func:`_recall`). It stands above the 0.95 the project promises because the queries to
#: come differ from the sample (Fashion-MNIST, 60,000: a setting tuned to a bound of 0.95 on the
#: first 128 test images gave 0.939 on 1,000). Stored vectors as the sample get a margin on
#: top: they are easier queries than new ones where the data hold near-copies (on
#: Fashion-MNIST grown to 1M, settings reaching 0.98 on stored vectors gave 0.963 on held-out
#: queries). An index re-tunes on its served queries once it has :data:`MIN_QUERIES` of them.
TARGET_RECALL = 0.96
STORED_MARGIN = 0.02
#: Standard errors below the sample's mean recall that must still reach the target (one-sided 95 %).
CONFIDENCE_Z = 1.645
NEIGHBORS = 10
#: Sample queries drawn from the stored vectors; the served queries that replace them as
#: the sample once the index has served that many (more: they carry no margin, and the
#: confidence bound narrows with their number), and the most served queries kept for it
#: (a uniform sample of all served; every one of them is used); the smallest index worth tuning.
QUERIES = 64
MIN_QUERIES = 128
MAX_QUERIES = 2 * MIN_QUERIES
MIN_ROWS = 256
#: Sample queries each setting that reaches the target is first timed on; the fastest
#: :data:`FINALISTS` whose answers reach it too are then timed again on all of them, best of
#: three passes.
TIMING_QUERIES = 16
FINALISTS = 4
#: Shares of the rows a coordinate read by the postings search is held by at most.
_RARE_SHARES = (1 / 1024, 1 / 256, 1 / 128, 1 / 64)
_SHORTLISTS = (250, 500, 750, 1000, 1500, 2000, 3000, 4000)
_CANDIDATES = (50, 75, 100, 150, 200, 300, 400, 600, 800)
#: (shortlist, candidates) of each list count's first trial: wide, but not the widest.
_WIDE = (3000, 400)
#: Sample queries searched exactly at a time for their truth (dense rows are read once per batch).
_TRUTH_BATCH = 16


def recall(found: np.ndarray, true_rows: np.ndarray | None) -> float:
    """Share of a top-``NEIGHBORS`` answer at or above the true 10th similarity. ``found``: the
    rows a search scored exactly; ``true_rows``: those at or above the true 10th (the true top
    ``NEIGHBORS`` and their ties; None where every row is, a 10th of 0). A found true row
    outranks every other found row, so only which rows were scored counts, not their scores."""
    hits = found.shape[0] if true_rows is None else int(np.isin(found, true_rows).sum())
    return min(NEIGHBORS, hits) / NEIGHBORS


class QuerySample:
    """A uniform sample (reservoir) of the queries an index has served, for the tuner.

    Holds up to ``size`` query rows at stored precision (dense or 1-row CSR); thread-safe.
    """

    def __init__(self, size: int = MAX_QUERIES, seed: int = 0):
        self.size = size
        self.seen = 0
        self.rows: list = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def add(self, X32, own: bool = False) -> None:
        """Offer each row of a validated query batch to the sample; ``own``: the batch is one row
        nobody else holds (a query's own copy), kept as it is rather than copied."""
        with self._lock:
            for i in range(X32.shape[0]):
                self.seen += 1
                at = len(self.rows) if len(self.rows) < self.size else self._rng.randrange(self.seen)
                if at < self.size:
                    row = X32 if own and X32.shape[0] == 1 else X32[i:i + 1].copy()
                    if at == len(self.rows):
                        self.rows.append(row)
                    else:
                        self.rows[at] = row

    def take(self, n: int) -> list:
        """Up to ``n`` sampled rows, each a 1-row batch (dense or CSR)."""
        with self._lock:
            rows = list(self.rows[:n])
        return [r.csr() if isinstance(r, SparseRow) else r for r in rows]


def sample_queries(queries, dim: int) -> list:
    """Given sample queries (dense 2-D or CSR, see :meth:`Index.maintain`), validated (errors name
    the field ``queries``), as :func:`tune` takes them: up to :data:`MAX_QUERIES` 1-row batches,
    spread evenly over the rows."""
    X32 = as_stored(queries, dim, "queries")
    n = X32.shape[0]
    if n < MIN_QUERIES:
        raise VectorError("queries", f"{n} rows: tuning needs at least {MIN_QUERIES} sample queries")
    picked = np.linspace(0, n - 1, min(n, MAX_QUERIES)).round().astype(np.int64)
    return [X32[i:i + 1] for i in picked]


def _truth(view: View, qs: list[Prepared]) -> list:
    """Each sample query's rows at or above its true 10th similarity (:func:`recall`), by exact
    search in batches of :data:`_TRUTH_BATCH` queries: an answer may hold buffers the size of
    the index until it is cut to its true rows."""
    rows = []
    for lo in range(0, len(qs), _TRUTH_BATCH):
        for found, sims, _ in run_exact_many(view, qs[lo:lo + _TRUTH_BATCH], NEIGHBORS):
            tenth = np.sort(sims)[::-1][min(NEIGHBORS, sims.shape[0]) - 1] if sims.shape[0] else 0.0
            rows.append(found[sims >= tenth - 1e-9] if tenth > 1e-9 else None)
    return rows


def _sample(view: View, config: IndexConfig, queries: int, seed: int, served: list | None
            ) -> tuple[list[Prepared], str]:
    """Sample queries, and what they are: served queries when given, else stored vectors."""
    if served:
        rows = served[:queries]
        return [q for X32 in rows for q in prepare_vectors(X32, config)], f"{len(rows)} queries"
    live = np.flatnonzero(view.alive)
    rng = np.random.default_rng(seed)
    rows = rng.choice(live, size=min(queries, live.shape[0]), replace=False)
    return [prepare_row(view, int(r), config) for r in rows], f"{rows.shape[0]} stored vectors"


def _recall(view: View, qs: list[Prepared], truth: list, params: SearchParams, config: IndexConfig,
            scored: bool = False) -> float:
    """Recall of ``params`` on the sample, as a one-sided 95 % lower confidence bound: the
    mean over the sample queries less :data:`CONFIDENCE_Z` standard errors. The tuner keeps
    the cheapest of many settings that reach the target, so a bare sample mean would favour
    the settings the sample flatters (measured: 0.961 on 64 served queries, 0.939 on 1,000).
    The queries are answered as one batch (on every core numba has: the same answers as one
    query at a time, in a fraction of the tuning's time). A sketch search counts which rows
    reach its candidates, unscored (the trials' many settings cost a fraction of their
    answers), or with ``scored`` which rows its answer scores exactly: the candidates' best by
    coarse GMM, which a coarse ranking can miss a true row from (the finalists' check)."""
    found = (run_lsh(view, qs, params, config, NEIGHBORS, scored=scored) if params.rare == 0 else
             [run_postings(view, q, params) for q in qs])
    per_query = np.array([recall(rows, true) for (rows, _, _), true in zip(found, truth, strict=True)])
    return float(per_query.mean() - CONFIDENCE_Z * per_query.std(ddof=1) / np.sqrt(per_query.shape[0]))


def _seconds(run, items: list, rounds: int = 1) -> float:
    """Seconds per call of ``run`` over ``items``, one at a time: the best of ``rounds`` passes
    (the machine is shared and noisy)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for item in items:
            run(item)
        best = min(best, (time.perf_counter() - t0) / max(1, len(items)))
    return best


def _exact_seconds(view: View, qs: list[Prepared], rival: float) -> float:
    """Seconds per exact search, one query at a time (as a query runs: alone), over ``qs``, or
    over fewer once their time alone puts the mean over all of ``qs`` above ``rival``'s: exact
    search then loses to it whatever the others take."""
    spent, timed = 0.0, 0
    for q in qs:
        t0 = time.perf_counter()
        run_exact(view, q)
        spent += time.perf_counter() - t0
        timed += 1
        if spent > len(qs) * rival:
            break
    return spent / max(1, timed)


def _lsh_seconds(view: View, qs: list[Prepared], params: SearchParams, config: IndexConfig, rounds: int = 1) -> float:
    return _seconds(lambda q: run_lsh(view, [q], params, config), qs, rounds)


def _search_seconds(view: View, qs: list[Prepared], params: SearchParams, config: IndexConfig, hash_s: float,
                    rounds: int = 1) -> float:
    """Seconds per query of ``params``, one query at a time: a sketch search with its query's
    hashing (``hash_s``), or a postings search (which needs no sketch)."""
    if params.rare > 0:
        return _seconds(lambda q: run_postings(view, q, params), qs, rounds)
    return _lsh_seconds(view, qs, params, config, rounds) + hash_s


def _postings_settings(view: View, qs: list[Prepared], truth: list, config: IndexConfig, target: float,
                       hash_s: float) -> list[tuple[float, SearchParams, float]]:
    """Postings searches reaching ``target`` (text-like data only: a generation with head
    columns): for each share of rare coordinates, the fewest candidates, by bisection."""
    g = view.generation
    if g is None or not g.postings_search:
        return []
    found = []
    for rare in _RARE_SHARES:
        best, lo, hi = None, 0, len(_CANDIDATES) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            params = SearchParams(rare=rare, candidates=_CANDIDATES[mid])
            r = _recall(view, qs, truth, params, config)
            if r >= target:
                best, hi = (params, r), mid - 1
            else:
                lo = mid + 1
        if best is not None:
            found.append((_search_seconds(view, qs[:TIMING_QUERIES], best[0], config, hash_s), *best))
    return found


def _hash_seconds(qs: list[Prepared], config: IndexConfig) -> float:
    """Seconds to sketch a query (part of every sketch search, none of an exact one): on
    sparse text of ~47,000 dimensions it costs more than the whole search of a small index."""
    # as queries are hashed: stored precision (float32) unless a centre made them float64
    rows = [q.dense[None, :] if config.center is not None else q.dense[None, :].astype(np.float32) for q in qs]
    codes_of(rows[0], config)  # compiled or loaded outside the timing
    return _seconds(lambda X: codes_of(X, config), rows)


def _probe_ladder(lists: int) -> list[int]:
    """Lists to try: 4, 6, 8, 12, 16, 24, … (steps of about √2) up to all of them (0 = all)."""
    out, p = [], 4
    while p < lists:
        out.append(p)
        p = p * 3 // 2 if p & (p - 1) == 0 else p * 4 // 3  # 4 → 6 → 8 → 12 → 16 → 24 → 32 …
    return out + [0]


def _cheapest_at(view, qs, truth, config, target, probes, rank_bits, tried: dict
                 ) -> list[tuple[float, SearchParams, float]]:
    """Settings at these probes and rank bits reaching ``target``, each with the fewest
    candidates for its shortlist. Recall grows with the shortlist and the candidates, and so
    does the cost: a wide setting is tried first, and nothing narrower if it misses (the
    widest are left out of that trial: at a million rows it cost a third of the tuning).
    The fewest candidates are found by bisection at the first shortlist that reaches the
    target; a longer shortlist never needs more, so it only tries fewer, one step at a time,
    and is kept only if it needs fewer. Once a longer shortlist changes no recall the
    widening stops there (longer ones only cost more).

    ``tried`` holds the recall of each (probes, shortlist, candidates) tried so far, with these
    or more rank bits. One that missed the target there is not tried again: fewer bits rank less
    precisely, so it misses with them too (its recall there stands in, below the target)."""
    def at(shortlist: int, candidates: int) -> float:
        key = (probes, shortlist, candidates)
        if tried.get(key, target) < target:
            return tried[key]
        params = SearchParams(probes=probes, shortlist=shortlist, rank_bits=rank_bits, candidates=candidates)
        tried[key] = _recall(view, qs, truth, params, config)
        return tried[key]

    if at(*_WIDE) < target:
        return []
    found: list[tuple[float, SearchParams, float]] = []
    ceiling = len(_CANDIDATES)
    before: dict[int, float] = {}  # recall at each candidate count tried, at the shorter shortlist
    for shortlist in _SHORTLISTS:
        ladder = [c for c in _CANDIDATES[:ceiling] if c <= shortlist]
        best, now = None, {}
        if not found:  # the fewest candidates reaching the target, by bisection (recall grows with them)
            lo, hi = 0, len(ladder) - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                r = now[ladder[mid]] = at(shortlist, ladder[mid])
                if r >= target:
                    best, hi = (ladder[mid], r), mid - 1
                else:
                    lo = mid + 1
        else:  # at most the candidates the shorter shortlist needed: try fewer, one step at a time
            for c in reversed(ladder[:-1]):
                r = now[c] = at(shortlist, c)
                if r < target:
                    break
                best = (c, r)
        if now and all(before.get(c) == r for c, r in now.items()):
            break  # the longer shortlist found nothing more: the first stage no longer limits recall
        before = now
        if best is not None:
            candidates, r = best
            params = SearchParams(probes=probes, shortlist=shortlist, rank_bits=rank_bits, candidates=candidates)
            found.append((_lsh_seconds(view, qs[:TIMING_QUERIES], params, config), params, r))
            ceiling = _CANDIDATES.index(candidates) + 1
            if ceiling == 1:  # the fewest candidates there are: a longer shortlist only costs more
                break
    return found


def tune(view: View, config: IndexConfig, *, target: float | None = None, queries: int | None = None,
         seed: int = 0, served: list | None = None) -> tuple[SearchParams, dict]:
    """The cheapest search reaching ``target`` on sample queries, and a report of the trial.

    ``served``: query rows the index has served (see :class:`QuerySample`); without
    them, stored vectors are the sample (and the target is raised by :data:`STORED_MARGIN`).
    ``queries``: the sample's size (default: :data:`QUERIES` stored vectors, or every
    served query given). ``target``: recall@10 the sample's lower confidence
    bound must reach (default :data:`TARGET_RECALL`). The postings search competes where most
    rows are sparse; brute force answers instead where nothing reaches the target, or where it
    is cheaper.
    """
    qs, source = _sample(view, config, queries or (len(served) if served else QUERIES), seed, served)
    if target is None:
        target = TARGET_RECALL + (0.0 if served else STORED_MARGIN)
    truth = _truth(view, qs)  # its exact search warms the mirror's pages too
    hash_s = _hash_seconds(qs[:16], config)
    reached: list[tuple[float, SearchParams, float]] = []
    tried: dict[tuple[int, int, int], float] = {}
    lists = view.generation.lists if view.generation is not None else 0
    ladder, start = _probe_ladder(lists), 0
    # Most rank bits first: fewer bits rank less precisely, so they never reach the target with
    # fewer lists than more bits needed; their trial starts there.
    for rank_bits in sorted({min(b, RANK_BITS_MAX, config.bits) for b in (2, RANK_BITS_MAX)}, reverse=True):
        first_hit = None
        for i in range(start, len(ladder)):
            found = _cheapest_at(view, qs, truth, config, target, ladder[i], rank_bits, tried)
            reached += found
            if found and first_hit is None:
                first_hit = i
            elif found:  # one more list count after the first that reaches: more only cost more
                break
        if first_hit is None:
            break  # fewer bits will not reach it either
        start = first_hit
    reached = [(s + hash_s, p, r) for s, p, r in reached]
    reached += _postings_settings(view, qs, truth, config, target, hash_s)
    # The cheapest whose answers reach the target too are timed again, best of three passes:
    # one noisy pass must not decide.
    finalists: list[tuple[SearchParams, float]] = []
    for _, params, _ in sorted(reached, key=lambda x: x[0]):
        if len(finalists) == FINALISTS:
            break
        r = _recall(view, qs, truth, params, config, scored=True)
        if r >= target:
            finalists.append((params, r))
    best = min(((_search_seconds(view, qs, p, config, hash_s, rounds=3), p, r) for p, r in finalists),
               key=lambda x: x[0], default=None)
    rival = best[0] if best is not None else float("inf")
    exact_s = _exact_seconds(view, qs[:8], rival)
    if best is not None and exact_s < 3 * rival:  # close: the best of two passes (one noisy pass must not decide)
        exact_s = min(exact_s, _exact_seconds(view, qs[:8], float("inf")))
    report = {"sample": source, "target_recall": target, "exact_ms": round(exact_s * 1e3, 3),
              "hash_ms": round(hash_s * 1e3, 3)}
    if best is not None:
        report.update(search_ms=round(best[0] * 1e3, 3), sample_recall_bound=round(best[2], 4))
    if best is None or exact_s <= best[0]:
        report["chosen"] = "exact"
        return replace(best[1] if best else SearchParams(rank_bits=config.bits), exact=True, rare=0.0), report
    report["chosen"] = "postings" if best[1].rare > 0 else "lsh"
    return best[1], report
