"""The tuner: an index reads its own data and queries, and chooses how to search.

Data differ in how far a true neighbour stands above the background (Fashion-MNIST:
10th neighbour GMM ≈ 0.77 against ≈ 0.32 for a random pair; bag-of-words text ≈ 0.20
against ≈ 0.15), and the right search differs with them: dense images rank well on a
few lists and short shortlists; text needs the postings search, or exact search. So the
tuner takes sample queries, finds their true top ``NEIGHBORS`` by exact search, then tries
settings on them — sketch searches, and on text-like data postings searches — and keeps the
cheapest whose recall reaches the target (:data:`TARGET_RECALL`) as a lower confidence
bound. Recall counts ties at the 10th neighbour as hits (text has many).

**Bounded cost.** Upkeep must never stall an index, so a tuning's work is bounded whatever
the data: the truth comes from the cheapest exact path for the data
(:func:`gmmlsh.index.search.run_exact_many`); settings are explored on at most
:data:`EXPLORE_QUERIES` of the sample, unscored, and at most :data:`MAX_TRIALS` of them; a
family of settings whose fastest member is slower than the best found so far is not
explored (where the ladder reaches nothing, the sketch search is first widened, while it
costs less than the cheapest postings search, and one that reaches the target sets that bar:
on image-like sparse rows every postings search is slower, and exploring them took most of a
build's time; where the sketch searches found miss on the whole sample, the bar is
:data:`NEAR_MISS` times theirs); the walk up the ladder's list counts ends one past its first
hit; only the few fastest finalists are checked, scored, on the whole sample.

**No cliff.** Where nothing on the ladder reaches the target, the search is widened (more
lists, longer shortlists, more candidates; on text-like data the postings search too) until it
does, or until the tuning has run :data:`WIDEN_SECONDS`; exact search answers instead only
where it costs at most :data:`EXACT_MARGIN` times the widest search tried, or is cheaper.

The sample queries are the ones the index has served (:mod:`gmmlsh.index.served`, a uniform
sample kept with the index) once there are enough; until then, stored vectors, each leaving itself out, with a margin
on the target: where the data hold near-copies (augmented images, resampled documents) a
stored vector's neighbours are its own copies, an easier query than a new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from gmmlsh.core.validate import VectorError
from gmmlsh.index.config import RANK_BITS_MAX, IndexConfig, SearchParams
from gmmlsh.index.mirror import View
from gmmlsh.index.records import as_stored, codes_of
from gmmlsh.index.search import (
    Prepared,
    exact_loaded,
    prepare_row,
    prepare_vectors,
    run_exact,
    run_exact_many,
    run_postings,
    run_sketch,
)

#: Recall@10 the tuner plans for: the lower confidence bound of its sample's recall must reach
#: it. It stands above the 0.95 the project promises because the queries to come differ from
#: the sample. Stored vectors as the sample get a margin on top (they are easier queries than
#: new ones where the data hold near-copies).
TARGET_RECALL = 0.96
STORED_MARGIN = 0.02
#: Standard errors below the sample's mean recall that must still reach the target (one-sided 95 %).
CONFIDENCE_Z = 1.645
NEIGHBORS = 10
#: Sample queries drawn from the stored vectors; the served queries (:mod:`gmmlsh.index.served`)
#: that replace them as the sample once the index has served that many, and the most a tuning
#: takes (its truth, an exact search per query, is most of its cost); the smallest index worth tuning.
QUERIES = 64
MIN_QUERIES = 128
MAX_QUERIES = 128
MIN_ROWS = 256
#: Sample queries settings are explored on (unscored); trials at most.
EXPLORE_QUERIES = 64
MAX_TRIALS = 64
#: Queries each setting that reaches the target is first timed on; finalists checked on the whole sample.
TIMING_QUERIES = 16
FINALISTS = 4
#: Exact search answers where nothing reaches the target only if it costs at most this many
#: times the widest sketch search.
EXACT_MARGIN = 3.0
#: Shares of the rows a coordinate read by the postings search is held by at most.
_RARE_SHARES = (1 / 1024, 1 / 256, 1 / 128, 1 / 64)
_SHORTLISTS = (250, 500, 750, 1000, 1500, 2000, 3000, 4000)
_CANDIDATES = (50, 75, 100, 150, 200, 300, 400, 600, 800)
#: The postings search's candidates: more rows share a rare coordinate as the index grows
#: (docs/tuning.md, "The postings search").
_POSTINGS_CANDIDATES = _CANDIDATES + (1200, 1600, 2400, 3200, 4000)
#: The cheapest postings search: where even it is slower than a sketch search reaching the
#: target, no postings search is explored.
_CHEAPEST_POSTINGS = SearchParams(rare=_RARE_SHARES[0], candidates=_POSTINGS_CANDIDATES[0])
#: Where a widened postings search starts when the exploration found none reaching the target:
#: the most rare coordinates read, the most candidates of the sketch search's ladder.
_POSTINGS_START = SearchParams(rare=_RARE_SHARES[-1], candidates=_CANDIDATES[-1])
#: (shortlist, candidates) of each list count's first trial: wide, but not the widest.
_WIDE = (3000, 400)
#: Recall (the exploration's bound) within which fewer lists than all count as all: past it, more
#: lists add little and a longer shortlist is what a widened search needs.
SATURATED = 0.01
#: Where the sketch searches that seemed to reach the target miss it on the whole sample, the
#: postings searches are explored only if the cheapest costs under this many times theirs: a
#: near miss is a few steps of widening from reaching (strokes at 1.9M: the postings searches,
#: 0.12 s a query, took the tuning's time, and it fell back to exact search at 0.24 s a query,
#: where 128 lists and a longer shortlist reach the target at 1.25 ms).
NEAR_MISS = 4.0
#: Seconds from a tuning's start after which its widening takes no further step (upkeep has a
#: bounded cost: where the target is out of reach, each step past every list scores the whole
#: sample at tens of ms a query, and a widening to the end ran over 10 minutes at 2M rows).
WIDEN_SECONDS = 60.0
#: Past the ladder: the widest shortlist and candidates a widened search grows to.
_WIDEST = (32000, 4000)
#: Sample queries searched exactly at a time for their truth (an answer may hold buffers the size
#: of the index until it is cut).
_TRUTH_BATCH = 64


def recall(found: np.ndarray, true_rows: np.ndarray | None) -> float:
    """Share of a top-``NEIGHBORS`` answer at or above the true 10th similarity. ``found``: the
    rows a search scored exactly; ``true_rows``: those at or above the true 10th (the true top
    ``NEIGHBORS`` and their ties; None where every row is, a 10th of 0). A found true row
    outranks every other found row, so only which rows were scored counts, not their scores."""
    hits = found.shape[0] if true_rows is None else int(np.isin(true_rows, found).sum())
    return min(NEIGHBORS, hits) / NEIGHBORS


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


def truth(view: View, qs: list[Prepared]) -> list:
    """Each query's rows at or above its true 10th similarity (:func:`recall`), by exact search."""
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
    live = view.live_rows()
    rng = np.random.default_rng(seed)
    rows = rng.choice(live, size=min(queries, live.shape[0]), replace=False)
    return [prepare_row(view, int(r), config) for r in rows], f"{rows.shape[0]} stored vectors"


