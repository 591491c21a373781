"""How gmmlsh scales: queries/s, recall, build and memory against n, beside pynndescent.

    python -m bench.bench_scale [--shape fashion] [--sizes 60000,240000,1000000] [--backends lmdb,redis]
                                [--queries 1000] [--rounds 3] [--no-peer] [--memory]
                                [--out bench/out/scale.md] [--plot docs/scale.png]

Data: a shape of the data zoo (:mod:`bench.zoo`: ``fashion``, Fashion-MNIST grown by shifted,
rescaled copies; ``strokes``, ``text``, ``signed``) grown to each n; queries: its held-out ones;
truth: exact GMM (compared by similarity: text has ties). For each n and backend:

* ``gmmlsh build`` of the whole file, timed as a command (process start included);
* recall@10 of the index as the build left it (tuned on stored vectors), before it serves anything;
* 200 other test images served first (a server re-tunes on the queries it serves:
  ``maintain()`` here, as its background upkeep would), then the timed queries, one
  per call on one thread, with the index's own (tuned) search; recall@10 against the truth;
* inserts after the build: batches of 1,000 new rows;
* with ``--memory`` (LMDB, largest n): PSS and USS of ``gmmlsh serve`` with one and with
  two workers, each warmed by queries over HTTP.

pynndescent (numba GMM metric, ``n_neighbors=30``, dense rows: sparse shapes densified) is
built on the same rows (2 threads) and queried on one thread at several ε; its rounds alternate
with gmmlsh's, so both see the same machine. Its queries run as one batched call (its own API,
its best case); gmmlsh's ``query_batch`` on one thread is shown beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench import zoo
from bench.common import build_index, emit, gmm_distance, serve, start_redis, store_args
from gmmlsh.core import parallel
from gmmlsh.index.index import Index

WARM_QUERIES = 200  # served before timing, held-out queries after the timed ones (never timed)
PEER_EPS = (0.02, 0.05, 0.1, 0.2)


def _recall(found: list[list[float]], truth: np.ndarray) -> float:
    """Recall@10 by similarity: a neighbour counts when it reaches the true 10th (ties count)."""
    tenth = truth[:, -1]
    return float(np.mean([min(10, sum(s >= t - 1e-9 for s in f)) / 10 for f, t in zip(found, tenth, strict=True)]))


def _sims(results) -> list[list[float]]:
    return [[nb.similarity for nb in r.neighbors] for r in results]


def _rows(Q, i: int):
    return Q[i] if not sp.issparse(Q) else Q[i:i + 1]


def build(shape: zoo.Shape, n: int, backend: str, workdir: Path, redis_url: str | None) -> tuple[dict, dict]:
    """``gmmlsh build`` of the first n rows; returns (how to open the index, the build's summary)."""
    shape.data(n)
    src = shape.path(n)
    if backend == "lmdb":
        shutil.rmtree(workdir / f"lmdb-{n}", ignore_errors=True)
        opened = {"location": str(workdir / f"lmdb-{n}")}
    else:
        opened = {"location": redis_url, "prefix": f"scale{n}", "cache_dir": str(workdir / "cache")}
    return opened, build_index(src, store_args(**opened))


def gmmlsh_round(ix: Index, Q, truth: np.ndarray) -> tuple[float, float, float]:
    """(queries/s one per call, recall@10, mean rows scored exactly)."""
    qs = [_rows(Q, i) for i in range(Q.shape[0])]
    t = time.perf_counter()
    res = [ix.query(q, k=10) for q in qs]
    dt = time.perf_counter() - t
    return len(qs) / dt, _recall(_sims(res), truth), float(np.mean([r.candidates for r in res]))


def gmmlsh_batched(ix: Index, Q, truth: np.ndarray) -> tuple[float, float]:
    t = time.perf_counter()
    res = ix.query_batch(Q, k=10)
    dt = time.perf_counter() - t
    return Q.shape[0] / dt, _recall(_sims(res), truth)


def inserts(ix: Index, shape: zoo.Shape, n: int, batches: int = 5, size: int = 1000) -> float:
    """Vectors/s of upserts in batches of ``size`` into the built index (new ids)."""
    X = shape.grown.rows(n, n + batches * size)
    t = time.perf_counter()
    for b in range(batches):
        ix.upsert([f"new{n}-{b * size + i}" for i in range(size)], X[b * size:(b + 1) * size])
    rate = batches * size / (time.perf_counter() - t)
    ix.delete([f"new{n}-{i}" for i in range(batches * size)])
    return rate


def peer(X: np.ndarray):
    """pynndescent on ``X`` (dense) with a numba GMM metric; returns (index, build seconds)."""
    from pynndescent import NNDescent

    parallel.set_threads(2)
    NNDescent(np.ascontiguousarray(X[:2000]), metric=gmm_distance, n_neighbors=30, random_state=0).prepare()
    t = time.perf_counter()
    nnd = NNDescent(X, metric=gmm_distance, n_neighbors=30, random_state=0, n_jobs=2, low_memory=True)
    nnd.prepare()
    seconds = time.perf_counter() - t
    parallel.set_threads(1)
    nnd.query(X[:10], k=10)
    return nnd, seconds


def peer_round(nnd, Q: np.ndarray, truth: np.ndarray, eps: float) -> tuple[float, float]:
    t = time.perf_counter()
    _, dist = nnd.query(Q, k=10, epsilon=eps)
    dt = time.perf_counter() - t
    return len(Q) / dt, _recall((1.0 - dist).tolist(), truth)


def _smaps(pid: int) -> tuple[int, int]:
    """(PSS, USS) of a process in bytes."""
    pss = uss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key == "Pss":
                pss = int(rest.split()[0]) * 1024
            elif key in ("Private_Clean", "Private_Dirty"):
                uss += int(rest.split()[0]) * 1024
    return pss, uss


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def serve_memory(location: str, workers: int, Q: np.ndarray) -> dict:
    """PSS/USS of ``gmmlsh serve`` (every process) after warm-up queries over HTTP."""
    import httpx

    proc, url = serve(location, workers, env={"GMMLSH_THREADS": "1"})
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for q in (Q[:400].toarray() if sp.issparse(Q) else Q[:400]):  # spread over the workers by the accept queue
                c.post("/neighbors/search", json={"values": q.tolist(), "k": 10}).raise_for_status()
        pids = [proc.pid, *_children(proc.pid)]
        pss = uss = 0
        for p in pids:
            a, b = _smaps(p)
            pss, uss = pss + a, uss + b
        return {"workers": workers, "processes": len(pids), "pss": pss, "uss": uss}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(args) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gmmlsh-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    shape = zoo.SHAPES[args.shape]
    nq = min(args.queries, shape.held_out - WARM_QUERIES)
    Q = shape.queries(nq, 0)
    warm = shape.queries(WARM_QUERIES, nq)
    results: dict = {"shape": shape.name, "sizes": {}, "queries": nq, "rounds": args.rounds}
    redis_proc = None
    try:
        for n in sizes:
            # A fresh redis-server for each size: at 1M the machine's 24 GB hold two mirrors, Redis'
            # copy and pynndescent's, and the smaller sizes' records would only crowd them.
            redis_proc, redis_url = (start_redis(workdir) if "redis" in args.backends else (None, None))
            truth = zoo.truth(shape, n, nq)[1]
            entry: dict = {"gmmlsh": {}, "peer": None}
            results["sizes"][n] = entry
            for backend in args.backends.split(","):
                parallel.set_threads(2)
                opened, summary = build(shape, n, backend, workdir, redis_url)
                with Index.open(**opened, maintain=False) as built:  # as the build left it (its served
                    at_build = gmmlsh_batched(built, Q, truth)[1]    # queries go with it)
                ix = Index.open(**opened, maintain=False)  # the search stays fixed while timed
                for i in range(warm.shape[0]):  # served queries, then what the server's upkeep does: re-tune
                    ix.query(_rows(warm, i), k=10)
                upkeep = ix.maintain()
                parallel.set_threads(1)
                ix.warm()
                for i in range(100):
                    ix.query(_rows(Q, i), k=10)
                entry["gmmlsh"][backend] = {
                    "build_s": summary["command_seconds"], "build_rate": n / summary["command_seconds"],
                    "tuned_at_build": (summary["upkeep"].get("tune") or [None])[-1], "recall_at_build": at_build,
                    "retuned": (upkeep.get("tune") or [None])[-1],
                    "search": ix.stats()["search"], "rounds": [],
                    "disk_bytes": ix.stats()["mirror"]["disk_bytes"], "store": ix.stats()["store"]}
                entry["gmmlsh"][backend]["ix"] = ix
                print(f"n={n:,} {backend}: built in {summary['command_seconds']:.1f} s, search "
                      f"{entry['gmmlsh'][backend]['search']}", flush=True)
            nnd = None
            if args.peer:
                X = shape.data(n)
                X = np.ascontiguousarray(X.toarray() if sp.issparse(X) else X)
                nnd, peer_s = peer(X)
                entry["peer"] = {"build_s": peer_s, "rounds": {eps: [] for eps in PEER_EPS}}
                del X
            parallel.set_threads(1)
            for g in entry["gmmlsh"].values():  # the peer's build may have pushed the mirrors out of the page cache:
                g["ix"].warm()                  # mapped in again, and one untimed pass over the queries
                gmmlsh_round(g["ix"], Q, truth)
            gc.collect()  # the timed rounds' garbage is collected in the harness's heap
            gc.freeze()
            Qd = Q.toarray() if sp.issparse(Q) else Q
            for _ in range(args.rounds):  # alternating: every method sees the same minutes of the machine
                for g in entry["gmmlsh"].values():
                    g["rounds"].append(gmmlsh_round(g["ix"], Q, truth))
                    g.setdefault("batched", []).append(gmmlsh_batched(g["ix"], Q, truth))
                if nnd is not None:
                    for eps in PEER_EPS:
                        entry["peer"]["rounds"][eps].append(peer_round(nnd, Qd, truth, eps))
            for g in entry["gmmlsh"].values():  # inserts last: they leave the index's lists with a tail
                ix = g.pop("ix")
                g["inserts_per_s"] = inserts(ix, shape, n)
                ix.close()
            del nnd
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()
                redis_proc = None
            if args.memory and n == sizes[-1] and "lmdb" in entry["gmmlsh"]:
                loc = str(workdir / f"lmdb-{n}")
                entry["memory"] = [serve_memory(loc, w, Q) for w in (1, 2)]
            print(json.dumps(entry, default=str)[:2000], flush=True)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def _best(rounds: list[tuple]) -> tuple:
    """The round with the median queries/s (recall is the same in every round)."""
    return sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]


