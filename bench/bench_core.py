"""Core benchmark: GCWS, the datasketch peer, sparse GCWS, exact GMM, NRFF — side by side, one run.

    python -m bench.bench_core [--quick] [--out FILE]

Everything is measured in the same process on the same data, after a warm-up:
JIT loading/compilation and the one-time GCWS constant table are timed apart
and reported as one-time costs, never folded into a throughput. Exact GMM is
put against the machine's memory bandwidth measured in the same run (a plain
``np.add.reduce`` over the same array), because a one-query scan cannot beat
one pass over the data. ``--quick`` shrinks every size so the run takes seconds
(a smoke test of the script, not numbers to quote).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import scipy.sparse as sp

from gmmlsh.core import gcws, parallel
from gmmlsh.core.gcws import sketch
from gmmlsh.core.gmm import gmm, gmm_many, gmm_matrix, l1_norms
from gmmlsh.core.nrff import features

DATA = Path(os.environ.get("GMMLSH_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
K = 256
SEED = 1
SPARSE_DIM = 55_197
SPARSE_NNZ = 160


@dataclass
class Sizes:
    """Problem sizes; ``quick`` ones only check that the script works."""

    gcws_rows: int
    peer_rows: int
    sparse_rows: int
    gmm_rows: int
    gmm_queries: int
    gmm_batches: int
    nrff_rows: int
    repeat: int

    @classmethod
    def make(cls, quick: bool) -> Sizes:
        if quick:
            return cls(2_000, 40, 1_000, 5_000, 5, 1, 1_000, 1)
        return cls(60_000, 500, 20_000, 60_000, 20, 3, 20_000, 3)


@dataclass
class Report:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    once: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, what: str, setting: str, value: str, note: str = "") -> None:
        self.rows.append((what, setting, value, note))
        print(f"  {what} [{setting}]: {value} {note}", flush=True)

    def markdown(self, header: list[str]) -> str:
        out = header + ["", "| benchmark | setting | result | note |", "| --- | --- | --- | --- |"]
        out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in self.rows]
        out += ["", "One-time costs (excluded from the throughputs above):", ""]
        out += ["| what | seconds |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in self.once]
        if self.notes:
            out += ["", "Notes:", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` runs: the least disturbed by other load on the machine."""
    best = float("inf")
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def with_threads(n: int, fn: Callable[[], object]) -> object:
    before = parallel.threads()
    parallel.set_threads(n)
    try:
        return fn()
    finally:
        parallel.set_threads(before)


def thread_counts() -> list[int]:
    return [t for t in (1, 2) if t <= numba.config.NUMBA_NUM_THREADS]


def sign_split(X: np.ndarray) -> np.ndarray:
    """The 2D non-negative form (DESIGN §1) that a non-negative-only peer needs."""
    X = np.asarray(X, dtype=np.float32)
    out = np.zeros((X.shape[0], 2 * X.shape[1]), dtype=np.float32)
    out[:, 0::2] = np.maximum(X, 0)
    out[:, 1::2] = np.maximum(-X, 0)
    return out


def zipf_sparse(n: int, rng: np.random.Generator) -> sp.csr_matrix:
    """Text-like rows: ≈ 160 distinct columns of 55,197, Zipf(1.1) by column rank, log-normal weights."""
    p = 1.0 / np.arange(1, SPARSE_DIM + 1) ** 1.1
    p /= p.sum()
    perm = rng.permutation(SPARSE_DIM)  # popular columns are not the low indices
    indptr, indices = [0], []
    for _ in range(n):
        want = max(1, rng.poisson(SPARSE_NNZ))
        cols = np.unique(perm[rng.choice(SPARSE_DIM, size=2 * want, p=p)])
        cols = np.sort(rng.permutation(cols)[:want])
        indices.append(cols)
        indptr.append(indptr[-1] + cols.size)
    idx = np.concatenate(indices)
    data = rng.lognormal(0.0, 1.0, idx.size)
    return sp.csr_matrix((data, idx, np.array(indptr)), shape=(n, SPARSE_DIM))


# --- sections ------------------------------------------------------------------------------