def bound(per_query: np.ndarray) -> float:
    """The one-sided 95 % lower confidence bound of a mean recall: the tuner keeps the cheapest of
    many settings, so a bare sample mean would favour the settings the sample flatters."""
    if per_query.shape[0] < 2:
        return float(per_query.mean()) if per_query.shape[0] else 0.0
    return float(per_query.mean() - CONFIDENCE_Z * per_query.std(ddof=1) / np.sqrt(per_query.shape[0]))


def _recall(view: View, qs: list[Prepared], true: list, params: SearchParams, config: IndexConfig,
            scored: bool = False) -> float:
    """Recall of ``params`` on ``qs`` as a lower confidence bound (:func:`bound`). A sketch search
    counts which rows reach its candidates, unscored (the trials' many settings cost a fraction
    of their answers), or with ``scored`` which rows its answer scores exactly (the finalists'
    check: a coarse ranking can miss a true row)."""
    found = (run_sketch(view, qs, params, config, NEIGHBORS, scored=scored) if params.rare == 0 else
             [run_postings(view, q, params) for q in qs])
    return bound(np.array([recall(rows, t) for (rows, _, _), t in zip(found, true, strict=True)]))


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


@dataclass
class _Trials:
    """The tuning's exploration: settings tried on the exploration sample (memoised, counted)."""

    view: View
    qs: list[Prepared]
    true: list
    config: IndexConfig
    target: float
    hash_s: float
    tried: dict = field(default_factory=dict)  # key(params) → recall
    timed: dict = field(default_factory=dict)  # key(params) → seconds a query, one pass over the timing queries
    count: int = 0
    #: time.perf_counter() after which a widening takes no further step (:data:`WIDEN_SECONDS`)
    deadline: float = float("inf")

    def recall(self, params: SearchParams) -> float:
        key = self.key(params)
        if key not in self.tried:
            self.count += 1
            self.tried[key] = _recall(self.view, self.qs, self.true, params, self.config)
        return self.tried[key]

    @staticmethod
    def key(params: SearchParams) -> tuple:
        """What a trial's recall is memoised under."""
        return params.probes, params.shortlist, params.candidates, params.rank_bits, params.rare

    @property
    def spent(self) -> bool:
        return self.count >= MAX_TRIALS

    @property
    def late(self) -> bool:
        """Whether a widening must stop where it is (the tuning has run :data:`WIDEN_SECONDS`)."""
        return time.perf_counter() > self.deadline

    def seconds(self, params: SearchParams, rounds: int = 1, qs: list[Prepared] | None = None) -> float:
        """Seconds a query of ``params`` takes, one query at a time, hashing included (a sketch
        search's; a postings search needs no sketch). One pass over the exploration's timing
        queries is memoised: the cheapest postings search is the cap of several widenings, and
        timing it again cost ~2 s a time on strokes at 2M rows."""
        if rounds == 1 and qs is None:
            key = self.key(params)
            if key not in self.timed:
                self.timed[key] = self.seconds(params, qs=self.qs[:TIMING_QUERIES])
            return self.timed[key]
        qs = self.qs[:TIMING_QUERIES] if qs is None else qs
        if params.rare > 0:
            return _seconds(lambda q: run_postings(self.view, q, params), qs, rounds)
        return _seconds(lambda q: run_sketch(self.view, [q], params, self.config), qs, rounds) + self.hash_s


