"""The benchmark report's data: its settings, the data sets (Fashion-MNIST or a user's file), the
exact ground truth (GMM, cosine and L2 neighbours) and small helpers the other parts share."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from bench.common import DATA
from gmmlsh.core import parallel
from gmmlsh.core.gmm import gmm_many, gmm_matrix, l1_norms

ROOT = Path(__file__).resolve().parents[1]
K_NN = 10  # recall@10, and the k of the sketch-only k-NN vote
KNN_KS = (1, 3, 5, 10, 20)
NRFF_K, NRFF_GAMMA = 256, 1.0  # the nrff index of the speed plot
SEED = 0

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
    auto_cs: tuple[int, ...]  # rerank budgets C of the auto search
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
                       recall_gammas=(NRFF_GAMMA,), auto_cs=(25, 100, 400), nrff_cs=(50, 200),
                       nrff_queries=30, exact_queries=10)
        q = queries or 1000
        return cls(n=n, queries=q, knn_queries=max(q, knn_queries or 5000), quick=False, peer=peer, seeds=256,
                   est_kmax=1024,
                   est_ks=(8, 16, 32, 64, 128, 256, 512, 1024), var_k=128, var_gammas=(0.5, 2.0, 8.0),
                   recall_ks=(32, 64, 128, 256, 512, 1024), recall_gammas=(NRFF_GAMMA, 4.0),
                   auto_cs=(25, 50, 100, 200, 400), nrff_cs=(50, 200, 800),
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


def top_rows(S: np.ndarray, k: int, largest: bool = True) -> np.ndarray:
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


def query_row(A, i: int):
    """Row ``i`` as a query for the index: 1-D dense or a 1-row CSR."""
    return A[i] if not sp.issparse(A) else A[i : i + 1]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
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
            S = np.vstack([gmm_many(query_row(Q, i), X, norms) for i in range(lo, hi)])
        else:
            S = gmm_matrix(Q[lo:hi], X, None, norms)
        top = top_rows(S, kk)
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
        cos_ids.append(top_rows(C, kk))
        # ‖q − x‖² = ‖q‖² + ‖x‖² − 2‖q‖‖x‖cos; ‖q‖² is constant per row, so rank by ‖x‖² − 2‖q‖‖x‖cos
        qn = np.sqrt(np.asarray(Q[lo : lo + 200].multiply(Q[lo : lo + 200]).sum(axis=1)).ravel()) if ds.sparse \
            else np.linalg.norm(Q[lo : lo + 200].astype(np.float64), axis=1)
        D = xn[None, :] ** 2 - 2.0 * qn[:, None] * xn[None, :] * C
        l2_ids.append(top_rows(D, kk, largest=False))
    return Truth(np.vstack(ids), np.vstack(sims), np.vstack(cos_ids), np.vstack(l2_ids), pairs,
                 time.perf_counter() - t0)
