"""Where a sketch search loses a query's true neighbours: in the lists it probes, or in the first
stage's shortlist — on any shape of the data zoo, without building an index.

A sketch search (docs/architecture.md, "A query") probes the lists whose profiles agree best
with the query, scores every entry of them on its *first-stage row* (the lowest code bit of
512 samples, 64 bytes), keeps the best ``shortlist``, ranks those on 4 bit planes and scores
the best ``candidates`` by exact GMM. This bench hashes the first ``n`` rows of a shape as an
index does (its defaults), makes lists as a fit does (:mod:`gmmlsh.index.segments`' sizes and
sample), and measures on held-out queries with an exact truth:

1. **lists**: the share of a query's true top 10 lying in its best lists, by the rows those
   lists hold (the rows a query scans), for lists of 256, 512 (the default) and 1,024 rows;
2. **first stage**: with the default lists, for the best lists holding ``--scan`` rows, the
   share of the true top 10 among the ``candidates`` best by rank planes of the ``shortlist``
   best by first-stage agreement, for first-stage rows of 1 bit × 512 samples (64 bytes, the
   engine's), 2 bits × 256 samples (64 bytes) and 2 bits × 512 samples (128 bytes).

    python -m bench.bench_first_stage --shape strokes --n 1000000 [--queries 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from numba import njit

from bench.common import emit
from bench.zoo import SHAPES, truth
from gmmlsh.core.codes import WORD, agreement, bit_planes, plane_words
from gmmlsh.core.ivf import assign, assign_profiles, first_rows, kmodes, profile_scores, profiles
from gmmlsh.index.config import RANK_BITS_MAX, IndexConfig
from gmmlsh.index.records import codes_of
from gmmlsh.index.segments import LIST_ROWS, SAMPLE_MAX, SAMPLE_PER_LIST

#: Rows scanned at which the lists' share of the truth is read off.
SCANNED = (10_000, 20_000, 30_000, 40_000, 60_000)
#: (planes, words of each) of the first-stage rows compared.
FIRST_ROWS = ((1, 8), (2, 4), (2, 8))
SHORTLISTS = (500, 1000, 2000, 4000)
CANDIDATES = (200, 300)


def hashed(shape, n: int, queries: int) -> tuple[np.ndarray, np.ndarray]:
    """Bit planes of the first ``n`` rows and of the first held-out queries, as an index with the
    default settings hashes them."""
    config = IndexConfig(dim=shape.dim)
    X = shape.data(n)
    planes = np.concatenate([bit_planes(codes_of(X[lo:lo + 100_000], config), config.bits)
                             for lo in range(0, n, 100_000)])
    return planes, bit_planes(codes_of(shape.queries(queries, 0), config), config.bits)


class Lists:
    """Lists of about ``list_rows`` rows, made as a fit makes them: k-modes on the first-stage rows
    of a sample, the members' 2-bit modes as profiles, every row to its best profile."""

    def __init__(self, planes: np.ndarray, words: int, bits: int, list_rows: int, seed: int = 0):
        n = planes.shape[0]
        self.count = max(1, n // list_rows)
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(n, min(n, SAMPLE_PER_LIST * self.count, SAMPLE_MAX), replace=False))
        F = first_rows(planes[sample], words, bits)
        t = time.perf_counter()
        self.profiles = profiles(planes, sample, assign(F, kmodes(F, self.count, seed=seed)), self.count, words,
                                 bits)
        self.labels = assign_profiles(planes, np.arange(n), self.profiles, words, bits)
        self.seconds = time.perf_counter() - t
        self.words = words
        self.sizes = np.bincount(self.labels, minlength=self.count)
        self.order = np.argsort(self.labels, kind="stable")
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])

    def ranked(self, qp: np.ndarray) -> np.ndarray:
        """The lists best first for a query's planes (as the search chooses them)."""
        score = np.empty(self.count, np.int64)
        profile_scores(self.profiles, qp, self.words, True, score)
        return np.argsort(-score, kind="stable")

    def members(self, lists: np.ndarray) -> np.ndarray:
        return np.concatenate([self.order[self.starts[c]:self.starts[c + 1]] for c in lists])