def _hash_seconds(qs: list[Prepared], config: IndexConfig) -> float:
    """Seconds to sketch a query (part of every sketch search, none of an exact one): on
    sparse text of ~47,000 dimensions it costs more than the whole search of a small index."""
    rows = [q.q.dense[None, :] if config.center is not None else q.q.dense[None, :].astype(np.float32) for q in qs]
    codes_of(rows[0], config)  # compiled or loaded outside the timing
    return _seconds(lambda X: codes_of(X, config), rows)


def _probe_ladder(lists: int) -> list[int]:
    """Lists to try: 4, 6, 8, 12, 16, 24, … (steps of about √2) up to all of them (0 = all)."""
    out, p = [], 4
    while p < lists:
        out.append(p)
        p = p * 3 // 2 if p & (p - 1) == 0 else p * 4 // 3  # 4 → 6 → 8 → 12 → 16 → 24 → 32 …
    return out + [0]


def _cheapest_at(trials: _Trials, probes: int, rank_bits: int) -> list[tuple[float, SearchParams, float]]:
    """Settings at these probes and rank bits reaching the target, each with the fewest
    candidates for its shortlist. Recall grows with the shortlist and the candidates, and so
    does the cost: a wide setting is tried first, and nothing narrower if it misses. The fewest
    candidates are found by bisection at the first shortlist that reaches the target; a longer
    shortlist never needs more, so it only tries fewer, one step at a time, and is kept only if
    it needs fewer. Once a longer shortlist changes no recall the widening stops there."""
    target = trials.target

    def at(shortlist: int, candidates: int) -> float:
        return trials.recall(SearchParams(probes=probes, shortlist=shortlist, rank_bits=rank_bits,
                                          candidates=candidates))

    if at(*_WIDE) < target:
        return []
    found: list[tuple[float, SearchParams, float]] = []
    ceiling = len(_CANDIDATES)
    before: dict[int, float] = {}  # recall at each candidate count tried, at the shorter shortlist
    for shortlist in _SHORTLISTS:
        if trials.spent:
            break
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
            found.append((trials.seconds(params), params, r))
            ceiling = _CANDIDATES.index(candidates) + 1
            if ceiling == 1:  # the fewest candidates there are: a longer shortlist only costs more
                break
    return found


