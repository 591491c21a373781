"""What the postings search's first stage needs on text, without an index: numpy over the postings.

The postings search (``core/postings.py``) ranks every row by a partial ``Σ min(q_t, v_t)``:
head columns (coordinates held by at least 1/8 of the rows) read for every row, plus the
postings of the query's rare coordinates (held by at most a share ``rare`` of the rows). The
head pass grows with n. Two ways to read less, measured here against the exact top 10 of the
held-out Brown passages (:mod:`bench.sparse_data`):

* ``reached``: rank only the rows the rare coordinates' postings reach — the share of the true
  top 10 among those rows (an upper bound on any ranking of them) and how many rows they are;
* ``heads``: read only the query's ``h`` head coordinates it holds most of (or, ``--by idf``,
  the rarest) — the share of the true top 10 among the best ``C`` rows by the partial ratio
  ``S / (‖q‖₁ + ‖v‖₁ − S)`` (rare coordinates at 1/64 included).

    python -m bench.bench_text_first_stage --n 1000000 --queries 100
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench import sparse_data
from bench.common import emit
from gmmlsh.core.postings import HEAD_SHARE

RARE_SHARES = (1 / 128, 1 / 64, 1 / 32)
#: Rare coordinates' share read beside the head coordinates in the second table.
HEADS_RARE = 1 / 64
HEADS = (8, 16, 24, None)  # None: every head coordinate of the query
CANDIDATES = (400, 1200, 4000)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--by", choices=("count", "idf"), default="count",
                   help="which head coordinates a query keeps: its largest values, or the rarest")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    n = a.n
    X = sparse_data.data(n).tocsr()
    Q = sparse_data.queries(a.queries).tocsr()
    top, _ = sparse_data.truth(n, a.queries)
    C = X.tocsc()
    held = np.diff(C.indptr)
    head = held >= HEAD_SHARE * n
    norms = np.asarray(X.sum(axis=1)).ravel()

    def column(t: int) -> tuple[np.ndarray, np.ndarray]:
        return C.indices[C.indptr[t]:C.indptr[t + 1]], C.data[C.indptr[t]:C.indptr[t + 1]]

    lines = [f"Brown passages, {n:,} rows, {a.queries} held-out queries; {int(head.sum())} head coordinates "
             f"(held by ≥ 1/{round(1 / HEAD_SHARE)} of the rows)", "",
             "| rare share | rows reached (median) | share of n | true top 10 among them |", "|---|---:|---:|---:|"]
    for share in RARE_SHARES:
        reached, kept = [], []
        for i in range(a.queries):
            words = Q.indices[Q.indptr[i]:Q.indptr[i + 1]]
            rare = words[(held[words] > 0) & (held[words] <= share * n)]
            rows = np.unique(np.concatenate([column(t)[0] for t in rare])) if rare.size else np.empty(0, int)
            reached.append(rows.size)
            kept.append(np.isin(top[i], rows).mean())
        lines.append(f"| 1/{round(1 / share)} | {np.median(reached):,.0f} | {np.median(reached) / n:.3f} | "
                     f"{np.mean(kept):.3f} |")
    lines += ["", f"Head coordinates read (a query's largest {'values' if a.by == 'count' else 'idf'} first) and "
              f"rare ones at 1/{round(1 / HEADS_RARE)}: the true top 10 among the best C by the partial ratio", "",
              "| head coordinates read | " + " | ".join(f"C {c:,}" for c in CANDIDATES) + " |",
              "|---|" + "---:|" * len(CANDIDATES)]
    kept_at = {(h, c): [] for h in HEADS for c in CANDIDATES}
    for i in range(a.queries):
        lo, hi = Q.indptr[i], Q.indptr[i + 1]
        words, values = Q.indices[lo:hi], Q.data[lo:hi]
        rare_sum = np.zeros(n)
        for t, v in zip(words, values, strict=True):
            if 0 < held[t] <= HEADS_RARE * n:
                rows, vals = column(t)
                rare_sum[rows] += np.minimum(vals, v)
        mine = np.flatnonzero(head[words])
        weight = values[mine] if a.by == "count" else -held[words[mine]].astype(float)
        mine = mine[np.argsort(-weight, kind="stable")]
        for h in HEADS:
            s = rare_sum.copy()
            for j in mine[:h]:
                rows, vals = column(words[j])
                s[rows] += np.minimum(vals, values[j])
            order = np.argsort(-(s / (values.sum() + norms - s)))
            for c in CANDIDATES:
                kept_at[(h, c)].append(np.isin(top[i], order[:c]).mean())
    for h in HEADS:
        label = "every one" if h is None else f"≤ {h}"
        lines.append(f"| {label} | " + " | ".join(f"{np.mean(kept_at[(h, c)]):.3f}" for c in CANDIDATES) + " |")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