def lists_share(lists: Lists, qplanes: np.ndarray, top: np.ndarray) -> list[float]:
    """The share of the true top 10 in the best lists holding each of :data:`SCANNED` rows."""
    hits = np.zeros(len(SCANNED))
    for q in range(qplanes.shape[0]):
        order = lists.ranked(qplanes[q])
        rank = np.empty(lists.count, np.int64)
        rank[order] = np.arange(lists.count)
        held = np.cumsum(lists.sizes[order])
        where = rank[lists.labels[top[q]]]
        for j, rows in enumerate(SCANNED):
            hits[j] += (where <= np.searchsorted(held, rows)).mean()
    return list(hits / qplanes.shape[0])


@njit(cache=True)
def _agreement(planes, rows, qp, words, nplanes, used):
    """:func:`gmmlsh.core.codes.agreement` of each row ``planes[rows[i]]`` with the query's."""
    out = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        out[i] = agreement(planes[rows[i]], qp, words, nplanes, used)
    return out


def first_stage(lists: Lists, planes: np.ndarray, qplanes: np.ndarray, top: np.ndarray, scan: int
                ) -> dict[tuple, float]:
    """(first-stage row, shortlist, candidates) → share of the true top 10 among the candidates,
    scanning the best lists that hold ``scan`` rows."""
    words = lists.words
    out: dict[tuple, float] = {}
    for q in range(qplanes.shape[0]):
        order = lists.ranked(qplanes[q])
        held = np.cumsum(lists.sizes[order])
        rows = lists.members(order[:np.searchsorted(held, scan) + 1])
        ranks = _agreement(planes, rows, qplanes[q], words, RANK_BITS_MAX, words)
        truth_set = set(top[q].tolist())
        for nplanes, used in FIRST_ROWS:
            first = np.argsort(-_agreement(planes, rows, qplanes[q], words, nplanes, used), kind="stable")
            for s in SHORTLISTS:
                short = first[:s]
                by_rank = short[np.argsort(-ranks[short], kind="stable")]
                for c in CANDIDATES:
                    key = (nplanes, used, s, c)
                    out[key] = out.get(key, 0.0) + len(truth_set & set(rows[by_rank[:c]].tolist())) / 10
    return {k: v / qplanes.shape[0] for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="strokes")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--scan", type=int, default=30_000, help="rows the first-stage table's lists hold")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    shape = SHAPES[a.shape]
    config = IndexConfig(dim=shape.dim)
    words = plane_words(config.samples)
    t = time.perf_counter()
    planes, qplanes = hashed(shape, a.n, a.queries)
    hash_s = time.perf_counter() - t
    top = truth(shape, a.n, a.queries)[0]
    L = [f"    python -m bench.bench_first_stage --shape {a.shape} --n {a.n} --queries {a.queries} --scan {a.scan}",
         "", f"{a.shape}, {a.n:,} rows (hashed in {hash_s:.0f} s), {a.queries} held-out queries, exact top 10.", "",
         "| rows a list | lists | fit s | " + " | ".join(f"truth in {r // 1000}k rows" for r in SCANNED) + " |",
         "|---:|---:|---:|" + "---:|" * len(SCANNED)]
    default = None
    for list_rows in (LIST_ROWS // 2, LIST_ROWS, 2 * LIST_ROWS):
        lists = Lists(planes, words, config.bits, list_rows)
        share = lists_share(lists, qplanes, top)
        L.append(f"| {list_rows} | {lists.count:,} | {lists.seconds:.1f} | " + " | ".join(f"{s:.3f}" for s in share)
                 + " |")
        if list_rows == LIST_ROWS:
            default = lists
    stage = first_stage(default, planes, qplanes, top, a.scan)
    L += ["", f"The best lists holding {a.scan:,} rows ({LIST_ROWS} rows a list); the true top 10 among the "
          f"candidates ranked on {RANK_BITS_MAX} bit planes of the shortlist chosen by first-stage agreement:", "",
          "| first-stage row | bytes | " + " | ".join(f"S {s}, C {c}" for s in SHORTLISTS for c in CANDIDATES) + " |",
          "|---|---:|" + "---:|" * (len(SHORTLISTS) * len(CANDIDATES))]
    for nplanes, used in FIRST_ROWS:
        L.append(f"| {nplanes} bit{'s' if nplanes > 1 else ''} × {used * WORD} samples | {nplanes * used * 8} | "
                 + " | ".join(f"{stage[(nplanes, used, s, c)]:.3f}" for s in SHORTLISTS for c in CANDIDATES) + " |")
    emit(L, a.out)


if __name__ == "__main__":
    main()