def _sketch_settings(trials: _Trials, lists: int, rank_choices: list[int]) -> list[tuple[float, SearchParams, float]]:
    """Sketch searches reaching the target on the ladder (most rank bits first: fewer bits rank
    less precisely, so they never reach it with fewer lists than more bits needed). Each walk
    ends one list count past its first that reaches, whether that one reaches or not: at a fixed
    shortlist, more lists can recall less (strokes at 1.9M: 0.964 at 96 lists, 0.952–0.959 at
    128 to all), and walking on to every list spent the trials and the slowest of them. A
    walk with fewer bits takes the same two list counts at most."""
    reached: list[tuple[float, SearchParams, float]] = []
    ladder = _probe_ladder(lists)
    start, stop = 0, len(ladder)
    for rank_bits in rank_choices:
        first_hit = None
        for i in range(start, stop):
            if trials.spent:
                break
            found = _cheapest_at(trials, ladder[i], rank_bits)
            reached += found
            if first_hit is not None:
                break
            if found:
                first_hit = i
        if first_hit is None:
            break
        start, stop = first_hit, min(first_hit + 2, stop)
    return reached


def _postings_settings(trials: _Trials, rival: float) -> list[tuple[float, SearchParams, float]]:
    """Postings searches reaching the target (text-like data only: a fit with head columns): for
    each share of rare coordinates, the fewest candidates, by bisection. None are explored when
    the cheapest of them is slower than ``rival`` (seconds a query of the best setting found)."""
    if not trials.view.postings_search:
        return []
    if trials.seconds(_CHEAPEST_POSTINGS) > rival:
        return []
    found = []
    for rare in _RARE_SHARES:
        best, lo, hi = None, 0, len(_POSTINGS_CANDIDATES) - 1
        while lo <= hi and not trials.spent:
            mid = (lo + hi) // 2
            params = SearchParams(rare=rare, candidates=_POSTINGS_CANDIDATES[mid])
            r = trials.recall(params)
            if r >= trials.target:
                best, hi = (params, r), mid - 1
            else:
                lo = mid + 1
        if best is not None:
            found.append((trials.seconds(best[0]), *best))
    return found


