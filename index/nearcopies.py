"""Near-copies: when stored vectors cannot stand in for the queries to come.

Until an index has served enough queries (or is given sample queries: ``gmmlsh build
--tune-queries``), the tuner's sample queries are stored vectors, each leaving itself out.
Where the data hold *near-copies* — many rows made from one original: augmented images,
resampled documents — a stored vector's 10 nearest are its own copies, standing far above
the neighbours a new query finds, and a search tuned on such easy queries misses on new ones
(the Brown passages grown to 200,000 by mixing: 0.716 where the tuner planned 0.98).

Nothing the index holds tells a near-copy apart from a true close neighbour in general: a
query like the stored rows (a new member of a tight topic) has the same close neighbours. What
it can see is the shape the copies leave: a stored vector's neighbours fall steeply from its
10th to its 50th (the copies end) and then lie flat (the rows it has nothing special in common
with). :func:`signal` measures that drop against the flat part's, the median over a sample of
stored vectors, :data:`KNEE` and over says near-copies. Measured on a sample of 24 stored
vectors each (new queries for comparison, which have no copies to find):

=========================================  =============  ============
data                                        stored vectors  new queries
=========================================  =============  ============
Brown passages grown to 200,000 (mixtures)  3.26           1.38
Brown passages grown to 20,000              1.36           1.02
Brown passages, 4,505                       1.20           1.06
tf-idf topic corpus, 6,400 (tests)          0.36           0.34
Fashion-MNIST 60,000                        0.85           0.84
zoo fashion / strokes / signed, 100,000     0.89 / 1.07 / 0.93
=========================================  =============  ============

Where it says near-copies, a tuning on stored vectors is not trusted: the index answers by
exact search — the one search known to meet the target — until it has served enough queries
to tune on (the upkeep then re-tunes by itself) or is given sample queries, and the build says
so and points to ``--tune-queries``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gmmlsh.index.config import IndexConfig, SearchParams
from gmmlsh.index.mirror import View
from gmmlsh.index.search import prepare_row, run_exact_many
from gmmlsh.index.tuner import MIN_QUERIES

#: Stored vectors the signal is measured on; neighbours each (the flat part ends there).
SAMPLE = 32
DEPTH = 200
#: The 10th → 50th drop against the 50th → DEPTH-th at and above which the data hold near-copies.
KNEE = 2.0
#: What the build and ``stats`` say when they do.
ADVICE = ("the data hold near-copies (each stored vector's nearest neighbours stand far above the rest): "
          "stored vectors are easier queries than new ones, so a search tuned on them cannot be trusted; "
          "the index answers by exact search until it has served {queries} queries to tune on. To tune now, "
          "give sample queries like those to come: gmmlsh build --tune-queries FILE (or Index.maintain(queries=...))")


def signal(view: View, config: IndexConfig, seed: int = 0) -> dict | None:
    """The near-copy signal of an index's stored vectors (see the module docstring), or None
    where the index is too small to tell (fewer than ``2 · DEPTH`` live rows)."""
    live = view.live_rows()
    if live.shape[0] < 2 * DEPTH:
        return None
    rows = np.random.default_rng(seed).choice(live, size=min(SAMPLE, live.shape[0]), replace=False)
    knees, tenth, flat = [], [], []
    for _, sims, _ in run_exact_many(view, [prepare_row(view, int(r), config) for r in rows], DEPTH):
        s = np.sort(sims)[::-1]
        if s.shape[0] < DEPTH:
            continue
        s10, s50, s_end = s[9], s[49], s[DEPTH - 1]
        knees.append((s10 - s50) / max(s50 - s_end, 1e-9))
        tenth.append(s10)
        flat.append(s_end)
    if not knees:
        return None
    knee = float(np.median(knees))
    return {"knee": round(knee, 3), "near_copies": knee >= KNEE, "sample": len(knees),
            "tenth_similarity": round(float(np.median(tenth)), 4),
            f"similarity_at_{DEPTH}": round(float(np.median(flat)), 4)}


def guard(view: View, config: IndexConfig, params: SearchParams, report: dict) -> tuple[SearchParams, dict]:
    """A tuning made on stored vectors, kept — or, where the data hold near-copies, exact search
    instead (the report says why, and what the tuner had chosen)."""
    sig = signal(view, config, seed=config.seed)
    if sig is None:
        return params, report
    report = {**report, "near_copies": sig}
    if sig["near_copies"]:  # said even where exact search won anyway: it stops winning as the index grows
        report["advice"] = ADVICE.format(queries=MIN_QUERIES)
        if not params.exact:
            report.update(tuned_choice=report.get("chosen"), tuned_search=params.to_dict(), chosen="exact")
            params = replace(params, exact=True, rare=0.0)
    return params, report
