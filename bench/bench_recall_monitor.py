"""The recall monitor on live traffic: its estimate against the true recall of what was served.

    python -m bench.bench_recall_monitor [--stream 20000] [--out bench/out/monitor.md]

Each arm serves a stream of held-out queries one at a time through the Python API (the same
``Index.query`` a server's workers run), numba on one thread; a share of them is recorded by
the index's :class:`~gmmlsh.index.monitor.Recorder` and, as soon as the process has handed them
to the inbox (every :data:`~gmmlsh.index.monitor.FLUSH_RECORDS` records; here also every 10,000
queries, for the 10 s a quiet process waits), checked by the monitor's :class:`~gmmlsh.index.monitor.Checker` as
the upkeep worker runs it (here in process, on one thread, its CPU time counted); a re-tune the
monitor asks for is run then (``Index.maintain``, what the upkeep worker does). The true
recall@10 of every served answer comes from exact search (its similarities against the true
10th: ties count).

Arms:

1. **Fashion-MNIST** (60,000 training images, ``gmmlsh build --tune-queries`` on 128 test
   images), the stream cycling over 2,000 other test images: the monitor at its default budget
   (the share derived from the measured costs), then at a fixed share of 5 %.
2. **Mistuned**: the same index with a published tuning that probes one list (recall@10 ≈ 0.8):
   as a tuning (the monitor must ask for a re-tune; queries until it does, recall after), and as
   the operator's override (``search={"probes": 1}``: reported, never re-tuned).
3. **Brown passages grown to 200,000** (``gmmlsh build`` without ``--tune-queries``): what the
   build chose and its recall on the 500 held-out passages from the first query; then the search
   the tuner had chosen on stored vectors (0.716) published, and the monitor at a fixed share.

Coverage: besides the one live draw of each arm, the interval's coverage of the true served
recall over 1,000 re-draws of which queries the monitor checks (Bernoulli at the arm's share,
on the per-query recalls measured), and how often a sound tuning would be re-tuned for nothing
under the monitor's rule (interval below the target) and under the lower bound alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench import sparse_data
from bench.common import DATA, build_index, emit
from gmmlsh.core import parallel
from gmmlsh.index import monitor, tuner
from gmmlsh.index.config import SearchParams
from gmmlsh.index.index import Index

#: Queries after which held records are checked whatever their number (a quiet process's 10 s).
CHECK_EVERY = 10_000
REDRAWS = 1000


def _publish(ix: Index, params: SearchParams) -> None:
    """A tuning as if the tuner had chosen it (tuned on queries: no served-sample re-tune comes)."""
    ix.mirror.publish(lambda state: state.update(search=params.to_dict(), tuned_on_queries=True))


def _row(Q, i: int):
    return Q[i] if sp.issparse(Q) else Q[i]


class Stream:
    """Serves queries, checks the monitor's records every CHECK_EVERY, runs the re-tunes it asks for."""

    def __init__(self, ix: Index, Q, tenth: np.ndarray):
        self.ix, self.Q, self.tenth = ix, Q, tenth
        self.served_cpu = self.checker_cpu = 0.0
        self.served = 0
        self.recalls: list[float] = []  # true recall of each served answer, this epoch
        self.retuned_at: list[int] = []
        self.checker = monitor.Checker(ix.mirror, ix.config, ix.recorder.budget, ix.overrides, budgeted=False)

    def run(self, count: int, retune: bool = True, stop_after_retune: bool = False) -> None:
        n = self.Q.shape[0]
        rows = [_row(self.Q, i) for i in range(n)]
        for _ in range(count):
            i = self.served % n
            t0 = time.thread_time()
            res = self.ix.query(rows[i], k=10)
            self.served_cpu += time.thread_time() - t0
            self.served += 1
            sims = np.array([nb.similarity for nb in res.neighbors])
            self.recalls.append(min(10, int(np.count_nonzero(sims >= self.tenth[i] - 1e-9))) / 10)
            due = monitor.pending(self.ix.mirror.dir) or self.served % CHECK_EVERY == 0
            if due and self.check(retune) and stop_after_retune:
                return

    def check(self, retune: bool) -> bool:
        self.ix.flush_recorded()
        t0 = time.thread_time()
        self.checker.run()
        self.checker_cpu += time.thread_time() - t0
        if retune and monitor.retune_requested(self.ix.mirror.dir, self.ix.view()):
            self.last = self.report()
            self.ix.maintain()
            self.retuned_at.append(self.served)
            self.recalls_before, self.recalls = self.recalls, []
            return True
        return False

    def report(self) -> dict:
        return monitor.report(self.ix.mirror.dir, self.ix.recorder.budget, self.ix.recorder.share)