def _widened(trials: _Trials, qs: list[Prepared], true: list, start: SearchParams,
             cap: float = float("inf"), turn: int = 0, at_start: float | None = None) -> tuple[SearchParams, float]:
    """Past what the exploration found: from ``start`` (the cheapest sketch search it found
    reaching the target, which then missed on the whole sample, or the ladder's wide trial),
    wider a step at a time, the three ways in turn — the next rung of lists, the shortlist
    doubled, the candidates doubled (up to every list and :data:`_WIDEST`) — until the whole
    sample's recall (scored) reaches the target, then :func:`_trimmed`; the widest tried and its
    recall otherwise.
    A step at a time, each way in turn: every list can cost ten times what a few more lists do,
    and where the first stage limits recall, more lists do not help (docs/tuning.md, "The
    tuner's ladder"). A step slower than ``cap`` seconds a query is not taken (another search,
    already known, answers faster), nor any once the tuning has run :data:`WIDEN_SECONDS`.
    ``turn``: the way tried first (1: the shortlist). Where no step is taken: ``start`` and its
    recall, scored on the whole sample (``at_start``: what the caller knows of it). A bare 0 there
    lost to a postings search recalling 0.78 at 0.1 s a query (strokes at 2M under a writer: the
    time limit was reached before the first step)."""
    ladder = _probe_ladder(trials.view.list_count)
    params, r = start, at_start
    missed = {trials.key(start)}
    while True:
        ways = (replace(params, probes=0 if params.probes == 0 else next((p for p in ladder if p > params.probes), 0)),
                replace(params, shortlist=min(_WIDEST[0], 2 * params.shortlist)),
                replace(params, candidates=min(_WIDEST[1], 2 * params.candidates)))
        way = next((w % 3 for w in range(turn, turn + 3) if ways[w % 3] != params), None)
        if way is None or trials.late or (cap < float("inf") and trials.seconds(ways[way]) > cap):
            return params, _recall(trials.view, qs, true, start, trials.config, scored=True) if r is None else r
        turn = way + 1
        params, r = ways[way], _recall(trials.view, qs, true, ways[way], trials.config, scored=True)
        if r >= trials.target:
            return _trimmed(trials, qs, true, start, params, r, missed)
        missed.add(trials.key(params))


def _widest(trials: _Trials, qs: list[Prepared], true: list, reached: list[tuple[float, SearchParams, float]],
            ladder_widest: SearchParams) -> list[tuple[SearchParams, float]]:
    """Where no setting the exploration found reaches the target on the whole sample, each
    family widened until it does: the sketch search (from its cheapest) while a step costs less
    than the cheapest postings search (strokes: it reaches at ~1 ms, where widening the postings
    first took a re-tune 97 s); on text-like data (a fit with head columns) then the postings
    search (from its setting that recalled most), then the sketch search further, each step
    cheaper than a postings search that reached. Those reaching the target, or else the one
    recalling most (text at 1M: a sketch search widened to every list recalled 0.87 where a
    postings search recalled 0.955, and the index served 0.69 with the sketch). Once the
    tuning's time is spent (:data:`WIDEN_SECONDS`), no postings search is started where the
    exploration found none (strokes at 2M: its first pass took 13 s, and it answered, recalling
    0.78 at 0.1 s a query)."""
    sketches = sorted((x for x in reached if x[1].rare == 0), key=lambda x: x[0])
    start = sketches[0][1] if sketches else ladder_widest
    if not trials.view.postings_search:
        return [_widened(trials, qs, true, start)]
    sketch = _widened(trials, qs, true, start, trials.seconds(_CHEAPEST_POSTINGS))
    postings = [x for x in reached if x[1].rare > 0]
    if sketch[1] >= trials.target or (trials.late and not postings):
        return [sketch]  # out of time: no family the exploration found too slow to try is started now
    post = _postings_widened(trials, qs, true, max(postings, key=lambda x: (x[2], -x[0]))[1] if postings
                             else _POSTINGS_START)
    further = _widened(trials, qs, true, sketch[0], trials.seconds(post[0]) if post[1] >= trials.target
                       else float("inf"), at_start=sketch[1])
    widened = [post, further]
    hits = [x for x in widened if x[1] >= trials.target]
    return hits or [max(widened, key=lambda x: x[1])]


def _postings_widened(trials: _Trials, qs: list[Prepared], true: list, start: SearchParams
                      ) -> tuple[SearchParams, float]:
    """The postings search from ``start``, wider a step at a time, the two ways in turn — the
    candidates a rung up :data:`_POSTINGS_CANDIDATES`, the rare coordinates' share a rung up
    :data:`_RARE_SHARES` — until the whole sample's recall reaches the target (or the tuning
    has run :data:`WIDEN_SECONDS`); the widest and its recall otherwise."""
    params = start
    r = _recall(trials.view, qs, true, params, trials.config)
    turn = 0
    while r < trials.target:
        ways = (replace(params, candidates=next((c for c in _POSTINGS_CANDIDATES if c > params.candidates),
                                                params.candidates)),
                replace(params, rare=next((x for x in _RARE_SHARES if x > params.rare), params.rare)))
        way = next((w % 2 for w in range(turn, turn + 2) if ways[w % 2] != params), None)
        if way is None or trials.late:
            break
        turn = way + 1
        params = ways[way]
        r = _recall(trials.view, qs, true, params, trials.config)
    return params, r