def bench_gcws(train: np.ndarray, s: Sizes, rep: Report) -> dict[int, float]:
    X = train[: s.gcws_rows]
    t = time.perf_counter()
    sketch(X[:2], 8, seed=SEED + 99, path="direct")
    sketch(X[:2], 8, seed=SEED + 99, path="table")
    rep.once.append(("JIT load/compile (first GCWS calls)", f"{time.perf_counter() - t:.2f}"))
    gcws.constant_table.cache_clear()
    t = time.perf_counter()
    gcws.constant_table(2 * X.shape[1], K, SEED)
    rep.once.append((f"GCWS constant table, 2D = {2 * X.shape[1]}, k = {K}", f"{time.perf_counter() - t:.3f}"))
    gcws.walk_table.cache_clear()
    t = time.perf_counter()
    gcws.walk_table(2 * X.shape[1], K, SEED)
    rep.once.append((f"GCWS sorted-walk lists, 2D = {2 * X.shape[1]}, k = {K}", f"{time.perf_counter() - t:.3f}"))
    rates: dict[int, float] = {}
    for th in thread_counts():
        sec = with_threads(th, lambda: best_time(lambda: sketch(X, K, seed=SEED, path="table"), s.repeat))
        rates[th] = X.shape[0] / sec
        rep.add(
            "GCWS Fashion-MNIST (784-d dense)",
            f"k={K}, table, {th} thread(s), {X.shape[0]:,} vectors",
            f"{rates[th]:,.0f} vectors/s",
        )
    sec = best_time(lambda: sketch(X, K, seed=SEED, path="direct"), s.repeat)
    rep.add(
        "GCWS Fashion-MNIST (784-d dense)",
        f"k={K}, direct (no table), all threads",
        f"{X.shape[0] / sec:,.0f} vectors/s",
    )
    return rates


