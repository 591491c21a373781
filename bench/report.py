"""Benchmark report with plots: speed vs recall, the papers' estimator plots, and GMM vs RBF as neighbours.

    python -m bench.report [--out DIR] [--quick] [--n N] [--queries Q] [--no-peer]
    python -m bench.report --data FILE [--npz-key K --npz-label-key L | --label-column C] [--out DIR]
    gmmlsh bench report --data FILE --out DIR

Users pick a similarity and an index by looking, so this writes one folder:
``report.md`` (the numbers, with the figures inline), ``report.json`` (every
number), ``figures.json`` (what each figure shows: axis labels, series, point
counts — so a test can check the pictures are not empty) and the figures:

* ``recall_qps.png`` — recall@10 against queries/s (one thread), ann-benchmarks
  style: ``auto`` (the search the index tuned for itself), as tuned and over the
  rerank budget C, ``exact``, ``nrff``, pynndescent with the GMM metric; build
  time and bytes per vector in a table beside it. Measured in one run.
* ``estimator_mse.png`` — empirical MSE of GCWS (0-bit, and b-bit corrected) and
  of NRFF against k, on real pairs, over the theory (GMM(1−GMM)/k, V_n/k).
* ``var_over_e2.png`` — Var/E² against E (the papers' Figure 3) with empirical points.
* ``knn_accuracy.png`` — k-NN classification accuracy on labelled data: GMM exact,
  GMM through ``auto``, RBF through ``nrff``, cosine (= exact RBF for every γ), L2.
* ``samples_to_recall.png`` — how many samples k each sketch needs to find its own
  kernel's exact neighbours (no rerank), and the sketch-only k-NN accuracy.

Without ``--data`` the data is Fashion-MNIST (``$GMMLSH_DATA`` or
``../shared/data``): the train split is the index, the test split the queries.
With ``--data`` any file ``gmmlsh build`` reads is used; a random ``--queries``
rows (at most 10 %) are held out as queries, labels come from the file
(svmlight labels, ``--npz-label-key``, ``--label-column``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bench.report_data import (  # noqa: E402
    K_NN,
    KNN_KS,
    NRFF_GAMMA,
    NRFF_K,
    ROOT,
    Dataset,
    Settings,
    ground_truth,
    load_file,
    load_fmnist,
)
from bench.report_estimators import estimators  # noqa: E402
from bench.report_figures import (  # noqa: E402
    DPI,
    describe_figure,
    fig_estimator_mse,
    fig_knn,
    fig_recall_qps,
    fig_samples,
    fig_var_over_e2,
)
from bench.report_neighbours import knn_correct, nrff_neighbours, samples_needed, samples_to_recall  # noqa: E402
from bench.report_speed import speed_recall, tuned_label  # noqa: E402
from gmmlsh.core import parallel  # noqa: E402

# ==================================================================================
# the report
# ==================================================================================


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           timeout=10)
        if c.returncode == 0:
            commit = c.stdout.strip()
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
            if d.stdout.strip():
                commit += " + uncommitted changes"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu, "cores": os.cpu_count(),
            "numba_threads": parallel.threads(), "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__, "commit": commit, "load_at_start": list(load)}


def _fmt_bytes(b: float | None) -> str:
    return "" if b is None else f"{b:,.0f}"


def markdown(r: dict) -> str:
    m, d = r["machine"], r["data"]
    st = r["settings"]
    L: list[str] = [f"# gmmlsh benchmark report — {d['name']}", ""]
    L += [f"Generated {m['date']} by `{r['command']}` in {r['seconds'] / 60:.1f} min on {m['cpu']} "
          f"({m['cores']} cores; builds on {st['threads']} numba threads, every query timing on one thread), "
          f"Python {m['python']}, numpy {m['numpy']}, numba {m['numba']}, gmmlsh commit {m['commit']}. "
          f"Load average at start: {m['load_at_start'][0]:.2f}. Timings on a small or shared machine are noisy: "
          "compare methods within this report, not across machines."
          + (" **Quick run: small sizes, a smoke test — not numbers to quote.**" if st["quick"] else ""), ""]
    L += [f"Data: {d['source']}. {d['n']:,} index vectors, {d['dim']:,} dimensions ({d['storage']}), "
          f"{d['queries']:,} timed queries"
          + (f", {d['knn_queries']:,} labelled queries for k-NN, {d['classes']} classes." if d["classes"]
             else ", no labels.")]
    L += [f"- {note}" for note in d["notes"]]
    # --- speed
    sp_ = r["speed"]
    L += ["", "## Speed against recall", "", "![recall@10 against queries/s](recall_qps.png)", ""]
    L += ["| index | build s | threads | bytes / vector (stored) | bytes / vector (memory) | note |",
          "|---|---:|---:|---:|---:|---|"]
    for b in sp_["builds"]:
        L.append(f"| {b['method']} | {b['seconds']:.1f} | {b['threads']} | {_fmt_bytes(b['bytes_per_vector'])} | "
                 f"{_fmt_bytes(b['memory_bytes_per_vector'])} | {b['note']} |")
    L += ["", "| method | setting | recall@10 | queries/s (1 thread) | vectors scored / query | queries timed |",
          "|---|---|---:|---:|---:|---:|"]
    for p in sp_["points"]:
        sc = "" if p["scored"] is None else f"{p['scored']:,.0f}"
        L.append(f"| {p['series']} | {p['setting']} | {p['recall']:.4f} | {p['qps']:,.0f} | {sc} | {p['queries']:,} |")
    search = sp_["search"]
    tuned = (f"the search its tuner chose at the end of the build (on {search['tuned_on']})"
             if search["tuned_at_rows"] else "the untuned defaults (too few rows to tune)")
    L += ["", f"Recall is against the exact GMM top-10. `auto` is the index's default query, {tuned}: "
          f"{tuned_label(search).removeprefix('tuned: ')}. `auto over C` is that search with the rerank budget C "
          f"(rows scored by exact GMM) set by the query. `nrff` ranks by "
          f"the RBF kernel (k={NRFF_K}, γ={NRFF_GAMMA:g}), so its recall of GMM neighbours is capped near the "
          f"overlap of exact RBF (= cosine) and GMM neighbours: {sp_['rbf_ceiling']:.3f}."]
    if sp_.get("peer_note"):
        L.append(f"{sp_['peer_note']}.")
    # --- GMM vs RBF
    L += ["", "## GMM against RBF as a neighbour kernel", ""]
    knn = r.get("knn")
    if knn:
        L += ["![k-NN accuracy](knn_accuracy.png)", "",
              "| neighbours from | " + " | ".join(f"k={k}" for k in KNN_KS if str(k) in knn["accuracy"]["GMM exact"])
              + " |", "|---|" + "---:|" * len([k for k in KNN_KS if str(k) in knn["accuracy"]["GMM exact"]])]
        for name, acc in knn["accuracy"].items():
            L.append(f"| {knn['labels'][name]} | " + " | ".join(f"{acc[str(k)]:.4f}" for k in KNN_KS if str(k) in acc)
                     + " |")
        for name, d_ in knn["paired"].items():
            L.append(f"| *{name} (paired, ± 1 SE)* | " + " | ".join(f"{d_[str(k)][0]:+.4f} ± {d_[str(k)][1]:.4f}"
                                                                    for k in KNN_KS if str(k) in d_) + " |")
        acc = knn["accuracy"]["GMM exact"].get(str(K_NN), 0.85)
        se = (acc * (1 - acc) / d["knn_queries"]) ** 0.5
        L += ["", f"k-NN by majority vote over {d['knn_queries']:,} labelled queries (ties: the class met first); "
              f"one standard error is about {se:.3f}, and the methods share their queries, so differences between "
              "rows are paired (smaller noise than two independent samples). "
              "RBF e^{−γ(1−ρ)} is increasing in the cosine ρ, so exact RBF neighbours are the cosine neighbours "
              "for every γ: the cosine row is exact RBF, tuned or not. `RBF via nrff` is the index's nrff mode "
              f"(top {200} by NRFF features, reranked by exact RBF), computed in bulk; on the "
              f"{knn['nrff_check_queries']} queries timed above it returned the same top-10 as "
              f"`Index.query(mode='nrff')` for {knn['nrff_check_agree']:.1%} of neighbours."]
    else:
        L += ["No labels in the data: no k-NN accuracy."]
    sr = r["samples"]
    C = sr["C"]
    L += ["", "![samples needed for a neighbour recall](samples_to_recall.png)", "",
          "| sketch | scored against | " + " | ".join(f"k={k}" for k in sr["ks"]) + " | k for 0.90 | k for 0.95 |",
          "|---|---|" + "---:|" * (len(sr["ks"]) + 2)]
    for name, mth in sr["methods"].items():
        vals = mth[f"recall_in_top{C}"]
        need = [samples_needed(sr["ks"], vals, t) for t in (0.9, 0.95)]
        L.append(f"| {name} | exact {mth['kernel']} top-10 | " + " | ".join(f"{v:.3f}" for v in vals) + " | "
                 + " | ".join("—" if x is None else f"{x:,.0f}" for x in need) + " |")
    L += ["", f"Recall@10 within the top {C} by the sketch estimate alone (what a rerank of C = {C} could reach), "
          "each sketch scored against its own kernel's exact neighbours. GCWS b=8 are the codes the index stores, "
          "b=2 their low bits, which its first stage reads (of 256 samples) and its ranking at rank_bits=2; "
          "NRFF features are float32 (4 bytes a sample, against b/8 for GCWS)."]
    if any(m["knn_accuracy"] for m in sr["methods"].values()):
        L += ["", f"| sketch-only {K_NN}-NN accuracy | " + " | ".join(f"k={k}" for k in sr["ks"]) + " |",
              "|---|" + "---:|" * len(sr["ks"])]
        for name, mth in sr["methods"].items():
            L.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in mth["knn_accuracy"]) + " |")
    # --- estimators
    est = r["estimators"]
    L += ["", "## The estimators on real pairs", "", "![MSE against k](estimator_mse.png)", "",
          f"{est['seeds']} seeds × {est['samples_per_seed']} samples for each of {len(est['pairs'])} real pairs "
          "(a query and an index vector) spread over the GMM range; the pool is cut into k-sample estimates. "
          "Ratio of empirical MSE to the theoretical variance at k = " + str(est["var_k"]) + " (1 = as predicted):",
          "", "| GMM | ρ | RBF(γ=1) | " + " | ".join(est["pairs"][0]["mse"]) + " |",
          "|---:|---:|---:|" + "---:|" * len(est["pairs"][0]["mse"])]
    for p in est["pairs"]:
        i = p["ks"].index(est["var_k"])
        L.append(f"| {p['gmm']:.3f} | {p['rho']:.3f} | {p['rbf']['1']:.3f} | "
                 + " | ".join(f"{p['mse'][nm][i] / p['theory'][nm][i]:.2f}" for nm in p["mse"]) + " |")
    L += ["", "![Var/E² against E](var_over_e2.png)", "",
          "GCWS's per-sample variance is binomial, E(1−E); NRFF's is V_n (Theorem 3), which as a function of E does "
          "not depend on γ (γ only moves a pair along the curve). Near E = 1 — where near neighbours are — V_n "
          "vanishes like 4(1−E)² against GCWS's (1−E), so there NRFF's relative variance is the lower one; at small "
          "and moderate E GCWS's is far lower, which is what the papers' classification results rest on."]
    L += ["", "## Regenerate", "", "```bash", r["command"], "```", "",
          "Section times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in r["timings"].items()) + "."]
    return "\n".join(L) + "\n"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x


@dataclass
class Report:
    """The run's numbers and its figures (kept open so a caller, e.g. a test, can inspect them)."""

    out: Path
    data: dict
    figures: dict[str, Figure]