def _coverage(recalls: np.ndarray, share: float, rng: np.random.Generator) -> dict:
    """Over REDRAWS re-draws of the checked queries (Bernoulli at ``share``): how often the 90 %
    interval covers the true mean, and how often a check at CHECKS would re-tune under each rule."""
    truth = float(recalls.mean())
    covered, upper_rule, lower_rule, n = 0, 0, 0, 0
    for _ in range(REDRAWS):
        picked = recalls[rng.random(recalls.shape[0]) < share][:monitor.WINDOW]
        if picked.shape[0] < 2:
            continue
        n += 1
        _, lo, hi = monitor.interval(picked)
        covered += lo <= truth <= hi
        looks = [c for c in monitor.CHECKS if c <= picked.shape[0]]
        upper_rule += any(monitor.interval(picked[:c])[2] < tuner.TARGET_RECALL for c in looks)
        lower_rule += any(monitor.interval(picked[:c])[1] < tuner.TARGET_RECALL for c in looks)
    return {"draws": n, "coverage": covered / max(n, 1), "retune_upper_rule": upper_rule / max(n, 1),
            "retune_lower_rule": lower_rule / max(n, 1), "mean_checked": float(recalls.shape[0] * share)}


def _line(name: str, st: Stream, rep: dict, truth: float) -> dict:
    covered = rep["lower"] is not None and rep["lower"] <= truth <= rep["upper"]
    return {"arm": name, "served": st.served, "share": rep.get("share"), "checked": rep["checked"],
            "estimate": rep["estimate"], "lower": rep["lower"], "upper": rep["upper"], "truth": truth,
            "covered": covered, "served_cpu_s": st.served_cpu, "checker_cpu_s": st.checker_cpu,
            "cost": st.checker_cpu / max(st.served_cpu, 1e-9), "exact_ms": rep["exact_ms"]}


def fashion(workdir: Path, stream: int, rng: np.random.Generator) -> dict:
    d = np.load(DATA / "fashion-mnist.npz")
    Q = d["test"][1000:3000].astype(np.float32)
    path = workdir / "fashion"
    build_index(DATA / "fashion-mnist.npz", ["--index", str(path)], "--npz-key", "train",
                "--tune-queries", str(DATA / "fashion-mnist.npz"), "--tune-queries-key", "test")
    out: dict = {"rows": 60000, "arms": []}
    with Index.open(path, maintain=False) as ix:
        exact = ix.query_batch(Q, k=10, mode="exact")
        tenth = np.array([r.neighbors[9].similarity for r in exact])
        tuned = ix.view().search
        out["search"] = tuned.to_dict()
        # the query side's own cost: the same queries served with the monitor off, and on at a share of 1
        per = {}
        for budget, share in ((0.0, None), (monitor.BUDGET, 1.0), (0.0, None), (monitor.BUDGET, 1.0)):
            ix.recorder.budget, ix.recorder.fixed_share = budget, share
            t0 = time.thread_time()
            for q in Q[:1000]:
                ix.query(q, k=10)
            spent = (time.thread_time() - t0) / 1000
            per[share] = min(per.get(share, spent), spent)
            ix.recorder.flush()
        shutil.rmtree(ix.mirror.dir / "monitor", ignore_errors=True)
        out["record_overhead_us"] = 1e6 * (per[1.0] - per[None])
        out["served_us"] = 1e6 * per[None]
        ix.recorder.budget, ix.recorder.fixed_share = monitor.BUDGET, None
        # 1. the default budget: the first records measure the exact cost, the share follows from it
        ix.recorder.fixed_share = 0.01
        st = Stream(ix, Q, tenth)
        st.run(1000, retune=False)  # the exact cost measured on these
        ix.recorder.fixed_share = None
        st = Stream(ix, Q, tenth)
        monitor.tuned(ix.mirror.dir, ix.mirror.locked)  # a new epoch for the measured stream
        st.run(stream, retune=False)
        rec = np.array(st.recalls)
        out["arms"].append({**_line("fashion, default budget", st, st.report(), float(rec.mean())),
                            "redraws": _coverage(rec, st.report()["share"], rng)})
        # 1b. a fixed 5 % share
        ix.recorder.fixed_share = 0.05
        monitor.tuned(ix.mirror.dir, ix.mirror.locked)
        st = Stream(ix, Q, tenth)
        st.run(stream, retune=False)
        rec = np.array(st.recalls)
        out["arms"].append({**_line("fashion, share 5 %", st, st.report(), float(rec.mean())),
                            "redraws": _coverage(rec, 0.05, rng)})
        # 2. mistuned: a tuning that probes one list, at the default budget and at 5 %
        for share in (None, 0.05):
            ix.recorder.fixed_share = share
            _publish(ix, tuned.with_overrides(probes=1))
            monitor.tuned(ix.mirror.dir, ix.mirror.locked)
            st = Stream(ix, Q, tenth)
            st.run(10 * stream, stop_after_retune=True)
            before = np.array(st.recalls) if not st.retuned_at else None
            last = getattr(st, "last", st.report())
            arm = {"arm": f"mistuned (probes 1), {'default budget' if share is None else 'share 5 %'}",
                   "retuned_after": st.retuned_at[0] if st.retuned_at else None, "at_request": last,
                   "search_after": ix.view().search.to_dict()}
            if st.retuned_at:
                st.run(2000, retune=False)
                arm["recall_after"] = float(np.mean(st.recalls))
            else:
                arm["recall_before"] = float(before.mean())
            out["arms"].append(arm)
            _publish(ix, tuned)
        # 2b. the same as the operator's override: reported, never re-tuned
    with Index.open(path, maintain=False, search={"probes": 1}) as ix:
        ix.recorder.fixed_share = 0.05
        monitor.tuned(ix.mirror.dir, ix.mirror.locked)
        st = Stream(ix, Q, tenth)
        st.run(stream)
        rec = np.array(st.recalls)
        rep = st.report()
        out["arms"].append({**_line("mistuned as an override (probes 1), share 5 %", st, rep, float(rec.mean())),
                            "retuned": bool(st.retuned_at), "note": rep.get("note"),
                            "redraws": _coverage(rec, 0.05, rng)})
    return out


