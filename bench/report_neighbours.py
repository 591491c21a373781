"""The benchmark report, part 3: GMM against RBF as neighbours — k-NN accuracy, and how many
samples each sketch needs to find its own kernel's exact neighbours."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from numba import njit

from bench.report_data import K_NN, NRFF_GAMMA, NRFF_K, SEED, Dataset, Settings, Truth, top_rows
from gmmlsh.core import codes, gcws, nrff
from gmmlsh.core.codes import WORD, bit_planes
from gmmlsh.core.intrinsics import popcount
from gmmlsh.core.parallel import spread

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
        cand = top_rows(Fq[lo : lo + 200] @ F.T, min(C, F.shape[0]))
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
            out.append(c[top_rows(rbf[None, :], kk)[0]])
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
    top = top_rows(S, C)
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