def bench_peer(train: np.ndarray, s: Sizes, rep: Report, ours: dict[int, float]) -> None:
    try:
        import datasketch
        from datasketch import WeightedMinHashGenerator
    except ImportError:
        rep.notes.append("datasketch not installed (`pip install -e .[bench]`): peer rows skipped.")
        return
    X = sign_split(train[: s.peer_rows])
    t = time.perf_counter()
    gen = WeightedMinHashGenerator(X.shape[1], sample_size=K, seed=1)
    rep.once.append(
        (
            f"datasketch {datasketch.__version__} generator, dim = {X.shape[1]}, k = {K}",
            f"{time.perf_counter() - t:.3f}",
        )
    )
    gen.minhash(X[0])  # warm-up
    sec = best_time(lambda: [gen.minhash(x) for x in X], s.repeat)
    dense = X.shape[0] / sec
    rep.add(
        "datasketch WeightedMinHash `minhash` (dense)",
        f"dim=1568 (sign-split), k={K}, {X.shape[0]} vectors",
        f"{dense:,.0f} vectors/s",
        f"ours 1 thread = {ours[1] / dense:,.0f}×",
    )
    csr = sp.csr_matrix(X)
    chunk = 100  # minhash_many materialises k × nnz float64 arrays; 100 rows ≈ 80 MB each

    def many() -> None:
        for lo in range(0, csr.shape[0], chunk):
            gen.minhash_many(csr[lo : lo + chunk])

    sec = best_time(many, s.repeat)
    sparse = X.shape[0] / sec
    rep.add(
        "datasketch WeightedMinHash `minhash_many` (sparse)",
        f"dim=1568, k={K}, chunks of {chunk}",
        f"{sparse:,.0f} vectors/s",
        f"ours 1 thread = {ours[1] / sparse:,.0f}×",
    )
    rep.notes.append(
        "datasketch's `minhash_many` is its fastest path (vectorised over all nonzeros of a batch, "
        "float32 constants); its docstring warns it does not give the same hashes as `minhash`."
    )
    # negative coordinates: the peer takes log of every value and nan-argmins, so negatives vanish
    u = np.array([3.0, 1.0, -2.0, 0.5, -1.0])
    v = np.array([3.0, 1.0, -0.5, 0.5, -4.0])
    small = WeightedMinHashGenerator(u.shape[0], sample_size=K, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        peer = small.minhash(u).jaccard(small.minhash(v))
    iu, iv = sketch(np.vstack([u, v]), K, seed=SEED)
    g = gmm(u, v)
    rep.add(
        "negatives: u=[3,1,-2,0.5,-1], v=[3,1,-0.5,0.5,-4]",
        f"k={K}",
        f"exact GMM {g:.3f}; ours {np.mean(iu == iv):.3f}; datasketch {peer:.3f}",
        f"ours ± {np.sqrt(g * (1 - g) / K):.3f} (1 SE); datasketch drops negative coordinates "
        "(log → NaN → nanargmin), so vectors differing only there look identical",
    )


def bench_sparse(s: Sizes, rep: Report) -> None:
    rng = np.random.default_rng(7)
    X = zipf_sparse(s.sparse_rows, rng)
    sketch(X[:4], K, seed=SEED, path="direct")  # warm-up
    for th in thread_counts():
        sec = with_threads(th, lambda: best_time(lambda: sketch(X, K, seed=SEED, path="direct"), s.repeat))
        rep.add(
            f"GCWS sparse {SPARSE_DIM:,}-d, ≈{X.nnz / X.shape[0]:.0f} nonzeros (Zipf columns)",
            f"k={K}, direct, {th} thread(s), {X.shape[0]:,} vectors",
            f"{X.shape[0] / sec:,.0f} vectors/s",
        )


def bench_gmm(train: np.ndarray, test: np.ndarray, s: Sizes, rep: Report) -> None:
    X = np.ascontiguousarray(train[: s.gmm_rows], dtype=np.float32)
    mb = X.nbytes / 1e6
    np.add.reduce(X, axis=None)
    sec = best_time(lambda: np.add.reduce(X, axis=None), max(3, s.repeat))
    gbs = X.nbytes / sec / 1e9
    bound = gbs * 1e9 / X.nbytes
    rep.add(
        "memory bandwidth (np.add.reduce, 1 thread)",
        f"{X.shape[0]:,} × 784 float32 = {mb:,.0f} MB",
        f"{gbs:.1f} GB/s",
        f"one-pass bound = {bound:,.1f} queries/s",
    )
    norms = l1_norms(X)
    Q = test[: max(s.gmm_queries, 100 * s.gmm_batches)].astype(np.float32)
    gmm_many(Q[0], X, norms)  # warm-up
    for th in thread_counts():

        def one_by_one() -> None:
            for q in Q[: s.gmm_queries]:
                gmm_many(q, X, norms)

        sec = with_threads(th, lambda: best_time(one_by_one, s.repeat))
        qps = s.gmm_queries / sec
        rep.add(
            "exact GMM one query vs all rows (`gmm_many`)",
            f"{X.shape[0]:,} rows, {th} thread(s)",
            f"{qps:,.1f} queries/s",
            f"{qps / bound:.0%} of the bandwidth bound",
        )
    gmm_matrix(Q[:2], X[:1000], x_norms=norms[:1000])  # warm-up

    def batched() -> None:
        for b in range(s.gmm_batches):
            gmm_matrix(Q[100 * b : 100 * (b + 1)], X, x_norms=norms)

    sec = best_time(batched, s.repeat)
    qps = 100 * s.gmm_batches / sec
    rep.add(
        "exact GMM batched (`gmm_matrix`, 100 queries/batch)",
        f"{X.shape[0]:,} rows, all threads",
        f"{qps:,.1f} queries/s",
        f"{qps / bound:.1f}× the one-pass bound (a batch shares each pass)",
    )


def bench_nrff(train: np.ndarray, s: Sizes, rep: Report) -> None:
    X = train[: s.nrff_rows]
    t = time.perf_counter()
    features(X[:2], K, 1.0, seed=SEED)
    rep.once.append((f"NRFF first call (JIT + W, 784 × {K})", f"{time.perf_counter() - t:.2f}"))
    sec = best_time(lambda: features(X, K, 1.0, seed=SEED), s.repeat)
    rep.add("NRFF features (dense 784-d)", f"k={K}, γ=1, {X.shape[0]:,} vectors", f"{X.shape[0] / sec:,.0f} vectors/s")


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: finishes in seconds (smoke test)")
    ap.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    s = Sizes.make(args.quick)
    data = np.load(DATA / "fashion-mnist.npz")
    train, test = data["train"], data["test"]
    rep = Report()
    t0 = time.perf_counter()
    ours = bench_gcws(train, s, rep)
    bench_peer(train, s, rep, ours)
    bench_sparse(s, rep)
    bench_gmm(train, test, s, rep)
    bench_nrff(train, s, rep)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    header = [
        f"# gmmlsh core benchmark{' (--quick: sizes too small to quote)' if args.quick else ''}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {cpu}, {os.cpu_count()} CPUs, numba threads "
        f"{numba.config.NUMBA_NUM_THREADS}, numpy {np.__version__}, numba {numba.__version__}; "
        f"best of {s.repeat}; total {time.perf_counter() - t0:.0f} s.",
    ]
    text = rep.markdown(header)
    print()
    print(text)
    if args.out:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
