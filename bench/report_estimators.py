"""The benchmark report, part 2: the estimators (GCWS 0-bit and b-bit, NRFF) on real pairs —
their MSE against k over the theory, and Var/E² against E (the papers' Figure 3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse as sp

from bench.report_data import NRFF_GAMMA, Dataset, Settings, Truth
from gmmlsh.core import codes, gcws, nrff
from gmmlsh.core.gmm import gmm

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
