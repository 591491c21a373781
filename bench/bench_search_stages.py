"""What each stage of the sketch search costs on a built index, for given settings.

The search kernel (:func:`gmmlsh.core.search.search`) run stage by stage on the index's mirror,
one query at a time, one thread: choosing the lists, the scan of their first-stage rows with
the shortlist's selection, the rank pass, the candidates' selection, the coarse GMM (sparse rows:
exact) and the exact GMM of the best. Each stage's mean time a query over ``--queries`` held-out
queries of a zoo shape (the second of two passes: the first maps the pages in), per setting.

    python -m bench.bench_search_stages INDEX --shape strokes --search 384/3000/300 --search 64/500/200

``--search P/S/C``: probes, shortlist, candidates (4 rank bits). Where a stage's cost moves
between settings tells which stage a different first stage would have to make cheaper.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import emit
from bench.zoo import SHAPES
from gmmlsh.core.codes import WORD
from gmmlsh.core.search import _coarse_best, _rank, chosen_lists, exact_of, shortlist_of
from gmmlsh.core.select import select
from gmmlsh.index.config import RANK_BITS_MAX, SearchParams
from gmmlsh.index.index import Index
from gmmlsh.index.search import budget, prepare_vectors

STAGES = ("lists", "scan and shortlist", "rank", "select", "coarse", "exact")


def stage_times(view, config, qs: list, params: SearchParams, rounds: int = 2) -> tuple[np.ndarray, int]:
    """Mean seconds a query of each of :data:`STAGES` (the last of ``rounds`` passes) and the
    rows the last query scanned. The scan's stage includes choosing the lists again (the kernel
    does both)."""
    rows, lists = view.row_bundle, view.lists
    b = budget(view, params, config)
    out_rows, out_sims = np.empty(params.candidates, np.int64), np.empty(params.candidates)
    took = np.zeros(len(STAGES))
    scanned = 0
    for _ in range(rounds):
        took[:] = 0.0
        for p in qs:
            q = p.q
            t = [time.perf_counter()]
            chosen_lists(q, lists, b)
            t.append(time.perf_counter())
            short, scanned = shortlist_of(q, rows, lists, b)
            t.append(time.perf_counter())
            found, ranked = _rank(q, rows, lists, b, short)
            t.append(time.perf_counter())
            best = select(found, ranked, short.shape[0], b.candidates, b.words * WORD)
            t.append(time.perf_counter())
            best, _ = _coarse_best(q, rows, best, b.refine)
            t.append(time.perf_counter())
            exact_of(q, rows, best, out_rows, out_sims)
            t.append(time.perf_counter())
            took += np.diff(t)
    return took / len(qs), int(scanned)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("index", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="strokes")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--search", action="append", required=True, metavar="P/S/C",
                   help="probes/shortlist/candidates, repeatable")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    settings = []
    for text in a.search:
        try:
            probes, shortlist, candidates = (int(v) for v in text.split("/"))
        except ValueError:
            p.error(f"--search: expected P/S/C (three integers), got {text!r}")
        settings.append(SearchParams(probes=probes, shortlist=shortlist, rank_bits=RANK_BITS_MAX,
                                     candidates=candidates))
    ix = Index.open(a.index, maintain=False)
    ix.warm()
    view = ix.view()
    qs = prepare_vectors(SHAPES[a.shape].queries(a.queries, 0).astype(np.float32), ix.config)
    L = [f"    python -m bench.bench_search_stages INDEX --shape {a.shape} --queries {a.queries} "
         + " ".join(f"--search {s}" for s in a.search), "",
         f"{view.rows:,} rows, {view.list_count:,} lists; ms a query, one thread (the scan's column includes "
         "choosing the lists again; search: every column but the first):", "",
         "| probes | shortlist | candidates | rows scanned | " + " | ".join(STAGES) + " | search |",
         "|---:|---:|---:|---:|" + "---:|" * (len(STAGES) + 1)]
    for params in settings:
        took, scanned = stage_times(view, ix.config, qs, params)
        ms = took * 1e3
        L.append(f"| {params.probes} | {params.shortlist:,} | {params.candidates} | {scanned:,} | "
                 + " | ".join(f"{v:.3f}" for v in ms) + f" | {ms[1:].sum():.3f} |")
    ix.close()
    emit(L, a.out)


if __name__ == "__main__":
    main()
