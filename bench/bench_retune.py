"""What a re-tune costs at n: ``Index.maintain(queries=…)`` on each data shape (issue 30, acceptance 2).

For each shape of the data zoo (:mod:`bench.zoo`): ``gmmlsh build`` of its first ``n`` rows
(or an index built before, ``--keep``), then, in one process, ``--rounds`` re-tunes on
``--queries`` held-out queries, each timed whole and in parts as the tuner reports them (its
truth — an exact search of every sample query —, its trials, the setting chosen).

    python -m bench.bench_retune --shapes fashion,signed,strokes,text --n 1000000 --workdir DIR \\
        [--queries 256] [--rounds 2] [--keep] [--grow-to N] [--out bench/out/retune-1m.md]

``--grow-to N``: before the re-tunes, the index grows to ``N`` rows by upserts of the shape's
next rows (batches of 10,000), and the upkeep that falls due runs (at twice the rows the fit
was made at, a new fit with new profiles): the re-tune an index meets once it has doubled.

The index stays in ``--workdir`` (``lmdb-SHAPE-N``): ~10 GB a shape at 1M (twice that grown
to 2M); without ``--keep`` it is removed after its shape's rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from bench import zoo
from bench.common import build_index, emit, store_args
from gmmlsh.index.index import Index

#: The tuned search's knobs the report names (those set).
SETTING = ("probes", "shortlist", "candidates", "rare", "exact")


#: Rows an upsert of ``--grow-to`` carries.
GROW_BATCH = 10_000


def grow(where: Path, shape: zoo.Shape, n: int, to: int) -> dict:
    """Rows ``n … to − 1`` of ``shape`` upserted into the index at ``where`` (ids continue the
    build's row numbers), then the upkeep due: the seconds of each, and the upkeep's report."""
    with Index.open(where, maintain=False) as ix:
        t = time.perf_counter()
        lo = n
        while lo < to:  # a generator block at a time, each made once (a stroke block takes ~1 s)
            hi = min(to, (lo // shape.grown.base + 1) * shape.grown.base)
            X = shape.grown.rows(lo, hi)
            for a in range(0, hi - lo, GROW_BATCH):
                b = min(hi - lo, a + GROW_BATCH)
                ix.upsert([str(i) for i in range(lo + a, lo + b)], X[a:b])
            lo = hi
        upserts = time.perf_counter() - t
        t = time.perf_counter()
        done = ix.maintain()
        return {"upsert_seconds": upserts, "upkeep_seconds": time.perf_counter() - t,
                "fit": done.get("fit"), "lists": ix.view().list_count}


def retune(where: Path, queries, rounds: int) -> list[dict]:
    """``rounds`` re-tunes on ``queries``: each one's seconds and the tuner's report."""
    out = []
    with Index.open(where, maintain=False) as ix:
        for _ in range(rounds):
            t = time.perf_counter()
            done = ix.maintain(queries=queries)
            tuned = (done.get("tune") or [{}])[-1]
            search = ix.stats()["search"]
            out.append({"seconds": time.perf_counter() - t, **tuned,
                        "setting": ", ".join(f"{k} {search[k]}" for k in SETTING if search.get(k))})
    return out


#: The report's columns: (heading, what a run's row shows).
COLUMNS = (("re-tune s", lambda run: f"{run['seconds']:.1f}"), ("truth s", lambda run: run.get("truth_seconds")),
           ("trials", lambda run: run.get("trials")), ("chosen", lambda run: run.get("chosen")),
           ("recall bound", lambda run: run.get("sample_recall_bound")),
           ("search ms", lambda run: run.get("search_ms")), ("setting", lambda run: run.get("setting")))


def report(rows: list[dict], a: argparse.Namespace) -> list[str]:
    """The markdown table: a row per re-tune, the build's time on each shape's first; then how
    each index grew (``--grow-to``)."""
    grown = f" --grow-to {a.grow_to}" if a.grow_to else ""
    size = f"{a.n:,} rows grown to {a.grow_to:,}" if a.grow_to else f"{a.n:,} rows"
    lines = [f"    python -m bench.bench_retune --shapes {a.shapes} --n {a.n} --queries {a.queries} "
             f"--rounds {a.rounds}{grown}", "",
             f"| shape ({size}) | build | " + " | ".join(h for h, _ in COLUMNS) + " |",
             "|---|---:|" + "---:|" * (len(COLUMNS) - 1) + "---|"]
    for r in rows:
        took = r["build_seconds"]
        for i, run in enumerate(r["runs"]):
            built = f"{took:.1f} s ({a.n / took:,.0f} rows/s)" if took and not i else ""
            cells = [str(show(run)) if show(run) is not None else "—" for _, show in COLUMNS]
            lines.append(f"| {r['shape']} | {built} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("grown"):
            g = r["grown"]
            lines.append(f"\n- {r['shape']}: upserts {g['upsert_seconds']:.1f} s, then upkeep "
                         f"{g['upkeep_seconds']:.1f} s (fit: {g['fit']}); {g['lists']:,} lists")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="fashion,signed,strokes,text")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=256, help="held-out queries tuned on")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--keep", action="store_true", help="keep each index (and use one already built)")
    p.add_argument("--grow-to", type=int, help="grow each index to this many rows before the re-tunes")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.grow_to is not None and a.grow_to <= a.n:
        p.error(f"--grow-to: must be above --n ({a.n:,}), got {a.grow_to:,}")
    rows = []
    for name in a.shapes.split(","):
        shape = zoo.SHAPES[name]
        where = a.workdir / f"lmdb-{name}-{a.n}"
        built = None
        if not (a.keep and where.exists()):
            shutil.rmtree(where, ignore_errors=True)
            shape.data(a.n)
            built = build_index(shape.path(a.n), store_args(where))
        grown = grow(where, shape, a.n, a.grow_to) if a.grow_to else None
        runs = retune(where, shape.queries(a.queries, 0), a.rounds)
        rows.append({"shape": name, "build_seconds": built and built["command_seconds"], "grown": grown, "runs": runs})
        print(json.dumps(rows[-1], default=str), flush=True)
        if not a.keep:
            shutil.rmtree(where, ignore_errors=True)
    emit(report(rows, a), a.out)
    if a.out:
        a.out.with_suffix(".json").write_text(json.dumps(rows, default=str, indent=1))


if __name__ == "__main__":
    main()