def _trimmed(trials: _Trials, qs: list[Prepared], true: list, start: SearchParams, params: SearchParams,
             r: float, missed: set) -> tuple[SearchParams, float]:
    """A widened search that reaches the target, narrowed back a step at a time while the whole
    sample's recall (scored) still reaches it: the lists a rung down, the shortlist halved, the
    candidates halved (the shortlist never below them), never below ``start`` nor to a setting
    the widening ``missed`` with. The widening's steps are taken in turn, so a shortlist
    lengthened early can be made unneeded by lists added later."""
    every = trials.view.list_count
    rungs = [p for p in _probe_ladder(every) if p != 0 and p >= (start.probes or every)]
    tried = missed | {trials.key(params)}
    while True:
        fewer = [p for p in rungs if p < (params.probes or every)]
        backs = (replace(params, probes=fewer[-1] if fewer else params.probes),
                 replace(params, shortlist=max(start.shortlist, params.candidates, params.shortlist // 2)),
                 replace(params, candidates=max(start.candidates, params.candidates // 2)))
        for back in backs:
            key = trials.key(back)
            if key in tried:
                continue
            tried.add(key)
            rb = _recall(trials.view, qs, true, back, trials.config, scored=True)
            if rb >= trials.target:
                params, r = back, rb
                break
        else:
            return params, r


def _saturated(trials: _Trials, lists: int, rank_bits: int) -> int:
    """The fewest lists on the ladder whose wide first trial (:data:`_WIDE`) recalled within
    :data:`SATURATED` of what every list did (0: every list, or not explored): where nothing on
    the ladder reaches the target there, the shortlist limits, not the lists."""
    wide = [(p, trials.tried.get(trials.key(SearchParams(probes=p, shortlist=_WIDE[0], rank_bits=rank_bits,
                                                         candidates=_WIDE[1])))) for p in _probe_ladder(lists)]
    every = wide[-1][1]
    return next((p for p, r in wide if every is not None and r is not None and r >= every - SATURATED), 0)


def tune(view: View, config: IndexConfig, *, target: float | None = None, queries: int | None = None,
         seed: int = 0, served: list | None = None) -> tuple[SearchParams, dict]:
    """The cheapest search reaching ``target`` on sample queries, and a report of the trial.

    ``served``: query rows the index has served (:mod:`gmmlsh.index.served`); without
    them, stored vectors are the sample (and the target is raised by :data:`STORED_MARGIN`).
    ``queries``: the sample's size (default: :data:`QUERIES` stored vectors, or every
    served query given). ``target``: recall@10 the sample's lower confidence bound must
    reach (default :data:`TARGET_RECALL`). The report says what was chosen and why, what it
    cost and how long the tuning took.
    """
    t0 = time.perf_counter()
    qs, source = _sample(view, config, queries or (len(served) if served else QUERIES), seed, served)
    if target is None:
        target = TARGET_RECALL + (0.0 if served else STORED_MARGIN)
    true = truth(view, qs)  # its exact search warms the mirror's pages too
    t_truth = time.perf_counter() - t0
    hash_s = _hash_seconds(qs[:16], config)
    step = max(1, len(qs) // EXPLORE_QUERIES)
    trials = _Trials(view, qs[::step][:EXPLORE_QUERIES], true[::step][:EXPLORE_QUERIES], config, target, hash_s,
                     deadline=t0 + WIDEN_SECONDS)
    rank_choices = sorted({min(b, RANK_BITS_MAX, config.bits) for b in (2, RANK_BITS_MAX)}, reverse=True)
    reached = _sketch_settings(trials, view.list_count, rank_choices)
    ladder_widest = SearchParams(probes=0, shortlist=_WIDE[0], rank_bits=rank_choices[0], candidates=_WIDE[1])
    if not reached:  # nothing on the ladder: widened, each step cheaper than any postings search
        cap = trials.seconds(_CHEAPEST_POSTINGS) if view.postings_search else float("inf")
        start = replace(ladder_widest, probes=_saturated(trials, view.list_count, rank_choices[0]))
        # the lists recall what all do: the shortlist first; the start missed in the exploration
        params, r = _widened(trials, qs, true, start, cap, turn=1, at_start=trials.recall(start))
        if r >= target:
            reached.append((trials.seconds(params), params, r))
    rival = min((s for s, _, _ in reached), default=float("inf"))
    reached += _postings_settings(trials, rival)
    finalists = _finalists(view, qs, true, config, target, reached)
    if not finalists and rival < float("inf"):  # the sketch searches that seemed to reach it did not:
        # the postings searches, unless slower than the sketch search widened a few steps (below)
        postings = _postings_settings(trials, NEAR_MISS * rival)
        reached += postings
        finalists = _finalists(view, qs, true, config, target, postings)
    widened = not finalists
    if widened:  # nothing reaches it on the whole sample: widen the search until it does
        finalists = _widest(trials, qs, true, reached, ladder_widest)
    # the finalists timed again, best of three passes: one noisy pass must not decide
    best = min(((trials.seconds(p, rounds=3, qs=qs[:TIMING_QUERIES]), p, r) for p, r in finalists),
               key=lambda x: x[0])
    exact_s = _exact_seconds(view, qs[:8], (EXACT_MARGIN if best[2] < target else 1.0) * best[0])
    report = {"sample": source, "target_recall": target, "exact_ms": round(exact_s * 1e3, 3),
              "hash_ms": round(hash_s * 1e3, 3), "search_ms": round(best[0] * 1e3, 3),
              "sample_recall_bound": round(best[2], 4), "trials": trials.count,
              "truth_seconds": round(t_truth, 2), "widened": widened}
    if widened and trials.late:
        report["widening_stopped"] = f"at {WIDEN_SECONDS:.0f} s"  # the time limit, not the target, ended it
    if best[2] < target:
        report["widest_recall_bound"] = round(best[2], 4)
    exact_wins = exact_s <= best[0] or (best[2] < target and exact_s <= EXACT_MARGIN * best[0])
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if exact_wins:
        report["chosen"] = "exact"
        return replace(best[1], exact=True, rare=0.0), report
    report["chosen"] = "postings" if best[1].rare > 0 else "sketch"
    return best[1], report


def _finalists(view: View, qs: list[Prepared], true: list, config: IndexConfig, target: float,
               reached: list[tuple[float, SearchParams, float]]) -> list[tuple[SearchParams, float]]:
    """The fastest :data:`FINALISTS` of ``reached`` whose answers reach ``target`` on the whole
    sample, scored (the exploration counted rows reached, on part of it), with their recall."""
    finalists: list[tuple[SearchParams, float]] = []
    for _, params, _ in sorted(reached, key=lambda x: x[0]):
        if len(finalists) == FINALISTS:
            break
        r = _recall(view, qs, true, params, config, scored=True)
        if r >= target:
            finalists.append((params, r))
    return finalists


def _exact_seconds(view: View, qs: list[Prepared], rival: float) -> float:
    """Seconds per exact search, one query at a time (as a query runs: alone), over ``qs``, or
    over fewer once their time alone puts the mean over all of ``qs`` above ``rival``'s: exact
    search then loses to it whatever the others take. A process's first exact search, which
    loads or compiles its kernel, runs untimed first (timed, on a cold cache it made exact
    search lose to a sketch search that missed the target)."""
    if qs and not exact_loaded(view):
        run_exact(view, qs[0])
    spent, timed = 0.0, 0
    for q in qs:
        t0 = time.perf_counter()
        run_exact(view, q)
        spent += time.perf_counter() - t0
        timed += 1
        if spent > len(qs) * rival:
            break
    return spent / max(1, timed)
