"""Benchmark report with plots: speed vs recall, the papers' estimator plots, and GMM vs RBF as neighbours.

    python -m bench.report [--out DIR] [--quick] [--n N] [--queries Q] [--no-peer]
    python -m bench.report --data FILE [--npz-key K --npz-label-key L | --label-column C] [--out DIR]
    gmmlsh bench report --data FILE --out DIR

Users pick a similarity and an index by looking, so this writes one folder:
``report.md`` (the numbers, with the figures inline), ``report.json`` (every
number), ``figures.json`` (what each figure shows: axis labels, series, point
counts — so a test can check the pictures are not empty) and the figures:

* ``recall_qps.png`` — recall@10 against queries/s (one thread), ann-benchmarks
  style: ``lsh`` at the search the index tuned for itself, as tuned and over the
  rerank budget C, ``exact``, ``nrff``, pynndescent with the GMM metric; build
  time and bytes per vector in a table beside it. Measured in one run.
* ``estimator_mse.png`` — empirical MSE of GCWS (0-bit, and b-bit corrected) and
  of NRFF against k, on real pairs, over the theory (GMM(1−GMM)/k, V_n/k).
* ``var_over_e2.png`` — Var/E² against E (the papers' Figure 3) with empirical points.
* ``knn_accuracy.png`` — k-NN classification accuracy on labelled data: GMM exact,
  GMM through ``lsh``, RBF through ``nrff``, cosine (= exact RBF for every γ), L2.
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from numba import njit  # noqa: E402

from bench.common import DATA  # noqa: E402
from gmmlsh.core import codes, gcws, nrff, parallel  # noqa: E402
from gmmlsh.core.codes import WORD, bit_planes  # noqa: E402
from gmmlsh.core.gmm import gmm, gmm_many, gmm_matrix, l1_norms  # noqa: E402
from gmmlsh.core.intrinsics import popcount  # noqa: E402
from gmmlsh.core.parallel import spread  # noqa: E402
from gmmlsh.index.config import IndexConfig  # noqa: E402
from gmmlsh.index.index import Index  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K_NN = 10  # recall@10, and the k of the sketch-only k-NN vote
KNN_KS = (1, 3, 5, 10, 20)
NRFF_K, NRFF_GAMMA = 256, 1.0  # the nrff index of the speed plot
SEED = 0
DPI = 100

#: One colour per method, the same in every figure.
COLORS = {
    "lsh": "tab:blue", "lsh default": "navy", "exact": "black", "nrff": "tab:orange",
    "pynndescent": "tab:brown", "GMM exact": "black", "GMM lsh": "tab:blue", "RBF via nrff": "tab:orange",
    "cosine": "tab:gray", "L2": "tab:purple", "GCWS 0-bit": "tab:blue", "GCWS b=2": "tab:green",
    "GCWS b=4": "tab:olive", "GCWS b=8": "tab:cyan", "NRFF": "tab:red",
}


# ==================================================================================
# settings and data
# ==================================================================================


@dataclass
class Settings:
    """Problem sizes. ``quick`` ones make a smoke run (under a minute), not numbers to quote."""

    n: int | None
    queries: int  # timed queries (speed/recall, samples to recall)
    knn_queries: int  # labelled queries for the k-NN accuracies (the first ``queries`` of them are the timed ones)
    quick: bool
    peer: bool
    seeds: int  # repetitions of the estimator study
    est_kmax: int  # samples drawn per repetition (the pool is cut into k-sample estimates)
    est_ks: tuple[int, ...]
    var_k: int  # k at which Var/E² is measured
    var_gammas: tuple[float, ...]
    recall_ks: tuple[int, ...]
    recall_gammas: tuple[float, ...]
    lsh_cs: tuple[int, ...]
    nrff_cs: tuple[int, ...]
    nrff_queries: int
    exact_queries: int
    peer_eps: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)
    threads: int = field(default_factory=parallel.threads)

    @classmethod
    def make(cls, quick: bool, n: int | None, queries: int | None, peer: bool, knn_queries: int | None = None
             ) -> Settings:
        if quick:
            q = queries or 100
            return cls(n=n or 3000, queries=q, knn_queries=max(q, knn_queries or q), quick=True, peer=peer,
                       seeds=24, est_kmax=256,
                       est_ks=(8, 16, 32, 64, 128, 256), var_k=64, var_gammas=(0.5, 2.0), recall_ks=(32, 64, 128, 256),
                       recall_gammas=(NRFF_GAMMA,), lsh_cs=(25, 100, 400), nrff_cs=(50, 200),
                       nrff_queries=30, exact_queries=10)
        q = queries or 1000
        return cls(n=n, queries=q, knn_queries=max(q, knn_queries or 5000), quick=False, peer=peer, seeds=256,
                   est_kmax=1024,
                   est_ks=(8, 16, 32, 64, 128, 256, 512, 1024), var_k=128, var_gammas=(0.5, 2.0, 8.0),
                   recall_ks=(32, 64, 128, 256, 512, 1024), recall_gammas=(NRFF_GAMMA, 4.0),
                   lsh_cs=(25, 50, 100, 200, 400), nrff_cs=(50, 200, 800),
                   nrff_queries=100, exact_queries=30)


@dataclass
class Dataset:
    """Index rows ``X`` and query rows ``Q`` (float32, dense or CSR), with class labels if known."""

    name: str
    X: np.ndarray | sp.csr_matrix
    Q: np.ndarray | sp.csr_matrix
    y: np.ndarray | None
    qy: np.ndarray | None
    source: str
    notes: list[str] = field(default_factory=list)

    @property
    def sparse(self) -> bool:
        return sp.issparse(self.X)

    @property
    def dim(self) -> int:
        return int(self.X.shape[1])

    def f64(self, A):
        """A float64 copy for the sketches (GCWS/NRFF hash what the index stores: float32 rounded)."""
        return sp.csr_matrix(A, dtype=np.float64) if sp.issparse(A) else np.asarray(A, dtype=np.float64)


def load_fmnist(n: int | None, queries: int) -> Dataset:
    path = DATA / "fashion-mnist.npz"
    if not path.exists():
        raise SystemExit(f"Fashion-MNIST not found at {path}; set GMMLSH_DATA or pass --data FILE")
    d = np.load(path)
    n = min(n or d["train"].shape[0], d["train"].shape[0])
    nq = min(queries, d["test"].shape[0])
    return Dataset(
        name="Fashion-MNIST", X=d["train"][:n].astype(np.float32), Q=d["test"][:nq].astype(np.float32),
        y=d["train_labels"][:n].astype(np.int64), qy=d["test_labels"][:nq].astype(np.int64),
        source=f"{path.name}: the first {n:,} train rows are the index, the first {nq:,} test rows the queries",
    )


def _label_codes(labels: list) -> np.ndarray | None:
    """Labels (any JSON value) → small ints; None when any row has none."""
    if not labels or any(v is None for v in labels):
        return None
    keys = [json.dumps(v, sort_keys=True) for v in labels]
    _, codes = np.unique(np.array(keys), return_inverse=True)
    return codes.astype(np.int64)


def load_file(path: Path, *, n: int | None, queries: int, npz_key: str | None = None,
              npz_label_key: str | None = None, label_column: str | None = None, seed: int = SEED) -> Dataset:
    """Read a user's file with the build's readers; hold out random rows as queries."""
    from gmmlsh.index.ingest.readers import open_reader

    reader = open_reader(path, key=npz_key, label_key=npz_label_key, label_column=label_column)
    parts, labels = [], []
    for chunk in reader:
        parts.append(chunk.X)
        meta = chunk.metadata or [None] * len(chunk)
        labels += [m.get("label") if isinstance(m, dict) else None for m in meta]
    reader.close()
    if not parts:
        raise SystemExit(f"{path}: no rows")
    if any(sp.issparse(p) for p in parts):
        A = sp.vstack([sp.csr_matrix(p) for p in parts]).tocsr().astype(np.float32)
        A.sort_indices()
        norms = np.asarray(abs(A).sum(axis=1)).ravel()
        finite = np.isfinite(A.data)
        bad = np.zeros(A.shape[0], dtype=bool)
        if not finite.all():
            bad[np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))[~finite]] = True
    else:
        A = np.vstack([np.asarray(p, dtype=np.float32).reshape(len(p), -1) for p in parts])
        norms = np.abs(A).sum(axis=1)
        bad = ~np.isfinite(A).all(axis=1)
    keep = ~bad & (norms > 0)
    notes = []
    if not keep.all():
        notes.append(f"{int((~keep).sum()):,} rows left out (all zero, or not finite: GMM has no sample for them)")
    rows = np.flatnonzero(keep)
    y_all = _label_codes([labels[i] for i in rows])
    total = rows.shape[0]
    if total < 20:
        raise SystemExit(f"{path}: {total} usable rows; the report needs at least 20")
    nq = max(1, min(queries, total // 10))
    perm = np.random.default_rng(seed).permutation(total)
    qpos, xpos = np.sort(perm[:nq]), np.sort(perm[nq:])
    if n is not None:
        xpos = xpos[:n]
    return Dataset(
        name=Path(path).name, X=A[rows[xpos]], Q=A[rows[qpos]],
        y=None if y_all is None else y_all[xpos], qy=None if y_all is None else y_all[qpos],
        source=f"{Path(path).name}: {nq:,} random rows (seed {seed}) are the queries, "
               f"{xpos.shape[0]:,} others the index",
        notes=notes,
    )


# ==================================================================================
# small helpers
# ==================================================================================


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Queries are timed on one thread: numba kernels and BLAS alike."""
    before = parallel.threads()
    parallel.set_threads(1)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn (pynndescent)
        limits = contextlib.nullcontext()
    else:
        limits = threadpool_limits(1)
    try:
        with limits:
            yield
    finally:
        parallel.set_threads(before)