def report(res: dict) -> list[str]:
    L = ["| n | backend | build (whole command) | inserts/s (batches of 1,000) | search (tuned) | recall@10 | "
         "queries/s, one per call | queries/s, `query_batch` | rows scored |",
         "|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for n, e in res["sizes"].items():
        for backend, g in e["gmmlsh"].items():
            qps, rec, scored = _best(g["rounds"])
            bq, _ = _best(g["batched"])
            s = g["search"]
            knobs = "exact" if s["exact"] else (f"probes {s['probes']}, shortlist {s['shortlist']}, "
                                                f"{s['rank_bits']} bits, C {s['candidates']}")
            L.append(f"| {n:,} | {backend} | {g['build_s']:.1f} s ({g['build_rate']:,.0f}/s) | "
                     f"{g['inserts_per_s']:,.0f} | {knobs} | {rec:.3f} | {qps:,.0f} | {bq:,.0f} | {scored:.0f} |")
    L += ["", "Recall@10 as `gmmlsh build` left each index (tuned on stored vectors, nothing served yet): " + "; ".join(
        f"{n:,} {backend} {g['recall_at_build']:.3f}" for n, e in res["sizes"].items()
        for backend, g in e["gmmlsh"].items()) + "."]
    L += ["", "| n | pynndescent build (2 threads) | ε | recall@10 | queries/s (batched call) |",
          "|---:|---:|---:|---:|---:|"]
    for n, e in res["sizes"].items():
        if e["peer"]:
            for eps, rounds in e["peer"]["rounds"].items():
                qps, rec = _best(rounds)
                L.append(f"| {n:,} | {e['peer']['build_s']:.0f} s | {eps} | {rec:.3f} | {qps:,.0f} |")
    for n, e in res["sizes"].items():
        for m in e.get("memory", []):
            L.append(f"\n`gmmlsh serve --workers {m['workers']}` at n = {n:,} ({m['processes']} process"
                     f"{'es' if m['processes'] > 1 else ''}): "
                     f"PSS {m['pss'] / 2**30:.2f} GiB, USS {m['uss'] / 2**30:.2f} GiB")
    return L


def plot(res: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    sizes = list(res["sizes"])
    for backend in ("lmdb", "redis"):
        pts = [(n, _best(res["sizes"][n]["gmmlsh"][backend]["rounds"])) for n in sizes
               if backend in res["sizes"][n]["gmmlsh"]]
        if pts:
            recalls = [r[1] for _, r in pts]
            ax.plot([n for n, _ in pts], [r[0] for _, r in pts], "o-",
                    label=f"gmmlsh ({backend}, tuned default), recall {min(recalls):.2f}–{max(recalls):.2f}")
    for eps in PEER_EPS:
        pts = [(n, _best(res["sizes"][n]["peer"]["rounds"][eps])) for n in sizes if res["sizes"][n]["peer"]]
        if pts:
            recalls = [r[1] for _, r in pts]
            ax.plot([n for n, _ in pts], [r[0] for _, r in pts], "s--", alpha=0.7,
                    label=f"pynndescent ε={eps}, recall {min(recalls):.2f}–{max(recalls):.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("vectors in the index (n)")
    ax.set_ylabel("queries/s, one thread")
    ax.set_title(f"{res.get('shape', 'fashion')}: the zoo shape grown to n")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(zoo.SHAPES), default="fashion")
    p.add_argument("--sizes", default="60000,240000,1000000")
    p.add_argument("--backends", default="lmdb,redis")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-peer", dest="peer", action="store_false")
    p.add_argument("--memory", action="store_true", help="PSS/USS of 1 and 2 serving workers at the largest n")
    p.add_argument("--workdir", help="keep the indexes here (default: a temporary directory, removed)")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    res = run(args)
    if args.out:
        args.out.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(res, default=str, indent=1))
    emit(report(res), args.out)
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