def brown(workdir: Path, rng: np.random.Generator, share: float) -> dict:
    n = 200_000
    Q = sparse_data.queries(500)
    _, true_sims = sparse_data.truth(n, 500)
    tenth = true_sims[:, 9]
    path = workdir / "brown"
    t = time.perf_counter()
    summary = build_index(sparse_data.data_path(n), ["--index", str(path)])
    out: dict = {"rows": n, "build_s": time.perf_counter() - t}
    tune = summary["upkeep"]["tune"][-1]
    out["build_tuning"] = {k: tune.get(k) for k in ("sample", "chosen", "tuned_choice", "near_copies", "advice")}
    with Index.open(path, maintain=False) as ix:
        ix.recorder.fixed_share = share
        first = [ix.query(Q[i], k=10) for i in range(200)]
        out["from_first_query"] = {
            "modes": sorted({r.mode for r in first}),
            "recall": float(np.mean([min(10, sum(nb.similarity >= tenth[i] - 1e-9 for nb in r.neighbors)) / 10
                                     for i, r in enumerate(first)]))}
        if tune.get("tuned_search"):  # the search the tuner chose on stored vectors, as it would answer
            _publish(ix, SearchParams.from_dict(tune["tuned_search"]))
            ix.mirror.publish(lambda state: state.update(tuned_on_queries=False))
            monitor.tuned(ix.mirror.dir, ix.mirror.locked)
            st = Stream(ix, Q, tenth)
            st.run(500, stop_after_retune=True)
            last = getattr(st, "last", st.report())
            arm = {"arm": f"Brown 200k, stored-vector tuning, share {share:.0%}",
                   "retuned_after": st.retuned_at[0] if st.retuned_at else None, "at_request": last,
                   "search_after": ix.view().search.to_dict(),
                   "truth_before": float(np.mean(st.recalls_before if st.retuned_at else st.recalls))}
            if st.retuned_at:
                done = st.served
                st.run(500 - done, retune=False)
                arm["recall_after"] = float(np.mean(st.recalls)) if st.recalls else None
                arm["mode_after"] = ix.query(Q[0], k=10).mode
            out["monitor"] = arm
    return out