def _top_rows(S: np.ndarray, k: int, largest: bool = True) -> np.ndarray:
    """Per row, the column numbers of the k best scores, best first."""
    k = min(k, S.shape[1])
    A = -S if largest else S
    part = np.argpartition(A, k - 1, axis=1)[:, :k]
    order = np.argsort(np.take_along_axis(A, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def recall(found: np.ndarray | list, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` found in the matching row of ``found`` (any length)."""
    hits = [np.isin(t, np.asarray(f)).sum() / t.shape[0] for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits)) if hits else float("nan")


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def _row(A, i: int):
    """Row ``i`` as a query for the index: 1-D dense or a 1-row CSR."""
    return A[i] if not sp.issparse(A) else A[i : i + 1]


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


# ==================================================================================
# ground truth: exact GMM, cosine (= RBF for any γ) and L2 neighbours
# ==================================================================================


@dataclass
class Truth:
    gmm: np.ndarray  # (nq, kk) ids, best first
    gmm_sims: np.ndarray
    cosine: np.ndarray
    l2: np.ndarray
    pairs: list[tuple[int, int, float]]  # (query row, index row, GMM) near each target similarity
    seconds: float

    def head(self, nq: int) -> Truth:
        """The truth of the first ``nq`` queries (pairs may use any query row of the full set)."""
        return replace(self, gmm=self.gmm[:nq], gmm_sims=self.gmm_sims[:nq], cosine=self.cosine[:nq],
                       l2=self.l2[:nq])


PAIR_TARGETS = (0.03, 0.08, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.93)


def ground_truth(ds: Dataset, kk: int) -> Truth:
    """Brute-force exact neighbours (all threads), and real pairs spread over the GMM range."""
    t0 = time.perf_counter()
    X, Q = ds.X, ds.Q
    nq = Q.shape[0]
    kk = min(kk, X.shape[0])
    norms = l1_norms(X)
    best = {t: (np.inf, -1, -1, 0.0) for t in PAIR_TARGETS}
    ids, sims = [], []
    step = 100
    for lo in range(0, nq, step):
        hi = min(nq, lo + step)
        if ds.sparse:
            S = np.vstack([gmm_many(_row(Q, i), X, norms) for i in range(lo, hi)])
        else:
            S = gmm_matrix(Q[lo:hi], X, None, norms)
        top = _top_rows(S, kk)
        ids.append(top)
        sims.append(np.take_along_axis(S, top, axis=1))
        for t in PAIR_TARGETS:
            flat = int(np.argmin(np.abs(S - t)))
            a, r = divmod(flat, S.shape[1])
            gap = abs(S[a, r] - t)
            if gap < best[t][0]:
                best[t] = (gap, lo + a, r, float(S[a, r]))
    pairs = sorted({(q, r, g) for _, q, r, g in best.values() if q >= 0}, key=lambda p: p[2])

    def unit(A):
        if sp.issparse(A):
            nrm = np.sqrt(np.asarray(A.multiply(A).sum(axis=1)).ravel())
            return sp.csr_matrix(sp.diags(1.0 / nrm) @ A), nrm
        nrm = np.linalg.norm(A, axis=1)
        return A / nrm[:, None], nrm

    Xu, xn = unit(sp.csr_matrix(X, dtype=np.float64) if ds.sparse else X.astype(np.float32))
    Qu, _ = unit(sp.csr_matrix(Q, dtype=np.float64) if ds.sparse else Q.astype(np.float32))
    cos_ids, l2_ids = [], []
    for lo in range(0, nq, 200):
        C = Qu[lo : lo + 200] @ Xu.T
        C = C.toarray() if sp.issparse(C) else C
        cos_ids.append(_top_rows(C, kk))
        # ‖q − x‖² = ‖q‖² + ‖x‖² − 2‖q‖‖x‖cos; ‖q‖² is constant per row, so rank by ‖x‖² − 2‖q‖‖x‖cos
        qn = np.sqrt(np.asarray(Q[lo : lo + 200].multiply(Q[lo : lo + 200]).sum(axis=1)).ravel()) if ds.sparse \
            else np.linalg.norm(Q[lo : lo + 200].astype(np.float64), axis=1)
        D = xn[None, :] ** 2 - 2.0 * qn[:, None] * xn[None, :] * C
        l2_ids.append(_top_rows(D, kk, largest=False))
    return Truth(np.vstack(ids), np.vstack(sims), np.vstack(cos_ids), np.vstack(l2_ids), pairs,
                 time.perf_counter() - t0)


# ==================================================================================
# 1. speed vs recall
# ==================================================================================


def build_index(path: Path, X, cfg: IndexConfig, chunk: int = 10_000) -> tuple[float, dict]:
    """Upsert in chunks, then ``maintain()`` (inverted lists, tuning) as a bulk load does, all threads.

    Returns the seconds and what ``maintain()`` did (the tuner's report under ``tuned``).
    """
    t = time.perf_counter()
    with Index.open(path, cfg, maintain=False) as ix:
        for lo in range(0, X.shape[0], chunk):
            hi = min(X.shape[0], lo + chunk)
            ix.upsert([str(i) for i in range(lo, hi)], X[lo:hi])
        done = ix.maintain()
    return time.perf_counter() - t, done


def _ids(res) -> np.ndarray:
    return np.array([int(nb.id) for nb in res.neighbors], dtype=np.int64)


def _tuned_label(search: dict) -> str:
    if search["exact"]:
        return "tuned: exact"
    probes = search["probes"] or "all"
    return (f"tuned: probes={probes}, shortlist={search['shortlist']}, rank_bits={search['rank_bits']}, "
            f"C={search['candidates']}")


def speed_recall(ds: Dataset, truth: Truth, st: Settings, work: Path, log: Callable[[str], None],
                 knn_queries=None) -> dict:
    """Every method through its real query path, one thread, same queries, same ground truth.

    Also answers ``knn_queries`` (all labelled queries) through the default ``lsh`` path, for the k-NN table.
    The indexes are opened with ``maintain=False``: the search tuned at the end of the build stays fixed
    while it is timed (a served index re-tunes on its own queries).
    """
    Q, X = ds.Q, ds.X
    nq, n = Q.shape[0], X.shape[0]
    t10 = truth.gmm[:, :K_NN]
    cfg = IndexConfig(dim=ds.dim)
    ncfg = IndexConfig(dim=ds.dim, nrff_k=NRFF_K, gamma=NRFF_GAMMA)
    # One-time costs (numba cache load, the GCWS constant table, NRFF's W) outside the timed builds.
    with Index.open(work / "warm", ncfg) as w:
        w.upsert(["w"], X[:1])
    points: list[dict] = []
    builds: list[dict] = []

    def run(index: Index, series: str, setting: str, queries: int, mode: str = "lsh", **kw) -> None:
        qs = min(queries, nq)
        res, secs = _timed(lambda: [index.query(_row(Q, i), k=K_NN, mode=mode, **kw) for i in range(qs)])
        p = {"series": series, "setting": setting, "recall": recall([_ids(r) for r in res], t10[:qs]),
             "qps": qs / secs, "scored": float(np.mean([r.candidates for r in res])), "queries": qs, **kw}
        points.append(p)
        log(f"  {series} {setting}: recall@10 {p['recall']:.4f}, {p['qps']:,.0f} q/s")

    def build(name: str, c: IndexConfig, method: str, note: str) -> Index:
        log(f"  build {name} index")
        secs, done = build_index(work / name, X, c)
        ix = Index.open(work / name, maintain=False)
        mirror = ix.stats()["mirror"]["disk_bytes"]
        builds.append({"method": method, "seconds": secs, "threads": st.threads,
                       "bytes_per_vector": disk_bytes(work / name) / n, "memory_bytes_per_vector": mirror / n,
                       "note": note, "tuning": done.get("tuned")})
        return ix

    ix = build("lsh", cfg, f"gmmlsh index (samples={cfg.samples}, b={cfg.bits})",
               "LMDB store + search mirror on disk; in memory, the memory-mapped mirror queries read (bit planes, "
               "first-stage rows, lists, vectors)")
    search = {k: v for k, v in ix.stats()["search"].items() if k != "overrides"}
    raw = (X.data.nbytes + X.indices.nbytes) / n if ds.sparse else X.shape[1] * 4
    builds.append({"method": "exact (brute force over stored vectors)", "seconds": 0.0, "threads": st.threads,
                   "bytes_per_vector": raw, "memory_bytes_per_vector": raw, "note": "the float32 vectors alone"})
    with single_thread():
        for i in range(min(20, nq)):
            ix.query(_row(Q, i), k=K_NN)
            ix.query(_row(Q, i), k=K_NN, candidates=min(st.lsh_cs))
        run(ix, "lsh default", _tuned_label(search), nq)
        for C in st.lsh_cs:
            run(ix, "lsh", f"C={C}", nq, candidates=C)
        run(ix, "exact", "via index", st.exact_queries, mode="exact")
        norms = l1_norms(X)
        qs = min(nq, 100)
        gmm_many(_row(Q, 0), X, norms)
        found, secs = _timed(lambda: [_top_rows(gmm_many(_row(Q, i), X, norms)[None, :], K_NN)[0] for i in range(qs)])
        points.append({"series": "exact", "setting": "in-memory numba scan", "recall": recall(found, t10[:qs]),
                       "qps": qs / secs, "scored": float(n), "queries": qs})
        log(f"  exact in memory: {qs / secs:,.0f} q/s")
    KQ = Q if knn_queries is None else knn_queries
    lsh_knn = [_ids(r) for r in ix.query_batch(KQ, k=min(max(KNN_KS), n))]
    ix.close()

    nix = build("nrff", ncfg, f"gmmlsh index with NRFF (k={NRFF_K}, γ={NRFF_GAMMA:g})",
                "the lsh index plus float32 NRFF features")
    with single_thread():
        for i in range(min(5, nq)):
            nix.query(_row(Q, i), k=K_NN, mode="nrff")
        for C in st.nrff_cs:
            run(nix, "nrff", f"C={C}", st.nrff_queries, mode="nrff", candidates=C)
        nrff_top10 = [_ids(nix.query(_row(Q, i), k=K_NN, mode="nrff", candidates=200))
                      for i in range(min(st.nrff_queries, nq))]
    nix.close()

    peer = peer_points(ds, t10, st, log) if st.peer else None
    if peer:
        points += peer["points"]
        builds.append(peer["build"])
    elif st.peer:
        log("  pynndescent: skipped")
    peer_note = None if peer else "pynndescent not run " + (
        "(not installed, or the data too big to densify)" if st.peer else "(--no-peer)")
    cos_recall = recall(truth.cosine[:, :K_NN], t10)
    return {"points": points, "builds": builds, "search": search, "rbf_ceiling": cos_recall,
            "lsh_knn": np.array(lsh_knn), "nrff_index_top10": nrff_top10,
            "peer_note": peer_note}


def peer_points(ds: Dataset, t10: np.ndarray, st: Settings, log: Callable[[str], None]) -> dict | None:
    """pynndescent with a numba GMM metric (1 − GMM), built on all threads, queried on one."""
    try:
        from pynndescent import NNDescent

        from bench.common import gmm_distance
    except ImportError:
        return None
    X, Q = ds.X, ds.Q
    if ds.sparse:  # pynndescent takes custom metrics on dense data only
        if X.shape[0] * X.shape[1] * 4 > (1 << 30):
            return None
        X, Q = X.toarray(), Q.toarray()
    n = X.shape[0]
    nn = min(30, n - 1)
    log("  pynndescent: compile")
    small = X[: min(2000, n)]
    NNDescent(small, metric=gmm_distance, n_neighbors=min(nn, small.shape[0] - 1), random_state=0).query(Q[:5], k=5)
    log("  pynndescent: build")
    t = time.perf_counter()
    nnd = NNDescent(X, metric=gmm_distance, n_neighbors=nn, random_state=0, n_jobs=st.threads)
    nnd.prepare()
    secs = time.perf_counter() - t
    graph = getattr(nnd, "_search_graph", None)
    gbytes = 0 if graph is None else int(graph.data.nbytes + graph.indices.nbytes + graph.indptr.nbytes)
    build = {"method": f"pynndescent (GMM metric, n_neighbors={nn})", "seconds": secs, "threads": st.threads,
             "bytes_per_vector": (X.nbytes + gbytes) / n, "memory_bytes_per_vector": (X.nbytes + gbytes) / n,
             "note": "in memory: float32 vectors + search graph (not persisted)"}
    points = []
    with single_thread():
        nnd.query(Q[: min(10, Q.shape[0])], k=K_NN)
        for eps in st.peer_eps:
            (idx, _), secs = _timed(lambda e=eps: nnd.query(Q, k=K_NN, epsilon=e))
            p = {"series": "pynndescent", "setting": f"epsilon={eps:g}", "recall": recall(idx, t10),
                 "qps": Q.shape[0] / secs, "scored": None, "queries": int(Q.shape[0])}
            points.append(p)
            log(f"  pynndescent eps={eps:g}: recall@10 {p['recall']:.4f}, {p['qps']:,.0f} q/s")
    return {"points": points, "build": build}


# ==================================================================================
# 2. the estimators: MSE against k, and Var/E² against E
# ==================================================================================


def _pool_mse(pool: np.ndarray, truth: float, k: int, correct_bits: int | None = None) -> float:
    """MSE of k-sample estimates cut from a pool of iid per-sample agreements (seeds × samples)."""
    rates = pool.reshape(pool.shape[0], -1, k).mean(axis=2)
    est = rates if correct_bits is None else codes.corrected_rate(rates, correct_bits)
    return float(np.mean((est - truth) ** 2))


def _nrff_pool_mse(fu: np.ndarray, fv: np.ndarray, truth: float, k: int) -> float:
    """MSE of k-feature NRFF estimates: each block of k features normalised on its own (as NRFF does)."""
    a = fu.reshape(fu.shape[0], -1, k)
    b = fv.reshape(fv.shape[0], -1, k)
    est = (a * b).sum(axis=2) / np.sqrt((a * a).sum(axis=2) * (b * b).sum(axis=2))
    return float(np.mean((est - truth) ** 2))


def estimators(ds: Dataset, truth: Truth, st: Settings, log: Callable[[str], None]) -> dict:
    """Many seeds on real pairs: empirical MSE of each estimator next to its theoretical variance."""
    pairs = truth.pairs
    P = len(pairs)
    rows_q = [q for q, _, _ in pairs]
    rows_x = [r for _, r, _ in pairs]
    if ds.sparse:
        V = sp.vstack([sp.vstack([ds.Q[q], ds.X[r]]) for q, r in zip(rows_q, rows_x, strict=True)]).tocsr()
    else:
        V = np.vstack([np.vstack([ds.Q[q], ds.X[r]]) for q, r in zip(rows_q, rows_x, strict=True)])
    V64 = ds.f64(V)
    # exact GMM and correlation of each pair, in float64 from the stored float32 values
    dense = V64.toarray() if sp.issparse(V64) else V64
    u, v = dense[0::2], dense[1::2]
    G = np.array([gmm(a, b) for a, b in zip(u, v, strict=True)])
    rho = (u * v).sum(1) / (np.linalg.norm(u, axis=1) * np.linalg.norm(v, axis=1))
    K, R = st.est_kmax, st.seeds
    bits = (2, 4, 8)
    eq0 = np.empty((P, R, K), dtype=bool)
    eqb = {b: np.empty((P, R, K), dtype=bool) for b in bits}
    gammas = sorted({NRFF_GAMMA, *st.var_gammas})
    feats = {g: np.empty((2 * P, R, K), dtype=np.float32) for g in gammas}
    t = time.perf_counter()
    for s in range(R):
        seed = 1000 + s
        ist = gcws.sketch(V64, K, seed, path="direct")
        eq0[:, s] = ist[0::2] == ist[1::2]
        for b in bits:
            c = codes.bbit_codes(ist, b, seed)
            eqb[b][:, s] = c[0::2] == c[1::2]
        for g in gammas:
            F = nrff.features(V64, K, g, seed)
            # un-normalise nothing: block estimates renormalise, which is scale-free
            feats[g][:, s] = F
    log(f"  {R} seeds × {K} samples × {P} pairs in {time.perf_counter() - t:.1f}s")
    ks = [k for k in st.est_ks if K % k == 0]
    out_pairs = []
    for p in range(P):
        rbf = {g: float(np.exp(-g * (1.0 - rho[p]))) for g in gammas}
        rec: dict[str, Any] = {"query_row": rows_q[p], "index_row": rows_x[p], "gmm": float(G[p]),
                               "rho": float(rho[p]), "rbf": {f"{g:g}": rbf[g] for g in gammas}, "ks": ks}
        rec["mse"] = {"GCWS 0-bit": [_pool_mse(eq0[p], G[p], k) for k in ks]}
        rec["theory"] = {"GCWS 0-bit": [G[p] * (1 - G[p]) / k for k in ks]}
        for b in bits:
            pb = float(codes.bbit_collision_probability(G[p], b))
            rec["mse"][f"GCWS b={b}"] = [_pool_mse(eqb[b][p], G[p], k, b) for k in ks]
            rec["theory"][f"GCWS b={b}"] = [pb * (1 - pb) / ((1 - 2.0**-b) ** 2 * k) for k in ks]
        for g in gammas:
            fu, fv = feats[g][2 * p], feats[g][2 * p + 1]
            rec["mse"][f"NRFF γ={g:g}"] = [_nrff_pool_mse(fu, fv, rbf[g], k) for k in ks]
            rec["theory"][f"NRFF γ={g:g}"] = [float(nrff.nrff_variance(rho[p], g)) / k for k in ks]
        out_pairs.append(rec)
    # Var/E² at one k: k·MSE/E² (the papers' per-sample Var/E²)
    kv = st.var_k if st.var_k in ks else ks[len(ks) // 2]
    ki = ks.index(kv)
    var_pts = {"GCWS 0-bit": [(r["gmm"], kv * r["mse"]["GCWS 0-bit"][ki] / r["gmm"] ** 2) for r in out_pairs]}
    for g in st.var_gammas:
        var_pts[f"NRFF γ={g:g}"] = [(r["rbf"][f"{g:g}"], kv * r["mse"][f"NRFF γ={g:g}"][ki] / r["rbf"][f"{g:g}"] ** 2)
                                    for r in out_pairs]
    return {"pairs": out_pairs, "seeds": R, "samples_per_seed": K, "bits": list(bits), "nrff_gamma": NRFF_GAMMA,
            "var_k": kv, "var_points": var_pts, "var_gammas": list(st.var_gammas)}


# ==================================================================================
# 3. GMM vs RBF as neighbours: k-NN accuracy, and samples needed for a recall
# ==================================================================================


def knn_accuracy(ids: np.ndarray, y: np.ndarray, qy: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Share of queries whose k-NN vote is right, per k."""
    return {k: float(v.mean()) for k, v in knn_correct(ids, y, qy, ks).items()}


def knn_correct(ids: np.ndarray, y: np.ndarray, qy: np.ndarray, ks: Sequence[int]) -> dict[int, np.ndarray]:
    """Per query and k: is the majority vote of the first k neighbours right? Ties: the class met first."""
    out = {}
    nclass = int(max(y.max(), qy.max())) + 1
    for k in ks:
        if k > ids.shape[1]:
            continue
        lab = y[ids[:, :k]]
        correct = np.zeros(lab.shape[0], dtype=bool)
        for a in range(lab.shape[0]):
            counts = np.bincount(lab[a], minlength=nclass)
            winners = np.flatnonzero(counts == counts.max())
            pick = winners[0] if winners.shape[0] == 1 else lab[a][np.isin(lab[a], winners)][0]
            correct[a] = pick == qy[a]
        out[k] = correct
    return out


def nrff_neighbours(ds: Dataset, kk: int, C: int = 200) -> np.ndarray:
    """Index mode ``nrff`` done in bulk: top-C by stored-feature dot product, then exact RBF, best first.

    Same features (float32 as stored), same budget and rerank as ``Index.query(mode="nrff")``; the
    report checks the two agree on the timed queries.
    """
    F = nrff.features(ds.f64(ds.X), NRFF_K, NRFF_GAMMA, SEED).astype(np.float32)
    Fq = nrff.features(ds.f64(ds.Q), NRFF_K, NRFF_GAMMA, SEED).astype(np.float32)
    X64 = ds.f64(ds.X)
    xn = np.sqrt(np.asarray(X64.multiply(X64).sum(axis=1)).ravel()) if ds.sparse else np.linalg.norm(X64, axis=1)
    out = []
    for lo in range(0, Fq.shape[0], 200):
        cand = _top_rows(Fq[lo : lo + 200] @ F.T, min(C, F.shape[0]))
        for a in range(cand.shape[0]):
            q = ds.f64(ds.Q[lo + a]) if ds.sparse else ds.Q[lo + a].astype(np.float64)
            c = cand[a]
            if ds.sparse:
                dots = np.asarray((X64[c] @ q.T).todense()).ravel()
                qn = np.sqrt(q.multiply(q).sum())
            else:
                dots = X64[c] @ q
                qn = np.linalg.norm(q)
            rbf = np.exp(-NRFF_GAMMA * (1.0 - np.clip(dots / (xn[c] * qn), -1, 1)))
            out.append(c[_top_rows(rbf[None, :], kk)[0]])
    return np.array(out)


@njit(nogil=True, cache=True)
def _prefix_agreement(Qp, Xp, bits, ks, out):
    """out[a, s, r] = samples among the first ks[s] on which the low ``bits`` bits of query a and row r
    agree (rows of bit planes as :func:`gmmlsh.core.codes.bit_planes` lays them out; ``ks`` ascending)."""
    words = Xp.shape[1] // bits
    for r in range(Xp.shape[0]):
        x = Xp[r]
        for a in range(Qp.shape[0]):
            q = Qp[a]
            c = np.uint64(0)
            s = 0
            for w in range((ks[-1] + WORD - 1) // WORD):
                d = q[w] ^ x[w]
                for p in range(1, bits):
                    d |= q[p * words + w] ^ x[p * words + w]
                same = ~d
                while s < ks.shape[0] and ks[s] <= WORD * (w + 1):
                    m = ks[s] - WORD * w  # samples of this word in the prefix
                    keep = same if m == WORD else same & ((np.uint64(1) << np.uint64(m)) - np.uint64(1))
                    out[a, s, r] = np.uint16(c + popcount(keep))
                    s += 1
                c += popcount(same)


def _score_rank(S: np.ndarray, C: int, truth10: np.ndarray) -> tuple[list[float], list[float], list[list[int]]]:
    """Per query: recall@10 within the sketch's top C, recall of its own top 10, its top-10 k-NN vote."""
    top = _top_rows(S, C)
    in_c = (top[:, :, None] == truth10[:, None, :]).any(axis=1).sum(axis=1) / truth10.shape[1]
    t10 = top[:, :K_NN]
    own = (t10[:, :, None] == truth10[:, None, :]).any(axis=1).sum(axis=1) / truth10.shape[1]
    return in_c.tolist(), own.tolist(), t10.tolist()


def samples_to_recall(ds: Dataset, truth: Truth, st: Settings, log: Callable[[str], None]) -> dict:
    """Each sketch ranks the whole index by its estimate (no rerank) and is scored against its own kernel.

    GCWS agreement (8-bit codes as the index stores them, and their low 2 bits) against the
    exact GMM neighbours; NRFF dot products against the exact RBF neighbours (= cosine ones).
    """
    n, nq = ds.X.shape[0], ds.Q.shape[0]
    ks = list(st.recall_ks)
    K = max(ks)
    C = min(100, max(K_NN, n // 20))
    rng = np.random.default_rng(SEED)
    res: dict[str, dict] = {}
    y, qy = ds.y, ds.qy

    def collect(name: str, kernel: str, truth10: np.ndarray, score_blocks: Iterator[tuple[int, int, list]]) -> None:
        in_c = [[] for _ in ks]
        own = [[] for _ in ks]
        tops = [[] for _ in ks]
        for _lo, _hi, mats in score_blocks:
            for i, S in enumerate(mats):
                a, b, c = _score_rank(S, C, truth10[_lo:_hi])
                in_c[i] += a
                own[i] += b
                tops[i] += c
        acc = []
        if y is not None:
            acc = [knn_accuracy(np.array(t), y, qy, [K_NN])[K_NN] for t in tops]
        res[name] = {"kernel": kernel, "ks": ks, f"recall_in_top{C}": [float(np.mean(v)) for v in in_c],
                     "recall_top10": [float(np.mean(v)) for v in own], "knn_accuracy": acc,
                     "bytes_per_sample": 4.0 if name.startswith("NRFF") else int(name.split("b=")[1]) / 8}
        log(f"  {name}: recall@10 in top-{C} " + " ".join(f"{k}:{v:.3f}" for k, v in
                                                          zip(ks, res[name][f"recall_in_top{C}"], strict=True)))

    t = time.perf_counter()
    ix_ = gcws.sketch(ds.f64(ds.X), K, SEED)
    iq_ = gcws.sketch(ds.f64(ds.Q), K, SEED)
    log(f"  GCWS sketches (k={K}) of {n:,} + {nq:,} rows: {time.perf_counter() - t:.1f}s")
    ks_arr = np.array(ks, dtype=np.int64)
    gmm10 = truth.gmm[:, :K_NN]
    for b in (8, 2):
        Xp = bit_planes(codes.bbit_codes(ix_, b, SEED), b)
        Qp = bit_planes(codes.bbit_codes(iq_, b, SEED), b)

        def gblocks(Xp=Xp, Qp=Qp, b=b) -> Iterator[tuple[int, int, list]]:
            step = 50
            buf = np.empty((step, len(ks), n), dtype=np.uint16)
            for lo in range(0, nq, step):
                hi = min(nq, lo + step)
                spread(lambda a, z, lo=lo, hi=hi, Xp=Xp, Qp=Qp, b=b: _prefix_agreement(
                    Qp[lo:hi], Xp[a:z], b, ks_arr, buf[: hi - lo, :, a:z]), n, (hi - lo) * n * 64)
                jitter = rng.random((hi - lo, n), dtype=np.float32)  # random tie-break of integer counts
                yield lo, hi, [buf[: hi - lo, i].astype(np.float32) + jitter for i in range(len(ks))]

        collect(f"GCWS b={b}", "GMM", gmm10, gblocks())
    del ix_, iq_
    cos10 = truth.cosine[:, :K_NN]
    for g in st.recall_gammas:
        F = nrff.features(ds.f64(ds.X), K, g, SEED).astype(np.float32)
        Fq = nrff.features(ds.f64(ds.Q), K, g, SEED).astype(np.float32)
        cx = np.sqrt(np.cumsum(F.astype(np.float64) ** 2, axis=1)[:, [k - 1 for k in ks]]).astype(np.float32)
        cq = np.sqrt(np.cumsum(Fq.astype(np.float64) ** 2, axis=1)[:, [k - 1 for k in ks]]).astype(np.float32)

        def nblocks(F=F, Fq=Fq, cx=cx, cq=cq) -> Iterator[tuple[int, int, list]]:
            step = 100
            for lo in range(0, nq, step):
                hi = min(nq, lo + step)
                # cosine of the k-feature prefixes: NRFF with k features is the prefix, renormalised
                yield lo, hi, [((Fq[lo:hi, :k] / cq[lo:hi, i, None]) @ F[:, :k].T) / cx[None, :, i]
                               for i, k in enumerate(ks)]

        collect(f"NRFF γ={g:g}", "RBF", cos10, nblocks())
        del F, Fq
    return {"ks": ks, "C": C, "methods": res, "seconds": time.perf_counter() - t}


def samples_needed(ks: Sequence[int], values: Sequence[float], target: float) -> float | None:
    """Smallest k reaching ``target``, interpolated in log k; None when the largest k does not."""
    for i, v in enumerate(values):
        if v >= target:
            if i == 0:
                return float(ks[0])
            lo, hi = values[i - 1], v
            f = (target - lo) / (hi - lo) if hi > lo else 1.0
            return float(2 ** (np.log2(ks[i - 1]) + f * (np.log2(ks[i]) - np.log2(ks[i - 1]))))
    return None


# ==================================================================================
# figures
# ==================================================================================


def _draw_recall_qps(ax, speed: dict, annotate: bool) -> None:
    series: dict[str, list[dict]] = {}
    for p in speed["points"]:
        series.setdefault(p["series"], []).append(p)
    markers = {"lsh": "o", "nrff": "^", "pynndescent": "D"}
    single = {"exact": lambda p: "s" if "index" in p["setting"] else "P", "lsh default": lambda p: "*"}
    for key, pts in series.items():
        color = COLORS.get(key, "tab:cyan")
        if key in single:  # one point per setting, not a curve
            for p in pts:
                ax.scatter([p["recall"]], [p["qps"]], color=color, marker=single[key](p), s=90, zorder=3,
                           label=f"{key} ({p['setting']})")
            continue
        # in the order of the knob (C, ε): the curve is what turning it buys
        ax.plot([p["recall"] for p in pts], [p["qps"] for p in pts], marker=markers.get(key, "v"), color=color,
                label=key)
        if annotate and key in ("lsh", "pynndescent"):
            for p in pts:
                ax.annotate(p["setting"].replace("epsilon", "ε"), (p["recall"], p["qps"]), fontsize=7,
                            xytext=(3, 4), textcoords="offset points", color=color)
    ax.set_yscale("log")
    ax.set_xlabel("recall@10 (against exact GMM neighbours)")
    ax.set_ylabel("queries per second (one thread, log scale)")
    ax.grid(True, which="both", alpha=0.3)


def fig_recall_qps(speed: dict, title: str) -> Figure:
    """Left: every method (nrff's RBF neighbours are far from GMM's); right: the high-recall region."""
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1, 1.5]})
    _draw_recall_qps(full, speed, annotate=False)
    full.axvline(speed["rbf_ceiling"], color=COLORS["cosine"], linestyle=":", linewidth=1)
    full.annotate(f"exact RBF/cosine neighbours: {speed['rbf_ceiling']:.2f} of GMM's", (speed["rbf_ceiling"], 0.02),
                  xycoords=("data", "axes fraction"), rotation=90, fontsize=7, color="dimgray", xytext=(3, 0),
                  textcoords="offset points")
    full.set_title("all methods", fontsize=10)
    _draw_recall_qps(zoom, speed, annotate=True)
    near = [p["recall"] for p in speed["points"] if p["series"] in ("lsh", "lsh default", "pynndescent")]
    lo = max(0.0, min(near) - 0.02) if near else 0.0
    zoom.set_xlim(lo, 1.005)
    zoom.set_title(f"zoom: recall ≥ {lo:.2f}", fontsize=10)
    zoom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def fig_estimator_mse(est: dict, n_panels: int = 5) -> Figure:
    pairs = est["pairs"]
    # spread the panels over the similarity range
    pick = sorted({int(round(i)) for i in np.linspace(0, len(pairs) - 1, min(n_panels, len(pairs)))}, reverse=True)
    fig, axes = plt.subplots(2, 3, figsize=(14, 8.5))
    flat = axes.ravel()
    g = f"NRFF γ={est['nrff_gamma']:g}"
    names = ["GCWS 0-bit"] + [f"GCWS b={b}" for b in est["bits"]] + [g]
    for ax, i in zip(flat, pick, strict=False):
        r = pairs[i]
        ks = r["ks"]
        for name in names:
            color = COLORS["NRFF"] if name.startswith("NRFF") else COLORS[name]
            ax.plot(ks, r["mse"][name], marker="o", markersize=3, color=color, label=f"{name} (empirical)")
            ax.plot(ks, r["theory"][name], linestyle="--", color=color, linewidth=1, label=f"{name} (theory)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samples k")
        ax.set_ylabel("MSE")
        gkey = f"{est['nrff_gamma']:g}"
        ax.set_title(f"GMM = {r['gmm']:.3f}  |  ρ = {r['rho']:.3f}, RBF(γ={gkey}) = {r['rbf'][gkey]:.3f}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    for ax in flat[len(pick) :]:
        ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=8, ncol=1, bbox_to_anchor=(0.98, 0.06))
    fig.suptitle(f"Empirical MSE (solid) vs theoretical variance (dashed): GCWS estimates GMM (b-bit: corrected), "
                 f"NRFF estimates RBF — {est['seeds']} seeds × {est['samples_per_seed']} samples per pair",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig


def fig_var_over_e2(est: dict) -> Figure:
    E = np.linspace(0.01, 0.999, 400)
    rho = 1.0 + np.log(E)  # with γ = 1, E = exp(−(1 − ρ)); V and V_n depend on E alone
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(E, (1 - E) / E, color=COLORS["GCWS 0-bit"], label="GCWS: (1−E)/E")
    ax.plot(E, nrff.rff_variance(rho, 1.0) / E**2, color="tab:pink", label="RFF: [½ + ½(1−E²)²]/E²")
    ax.plot(E, nrff.nrff_variance(rho, 1.0) / E**2, color=COLORS["NRFF"], label="NRFF: V_n/E² (any γ)")
    kv = est["var_k"]
    pts = est["var_points"]["GCWS 0-bit"]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=COLORS["GCWS 0-bit"], marker="o", zorder=3,
               label=f"GCWS 0-bit, real pairs (k·MSE/E², k={kv})")
    for m, g in zip(("^", "v", "D", "s"), est["var_gammas"], strict=False):
        pts = est["var_points"][f"NRFF γ={g:g}"]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], edgecolors=COLORS["NRFF"], marker=m, zorder=3,
                   facecolors="none", label=f"NRFF γ={g:g}, real pairs")
    ax.set_yscale("log")
    ax.set_ylim(1e-3, 1e3)
    ax.set_xlabel("E (GMM for GCWS, RBF exp(−γ(1−ρ)) for RFF/NRFF)")
    ax.set_ylabel("Var / E² (per sample)")
    ax.set_title("Relative variance, the papers' Figure 3 (lower is better)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_knn(knn: dict, title: str) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {"GMM exact": ("-", "o"), "GMM lsh": ("--", "x"), "RBF via nrff": ("-", "^"),
              "cosine": ("--", "s"), "L2": (":", "D")}
    for name, acc in knn["accuracy"].items():
        ks = sorted(int(k) for k in acc)
        ls, mk = styles.get(name, ("-", "o"))
        ax.plot(ks, [acc[str(k)] for k in ks], linestyle=ls, marker=mk,
                color=COLORS.get(name, None), label=knn["labels"][name])
    ax.set_xscale("log")
    ax.set_xticks(list(KNN_KS))
    ax.set_xticklabels([str(k) for k in KNN_KS])
    ax.set_xlabel("neighbours voting (k of k-NN)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_samples(sr: dict, knn: dict | None) -> Figure:
    C = sr["C"]
    has_acc = any(m["knn_accuracy"] for m in sr["methods"].values())
    fig, axes = plt.subplots(1, 3 if has_acc else 2, figsize=(16 if has_acc else 11, 5))
    style = {"GCWS b=8": ("tab:blue", "o", "-"), "GCWS b=2": ("tab:green", "o", "--")}
    for name, m in sr["methods"].items():
        color, mk, ls = style.get(name, (COLORS["NRFF"], "^", "-" if "γ=1" in name else "--"))
        label = f"{name} (vs exact {m['kernel']})"
        axes[0].plot(m["ks"], m[f"recall_in_top{C}"], color=color, marker=mk, linestyle=ls, label=label)
        bytes_ = [k * m["bytes_per_sample"] for k in m["ks"]]
        axes[1].plot(bytes_, m[f"recall_in_top{C}"], color=color, marker=mk, linestyle=ls, label=label)
        if has_acc:
            axes[2].plot(m["ks"], m["knn_accuracy"], color=color, marker=mk, linestyle=ls, label=name)
    for ax in axes[:2]:
        ax.axhline(0.9, color="gray", linestyle=":", linewidth=1)
        ax.set_ylabel(f"recall@10 within the sketch's top {C}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("samples k per vector")
    axes[0].set_title("Samples needed (ranked by the sketch alone, no rerank)", fontsize=10)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("sketch bytes per vector (GCWS b bits, NRFF float32)")
    axes[1].set_title("The same, per byte stored", fontsize=10)
    axes[0].legend(fontsize=8)
    if has_acc:
        ax = axes[2]
        if knn:
            ax.axhline(knn["accuracy"]["GMM exact"][str(K_NN)], color="black", linestyle=":", linewidth=1,
                       label="GMM exact")
            ax.axhline(knn["accuracy"]["cosine"][str(K_NN)], color=COLORS["cosine"], linestyle=":", linewidth=1,
                       label="RBF exact (= cosine)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("samples k per vector")
        ax.set_ylabel(f"{K_NN}-NN accuracy, sketch-ranked neighbours")
        ax.set_title("k-NN classification with the sketch alone", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def describe_figure(fig: Figure) -> dict:
    """What a figure shows, for tests and readers: each visible axes' labels and its series' point counts."""
    axes = []
    for ax in fig.get_axes():
        if not ax.axison:
            continue
        series = []
        for line in ax.get_lines():
            xy = np.asarray(line.get_xydata(), dtype=float)
            series.append({"kind": "line", "label": str(line.get_label()),
                           "points": int(np.isfinite(xy).all(axis=1).sum()) if xy.size else 0})
        for coll in ax.collections:
            off = np.asarray(coll.get_offsets(), dtype=float)
            series.append({"kind": "scatter", "label": str(coll.get_label()),
                           "points": int(np.isfinite(off).all(axis=1).sum()) if off.size else 0})
        bars = [p for p in ax.patches if p.get_height() > 0]
        if bars:
            series.append({"kind": "bars", "label": "bars", "points": len(bars)})
        axes.append({"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "xscale": ax.get_xscale(), "yscale": ax.get_yscale(), "series": series})
    return {"size_px": [int(v) for v in fig.get_size_inches() * DPI], "axes": axes}


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
    L += ["", f"Recall is against the exact GMM top-10. `lsh default` is the index's default query, {tuned}: "
          f"{_tuned_label(search).removeprefix('tuned: ')}. `lsh` is that search with the rerank budget C "
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
    lsh_knn, nrff_index_top10 = speed.pop("lsh_knn"), speed.pop("nrff_index_top10")
    r["speed"] = speed

    t = time.perf_counter()
    knn = None
    if ds.y is not None:
        nrff_ids = nrff_neighbours(ds, kk)
        m = len(nrff_index_top10)
        agree = np.mean([np.isin(a, b[:K_NN]).mean() for a, b in zip(nrff_index_top10, nrff_ids[:m], strict=True)])
        sets = {"GMM exact": truth.gmm, "GMM lsh": lsh_knn, "RBF via nrff": nrff_ids, "cosine": truth.cosine,
                "L2": truth.l2}
        labels = {"GMM exact": "GMM, exact", "GMM lsh": "GMM, lsh (tuned default)",
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
