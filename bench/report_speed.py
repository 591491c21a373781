"""The benchmark report, part 1: speed against recall of every method through its real query
path (one thread, the same queries and truth), and pynndescent with the GMM metric as the peer."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.report_data import (
    K_NN,
    KNN_KS,
    NRFF_GAMMA,
    NRFF_K,
    Dataset,
    Settings,
    Truth,
    disk_bytes,
    query_row,
    recall,
    single_thread,
    timed,
    top_rows,
)
from gmmlsh.core.gmm import gmm_many, l1_norms
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index

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


def tuned_label(search: dict) -> str:
    if search["exact"]:
        return "tuned: exact"
    probes = search["probes"] or "all"
    return (f"tuned: probes={probes}, shortlist={search['shortlist']}, rank_bits={search['rank_bits']}, "
            f"C={search['candidates']}")


def speed_recall(ds: Dataset, truth: Truth, st: Settings, work: Path, log: Callable[[str], None],
                 knn_queries=None) -> dict:
    """Every method through its real query path, one thread, same queries, same ground truth.

    Also answers ``knn_queries`` (all labelled queries) through the default (``auto``) path, for the k-NN table.
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

    def run(index: Index, series: str, setting: str, queries: int, mode: str = "auto", **kw) -> None:
        qs = min(queries, nq)
        res, secs = timed(lambda: [index.query(query_row(Q, i), k=K_NN, mode=mode, **kw) for i in range(qs)])
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

    ix = build("auto", cfg, f"gmmlsh index (samples={cfg.samples}, b={cfg.bits})",
               "LMDB store + search mirror on disk; in memory, the memory-mapped mirror queries read (bit planes, "
               "first-stage rows, lists, vectors)")
    search = {k: v for k, v in ix.stats()["search"].items() if k != "overrides"}
    raw = (X.data.nbytes + X.indices.nbytes) / n if ds.sparse else X.shape[1] * 4
    builds.append({"method": "exact (brute force over stored vectors)", "seconds": 0.0, "threads": st.threads,
                   "bytes_per_vector": raw, "memory_bytes_per_vector": raw, "note": "the float32 vectors alone"})
    with single_thread():
        for i in range(min(20, nq)):
            ix.query(query_row(Q, i), k=K_NN)
            ix.query(query_row(Q, i), k=K_NN, candidates=min(st.auto_cs))
        run(ix, "auto", tuned_label(search), nq)
        for C in st.auto_cs:
            run(ix, "auto over C", f"C={C}", nq, candidates=C)
        run(ix, "exact", "via index", st.exact_queries, mode="exact")
        norms = l1_norms(X)
        qs = min(nq, 100)
        gmm_many(query_row(Q, 0), X, norms)
        found, secs = timed(lambda: [top_rows(gmm_many(query_row(Q, i), X, norms)[None, :], K_NN)[0]
                                     for i in range(qs)])
        points.append({"series": "exact", "setting": "in-memory numba scan", "recall": recall(found, t10[:qs]),
                       "qps": qs / secs, "scored": float(n), "queries": qs})
        log(f"  exact in memory: {qs / secs:,.0f} q/s")
    KQ = Q if knn_queries is None else knn_queries
    auto_knn = [_ids(r) for r in ix.query_batch(KQ, k=min(max(KNN_KS), n))]
    ix.close()

    nix = build("nrff", ncfg, f"gmmlsh index with NRFF (k={NRFF_K}, γ={NRFF_GAMMA:g})",
                "the first index plus float32 NRFF features")
    with single_thread():
        for i in range(min(5, nq)):
            nix.query(query_row(Q, i), k=K_NN, mode="nrff")
        for C in st.nrff_cs:
            run(nix, "nrff", f"C={C}", st.nrff_queries, mode="nrff", candidates=C)
        nrff_top10 = [_ids(nix.query(query_row(Q, i), k=K_NN, mode="nrff", candidates=200))
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
            "auto_knn": np.array(auto_knn), "nrff_index_top10": nrff_top10,
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
            (idx, _), secs = timed(lambda e=eps: nnd.query(Q, k=K_NN, epsilon=e))
            p = {"series": "pynndescent", "setting": f"epsilon={eps:g}", "recall": recall(idx, t10),
                 "qps": Q.shape[0] / secs, "scored": None, "queries": int(Q.shape[0])}
            points.append(p)
            log(f"  pynndescent eps={eps:g}: recall@10 {p['recall']:.4f}, {p['qps']:,.0f} q/s")
    return {"points": points, "build": build}