def _fashion_report(f: dict) -> list[str]:
    L = [f"Fashion-MNIST, {f['rows']:,} rows, tuned on 128 test images: the served search "
         f"{json.dumps(f['search'])}; a served query {f['served_us']:.0f} µs of CPU, recording one for the "
         f"monitor {f['record_overhead_us']:.1f} µs more (share 1).", "",
         "| arm | served | share | checked | estimate (90 % interval) | true served recall | covered | "
         "monitor's CPU ÷ served CPU | exact re-run |",
         "|---|---:|---:|---:|---|---:|---|---:|---:|"]
    for a in f["arms"]:
        if "estimate" not in a:
            continue
        est = "–" if a["estimate"] is None else f"{a['estimate']:.4f}"
        if a["lower"] is not None:
            est += f" ({a['lower']:.4f}–{a['upper']:.4f})"
        L.append(f"| {a['arm']} | {a['served']:,} | {a['share']:.4%} | {a['checked']:,} | {est} | {a['truth']:.4f} | "
                 f"{'yes' if a['covered'] else 'no'} | {a['cost']:.2%} | {a['exact_ms']:.2f} ms |")
    L += ["", "| arm | re-draws | coverage of the truth | re-tuned for nothing: interval below target (the "
          "monitor's rule) | lower bound below target | records a draw |", "|---|---:|---:|---:|---:|---:|"]
    for a in f["arms"]:
        if "redraws" in a:
            r = a["redraws"]
            L.append(f"| {a['arm']} | {r['draws']:,} | {r['coverage']:.1%} | {r['retune_upper_rule']:.1%} | "
                     f"{r['retune_lower_rule']:.1%} | {r['mean_checked']:.0f} |")
    L.append("")
    for a in f["arms"]:
        if a["arm"].startswith("mistuned (probes 1)"):
            at = a["at_request"]
            if a["retuned_after"]:
                L.append(f"- {a['arm']}: the monitor asked for a re-tune after **{a['retuned_after']:,} queries** "
                         f"({at['checked']} checked: estimate {at['estimate']}, interval {at['lower']}–{at['upper']}); "
                         f"re-tuned to {json.dumps(a['search_after'])}, recall@10 after {a['recall_after']:.4f}.")
            else:
                L.append(f"- {a['arm']}: no re-tune within the stream (true recall {a['recall_before']:.4f}).")
        if a["arm"].startswith("mistuned as an override"):
            L.append(f"- {a['arm']}: estimate {a['estimate']} against {a['truth']:.4f} served; re-tuned: "
                     f"{a['retuned']}; the report says: {a['note']!r}.")
    return L


def _brown_report(b: dict) -> list[str]:
    bt = b["build_tuning"]
    L = ["", f"Brown passages grown to {b['rows']:,} (`gmmlsh build`, no `--tune-queries`, {b['build_s']:.0f} s): "
         f"the tuner chose {bt['tuned_choice'] or bt['chosen']} on stored vectors; near-copy signal "
         f"{json.dumps(bt['near_copies'])}; the index answers by **{bt['chosen']}**. From the first query: "
         f"modes {b['from_first_query']['modes']}, recall@10 **{b['from_first_query']['recall']:.3f}** "
         f"(200 held-out passages)."]
    m = b.get("monitor")
    if m:
        at = m["at_request"]
        L.append(f"- {m['arm']} (true recall of what it served: {m['truth_before']:.3f}): "
                 + (f"the monitor asked for a re-tune after **{m['retuned_after']} queries** ({at['checked']} "
                    f"checked: estimate {at['estimate']}, interval {at['lower']}–{at['upper']}); then "
                    f"{json.dumps(m['search_after'])}, mode {m['mode_after']}, recall@10 after "
                    f"{m['recall_after']:.3f}." if m["retuned_after"] else "no re-tune asked."))
    return L


def report(res: dict) -> list[str]:
    return (_fashion_report(res["fashion"]) if "fashion" in res else []) + \
        (_brown_report(res["brown"]) if "brown" in res else [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", type=int, default=20000, help="queries each Fashion-MNIST arm serves")
    p.add_argument("--brown-share", type=float, default=0.3)
    p.add_argument("--arms", default="fashion,brown", help="fashion, brown or both")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    parallel.set_threads(1)
    rng = np.random.default_rng(34)
    workdir = Path(tempfile.mkdtemp(prefix="gmmlsh-monitor-"))
    try:
        res = {"fashion": fashion(workdir, a.stream, rng)} if "fashion" in a.arms else {}
        if "brown" in a.arms:
            res["brown"] = brown(workdir, rng, a.brown_share)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=float))
    emit(report(res), a.out)


if __name__ == "__main__":
    main()
