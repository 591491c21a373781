"""Parameter planner: from a sample of the data and a target recall, choose (L, r, b, C).

Two facts drive it. A pair with similarity GMM lands in a common bucket with
probability ``1 − (1 − p^r)^L`` with ``p = GMM + (1 − GMM)·2^-b`` (the S-curve);
and among those bucket candidates the index keeps the ``C`` with the highest
sketch agreement, whose ranking error is binomial with variance
``GMM(1 − GMM)/k``. The planner measures both on the sample: true neighbours
and their similarities by exact GMM, agreement ranks by real sketches, then
picks the cheapest layout (fewest expected bucket reads + samples) whose
predicted recall@k_neighbors reaches the target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import scipy.sparse as sp
from gmmlsh.core import gcws
from gmmlsh.core.gmm import gmm_many

#: Layouts tried, cheapest first by samples per vector.
GRID = tuple((L, r) for k in (128, 192, 256, 384, 512) for r in (3, 4, 6, 8) for L in (k // r,) if k % r == 0)


def collision_probability(gmm, bits: int):
    """Per-sample probability that two b-bit codes agree for pairs with this GMM."""
    return gcws.bbit_collision_probability(gmm, bits)


def candidate_probability(gmm, bands: int, rows: int, bits: int):
    """The S-curve: probability that a pair shares at least one of ``bands`` buckets."""
    p = collision_probability(np.asarray(gmm, dtype=np.float64), bits)
    return 1.0 - (1.0 - p**rows) ** bands


@dataclass
class Plan:
    bands: int
    rows: int
    bits: int
    candidates: int
    predicted_recall: float
    expected_bucket_reads: float  # bucket entries read per query, at index size n
    expected_distinct_candidates: float
    s_curve: list[tuple[float, float]] = field(default_factory=list)  # (GMM, Pr[candidate])

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    sample,
    *,
    n_total: int | None = None,
    target_recall: float = 0.95,
    neighbors: int = 10,
    bits: int = 8,
    queries: int = 100,
    seed: int = 0,
) -> Plan:
    """Choose (L, r, b, C) for data like ``sample`` (dense 2-D or CSR rows).

    ``n_total`` is the index size the plan is for (default: the sample size);
    candidate counts and the rerank budget scale with it.
    """
    n = sample.shape[0]
    if n < 2 * queries:
        raise ValueError(f"sample: need at least {2 * queries} rows to plan, got {n}")
    n_total = n_total or n
    rng = np.random.default_rng(seed)
    qi = rng.choice(n, size=queries, replace=False)
    base_mask = np.ones(n, dtype=bool)
    base_mask[qi] = False
    base = sample[base_mask]
    Q = sample[qi]
    S = np.vstack([gmm_many(Q[i] if not sp.issparse(Q) else Q[i], base) for i in range(queries)])
    truth = np.argsort(-S, axis=1)[:, :neighbors]
    # Random-pair similarities predict bucket reads; true neighbours' predict candidate recall.
    kmax = max(L * r for L, r in GRID)
    codes_b = gcws.bbit_codes(gcws.sketch(base, kmax, seed), bits)
    codes_q = gcws.bbit_codes(gcws.sketch(Q, kmax, seed), bits)
    scale = n_total / base.shape[0]
    best = None
    for L, r in GRID:
        k = L * r
        pc = candidate_probability(S, L, r, bits)
        reads = float(pc.sum(axis=1).mean() * scale)  # ≈ distinct candidates per query
        bucket_reads = float(((collision_probability(S, bits) ** r) * L).sum(axis=1).mean() * scale)
        # Agreement rank of each true neighbour among the sample, scaled to n_total.
        agree = (
            (codes_q[:, None, :k] == codes_b[None, :, :k]).sum(axis=2)
            if base.shape[0] * k * queries < 4e8
            else np.stack([(codes_b[:, :k] == codes_q[i, :k]).sum(axis=1) for i in range(queries)])
        )
        ranks = np.empty((queries, neighbors))
        for i in range(queries):
            a = agree[i]
            ranks[i] = [(a > a[t]).sum() * scale for t in truth[i]]
        found = candidate_probability(S[np.arange(queries)[:, None], truth], L, r, bits)
        for C in (50, 100, 200, 400, 800):
            recall = float((found * (ranks < C)).mean())
            if recall >= target_recall:
                # Per-query µs, from profiles of LMDB queries on Fashion-MNIST: ~0.01 per
                # bucket entry read, ~0.3 per sample hashed (784-d), ~0.25 per vector reranked.
                cost = bucket_reads * 0.01 + k * 0.3 + C * 0.25
                if best is None or cost < best[0]:
                    grid = np.linspace(0, 1, 21)
                    best = (
                        cost,
                        Plan(
                            L,
                            r,
                            bits,
                            C,
                            recall,
                            bucket_reads,
                            reads,
                            [(float(g), float(candidate_probability(g, L, r, bits))) for g in grid],
                        ),
                    )
                break
    if best is None:
        raise ValueError(f"target_recall: {target_recall} is not reachable with the layouts tried; lower it")
    return best[1]