def run(ds: Dataset, st: Settings, out: Path, command: str, log: Callable[[str], None] = print) -> Report:
    """Measure everything, draw the figures, write report.md / report.json / figures.json / PNGs into ``out``."""
    t_all = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    r: dict[str, Any] = {"command": command, "machine": _machine(), "settings": st.__dict__.copy()}
    classes = int(len(np.unique(ds.y))) if ds.y is not None else 0
    r["data"] = {"name": ds.name, "source": ds.source, "n": int(ds.X.shape[0]), "queries": int(ds.Q.shape[0]),
                 "dim": ds.dim, "storage": "sparse" if ds.sparse else "dense", "classes": classes, "notes": ds.notes}
    nq = min(st.queries, ds.Q.shape[0])
    dq = replace(ds, Q=ds.Q[:nq], qy=None if ds.qy is None else ds.qy[:nq])  # the timed queries
    r["data"]["queries"] = nq
    r["data"]["knn_queries"] = int(ds.Q.shape[0])
    log(f"{ds.name}: {ds.X.shape[0]:,} × {ds.dim:,} index, {nq:,} timed queries, {ds.Q.shape[0]:,} for k-NN")
    kk = min(max(KNN_KS), ds.X.shape[0])

    t = time.perf_counter()
    truth = ground_truth(ds, kk)
    timings["ground truth"] = time.perf_counter() - t
    log(f"ground truth: {timings['ground truth']:.1f}s")

    work = Path(tempfile.mkdtemp(prefix="gmmlsh-report-"))
    try:
        t = time.perf_counter()
        speed = speed_recall(dq, truth.head(nq), st, work, log, knn_queries=ds.Q)
        timings["speed/recall"] = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    auto_knn, nrff_index_top10 = speed.pop("auto_knn"), speed.pop("nrff_index_top10")
    r["speed"] = speed

    t = time.perf_counter()
    knn = None
    if ds.y is not None:
        nrff_ids = nrff_neighbours(ds, kk)
        m = len(nrff_index_top10)
        agree = np.mean([np.isin(a, b[:K_NN]).mean() for a, b in zip(nrff_index_top10, nrff_ids[:m], strict=True)])
        sets = {"GMM exact": truth.gmm, "GMM auto": auto_knn, "RBF via nrff": nrff_ids, "cosine": truth.cosine,
                "L2": truth.l2}
        labels = {"GMM exact": "GMM, exact", "GMM auto": "GMM, auto (the tuned default)",
                  "RBF via nrff": f"RBF via nrff (k={NRFF_K}, γ={NRFF_GAMMA:g})",
                  "cosine": "cosine, exact (= RBF exact, any γ)", "L2": "L2 (Euclidean), exact"}
        right = {name: knn_correct(ids, ds.y, ds.qy, KNN_KS) for name, ids in sets.items()}
        paired = {}
        for other in ("cosine", "L2"):
            d = {}
            for k, a in right["GMM exact"].items():
                diff = a.astype(float) - right[other][k].astype(float)
                d[str(k)] = [float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(diff.shape[0]))]
            paired[f"GMM exact − {other}"] = d
        knn = {"accuracy": {name: {str(k): float(v.mean()) for k, v in r_.items()} for name, r_ in right.items()},
               "paired": paired, "labels": labels, "nrff_check_queries": m, "nrff_check_agree": float(agree)}
        log("k-NN accuracy: " + ", ".join(f"{n_} {a[str(K_NN)]:.4f}" for n_, a in knn["accuracy"].items()
                                          if str(K_NN) in a))
    r["knn"] = knn
    timings["k-NN"] = time.perf_counter() - t

    t = time.perf_counter()
    log("samples to recall")
    r["samples"] = samples_to_recall(dq, truth.head(nq), st, log)
    timings["samples to recall"] = time.perf_counter() - t

    t = time.perf_counter()
    log("estimators")
    r["estimators"] = estimators(ds, truth, st, log)
    timings["estimators"] = time.perf_counter() - t
    timings["ground truth"] = truth.seconds
    r["timings"] = timings

    title = f"{ds.name}: {ds.X.shape[0]:,} vectors, {nq:,} queries, k=10 — up and right is better"
    figs: dict[str, Figure] = {
        "recall_qps.png": fig_recall_qps(speed, title),
        "estimator_mse.png": fig_estimator_mse(r["estimators"]),
        "var_over_e2.png": fig_var_over_e2(r["estimators"]),
        "samples_to_recall.png": fig_samples(r["samples"], knn),
    }
    if knn:
        figs["knn_accuracy.png"] = fig_knn(knn, f"{ds.name}: k-NN classification, {ds.Q.shape[0]:,} queries")
    for name, fig in figs.items():
        fig.savefig(out / name, dpi=DPI)
    r["seconds"] = time.perf_counter() - t_all
    r["figures"] = sorted(figs)
    (out / "figures.json").write_text(json.dumps({k: describe_figure(f) for k, f in figs.items()}, indent=1) + "\n")
    (out / "report.json").write_text(json.dumps(_jsonable(r), indent=1, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(markdown(_jsonable(r)))
    log(f"wrote {out}/report.md and {len(figs)} figures in {r['seconds']:.0f}s")
    return Report(out, r, figs)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="a file gmmlsh build reads (default: Fashion-MNIST)")
    ap.add_argument("--npz-key", help=".npz: the array of vectors")
    ap.add_argument("--npz-label-key", help=".npz: the array of labels")
    ap.add_argument("--label-column", help=".csv/.tsv: the label column (name or 0-based position)")
    ap.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: ./report)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about a minute")
    ap.add_argument("--n", type=int, help="index vectors (default: all; 3,000 with --quick)")
    ap.add_argument("--queries", type=int, help="timed queries (default 1,000; 100 with --quick)")
    ap.add_argument("--knn-queries", type=int, help="labelled queries for k-NN accuracy (default 5,000; "
                    "--queries with --quick); a user file holds out at most 10 %% of its rows")
    ap.add_argument("--no-peer", action="store_true", help="skip pynndescent")
    a = ap.parse_args(argv)
    for name in ("n", "queries", "knn_queries"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')}: must be ≥ 1")
    return a


def main(argv: Sequence[str] | None = None) -> Report:
    a = parse_args(argv)
    st = Settings.make(a.quick, a.n, a.queries, not a.no_peer, a.knn_queries)
    if a.data is not None:
        label_col: str | int | None = a.label_column
        if label_col is not None and label_col.isdigit():
            label_col = int(label_col)
        ds = load_file(a.data, n=st.n, queries=st.knn_queries, npz_key=a.npz_key, npz_label_key=a.npz_label_key,
                       label_column=label_col)
    else:
        ds = load_fmnist(st.n, st.knn_queries)
    args = list(sys.argv[1:] if argv is None else argv)
    command = "python -m bench.report" + "".join(f" {x}" for x in args)
    return run(ds, st, a.out, command, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    report = main()
    plt.close("all")
