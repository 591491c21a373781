"""Redis vs LMDB on Fashion-MNIST, and datasketch's Redis LSH as the peer, in one run.

    python -m bench.bench_redis [--quick] [--out FILE] [--no-peer] [--peer-n N]

Starts a throwaway ``redis-server`` on a free loopback port. Reports insert
vectors/s (``upsert`` batches of 1,000, and the bulk load ``gmmlsh build`` runs:
chunks of 1,000 from a .npy, the next chunk hashed while one is written) and
queries/s on both backends, Redis memory per
vector (INFO used_memory) against the raw vector + sketch bytes, what putting a
500-row write into the search mirror costs (from the batch, or read back), and
datasketch ``MinHashLSH`` (Redis storage, its ``WeightedMinHash`` on the
sign-split vectors) beside gmmlsh on the same subset (default 10,000 vectors;
datasketch hashes ~230 vectors/s): inserts/s, queries/s, deletes/s, memory per
key and recall@10 of its (unordered) candidate sets. Both sides load the same
vectors, answer the same 200 queries, then insert and delete the same 200
extra vectors one at a time.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

from bench.common import DATA, emit, recall_at, start_redis
from gmmlsh.core import parallel
from gmmlsh.core.gmm import gmm_matrix, l1_norms
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.ingest.build import build
from gmmlsh.index.ingest.readers import open_reader


def used_memory(url: str) -> int:
    return int(redis.Redis.from_url(url).info("memory")["used_memory"])


def bulk_load(location: str, npy: Path, **opts) -> float:
    """Vectors/s of ``gmmlsh build``'s path into a fresh index: chunks of 1,000 from ``npy``."""
    parallel.set_threads(2)
    with Index.open(location, IndexConfig(dim=784), **opts) as ix:
        ix.upsert(["warm"], np.ones((1, 784), np.float32))  # compile and load scripts outside the timing
        ix.delete(["warm"])
        s = build(ix, open_reader(npy, chunk_rows=1000), progress=False, handle_signals=False)
    return s.vectors_per_s


def measure(location: str, X: np.ndarray, Q: np.ndarray, truth: np.ndarray, **opts) -> dict:
    n = X.shape[0]
    out = {}
    parallel.set_threads(2)
    with Index.open(location, IndexConfig(dim=784), **opts) as ix:
        t = time.perf_counter()
        for lo in range(0, n, 1000):
            ix.upsert([str(i) for i in range(lo, min(n, lo + 1000))], X[lo : lo + 1000])
        out["insert"] = n / (time.perf_counter() - t)
        t = time.perf_counter()
        ix.maintain()  # lists and tuning: a server's background upkeep, timed apart
        out["upkeep_s"] = time.perf_counter() - t
    parallel.set_threads(1)
    opts = {**opts, "maintain": False}  # the search stays fixed while timed
    with Index.open(location, **opts) as ix:  # a fresh reader, like a new replica
        t = time.perf_counter()
        cold = [ix.query(q, k=10) for q in Q[:100]]
        out["cold_qps"] = len(cold) / (time.perf_counter() - t)
    with Index.open(location, **opts) as ix:
        t = time.perf_counter()
        ix.warm()
        out["warm_s"] = time.perf_counter() - t
        t = time.perf_counter()
        res = [ix.query(q, k=10) for q in Q]
        out["qps"] = Q.shape[0] / (time.perf_counter() - t)
        out["recall"] = recall_at([{int(nb.id) for nb in r.neighbors} for r in res], truth)
    return out


def peer(url: str, X: np.ndarray, Q: np.ndarray, truth: np.ndarray, k: int = 256) -> dict:
    from datasketch import MinHashLSH, WeightedMinHashGenerator

    def split(A):  # datasketch drops negatives; split signs ourselves so it sees all of GMM's input
        return np.hstack([np.maximum(A, 0), np.maximum(-A, 0)]).astype(np.float64)

    gen = WeightedMinHashGenerator(2 * X.shape[1], sample_size=k, seed=1)
    t = time.perf_counter()
    hashes = [gen.minhash(v) for v in split(X)]
    hash_rate = X.shape[0] / (time.perf_counter() - t)
    before = used_memory(url)
    lsh = MinHashLSH(
        threshold=0.5,
        num_perm=k,
        storage_config={
            "type": "redis",
            "basename": b"dsk",
            "redis": {"host": "127.0.0.1", "port": int(url.rsplit(":", 1)[1].split("/")[0])},
        },
    )
    t = time.perf_counter()
    with lsh.insertion_session() as session:
        for i, h in enumerate(hashes):
            session.insert(str(i), h)
    session_rate = X.shape[0] / (time.perf_counter() - t)
    mem = (used_memory(url) - before) / X.shape[0]
    keys = redis.Redis.from_url(url).dbsize()
    qh = [gen.minhash(v) for v in split(Q)]
    t = time.perf_counter()
    found = [set(int(c) for c in lsh.query(h)) for h in qh]
    qps = Q.shape[0] / (time.perf_counter() - t)
    cands = float(np.mean([len(f) for f in found]))
    extra = [gen.minhash(v) for v in split(X[:200] + 1)]
    t = time.perf_counter()
    for i, h in enumerate(extra):
        lsh.insert(f"e{i}", h)
    insert_rate = len(extra) / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(len(extra)):
        lsh.remove(f"e{i}")
    delete_rate = len(extra) / (time.perf_counter() - t)
    return {
        "hash": hash_rate,
        "insert": insert_rate,
        "session": session_rate,
        "qps": qps,
        "delete": delete_rate,
        "recall": recall_at(found, truth),
        "cands": cands,
        "mem": mem,
        "keys": keys,
    }


def ours(url: str, X: np.ndarray, Q: np.ndarray, truth: np.ndarray, prefix: str) -> dict:
    """Our side of the peer table, step for step as :func:`peer` measures datasketch, on the
    same vectors: batched inserts (batches of 1,000, hashing included: theirs is done
    beforehand), queries from a fresh warm reader on one thread, then single inserts and
    single deletes of 200 extra vectors in the loaded index."""
    out = {}
    before = used_memory(url)
    parallel.set_threads(2)
    with Index.open(url, IndexConfig(dim=784), prefix=prefix) as ix:
        ix.upsert(["warm"], X[:1])  # compile and load the scripts outside the timing
        ix.delete(["warm"])
        t = time.perf_counter()
        for lo in range(0, X.shape[0], 1000):
            ix.upsert([str(i) for i in range(lo, min(X.shape[0], lo + 1000))], X[lo : lo + 1000])
        out["session"] = X.shape[0] / (time.perf_counter() - t)
        t = time.perf_counter()
        ix.maintain()  # lists and tuning: a server's background upkeep, timed apart
        out["upkeep_s"] = time.perf_counter() - t
    out["mem"] = (used_memory(url) - before) / X.shape[0]
    parallel.set_threads(1)
    with Index.open(url, prefix=prefix, maintain=False) as ix:
        ix.warm()
        t = time.perf_counter()
        res = [ix.query(q, k=10) for q in Q]
        out["qps"] = Q.shape[0] / (time.perf_counter() - t)
        out["recall"] = recall_at([{int(nb.id) for nb in r.neighbors} for r in res], truth)
        extra = X[:200] + 1
        t = time.perf_counter()
        for i in range(extra.shape[0]):
            ix.upsert([f"e{i}"], extra[i : i + 1])
        out["insert"] = extra.shape[0] / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(extra.shape[0]):
            ix.delete([f"e{i}"])
        out["delete"] = extra.shape[0] / (time.perf_counter() - t)
    return out


def apply_cost(location: str, X: np.ndarray, rounds: int = 30, **opts) -> dict:
    """Milliseconds to put a 500-row write (half replacements) into the search mirror: from the
    batch the writer holds (as every write is put there now), against read back from the store (as
    a query on another machine puts a Redis write there), rounds alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        with Index.open(location, IndexConfig(dim=784), cache_dir=Path(tmp) / "w", maintain=False, **opts) as w:
            base = X.shape[0] - 500 * rounds
            w.write(w.prepare([str(i) for i in range(base)], X[:base]), searchable=False)
            w.view()
            took: dict[bool, list[float]] = {True: [], False: []}
            for j, lo in enumerate(range(base, X.shape[0], 500)):
                batch = w.prepare([str(i) for i in range(lo - 250, lo + 250)], X[lo:lo + 500])
                done = w.store.write(batch)
                t = time.perf_counter()
                w.mirror.sync(w.store, written=(done.iids, batch) if j % 2 else None)
                took[bool(j % 2)].append(time.perf_counter() - t)
    return {"own_ms": 1e3 * float(np.median(took[True])), "back_ms": 1e3 * float(np.median(took[False])),
            "rows": X.shape[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10,000 vectors, 200 queries, small peer run")
    ap.add_argument("--peer-n", type=int, help="vectors of the peer comparison (default 10,000)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    n, nq, n_peer = (10_000, 200, 1000) if a.quick else (60_000, 1000, 10_000)
    n_peer = min(a.peer_n or n_peer, n)
    d = np.load(DATA / "fashion-mnist.npz")
    X = d["train"][:n].astype(np.float32)
    Q = d["test"][:nq].astype(np.float32)
    S = np.vstack([gmm_matrix(Q[i : i + 100], X, None, l1_norms(X)) for i in range(0, nq, 100)])
    truth = np.argsort(-S, axis=1)[:, :10]
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-bench-redis-"))
    proc, url = start_redis(work)
    lines = [f"Fashion-MNIST, {n:,} vectors, {nq:,} queries (k=10), default parameters; redis-server on loopback.", ""]
    try:
        lm = measure(str(work / "lmdb"), X, Q, truth)
        before = used_memory(url)
        rd = measure(url, X, Q, truth, prefix="bench")
        mem = (used_memory(url) - before) / n
        raw = 784 * 4 + IndexConfig(dim=784).sketch_bytes
        npy = work / "x.npy"
        np.save(npy, X)
        lm["bulk"] = bulk_load(str(work / "lmdb-bulk"), npy)
        rd["bulk"] = bulk_load(url, npy, prefix="bulk")
        redis.Redis.from_url(url).flushall()
        Xa = X[:20_000] if not a.quick else X[:5_000]
        applied = {"LMDB": apply_cost(str(work / "lmdb-apply"), Xa), "Redis": apply_cost(url, Xa, prefix="apply")}
        redis.Redis.from_url(url).flushall()
        lines += [
            "| backend | inserts/s (upsert batches of 1,000) | lists + tuning after them (s) | bulk load/s (build, "
            "chunks of 1,000, lists and tuning included) | warm-up (s) | queries/s warm (1 thread) | queries/s, "
            "first 100 of a fresh reader | recall@10 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, m in (("LMDB", lm), ("Redis", rd)):
            lines.append(
                f"| {name} | {m['insert']:,.0f} | {m['upkeep_s']:.1f} | {m['bulk']:,.0f} | {m['warm_s']:.1f} | "
                f"{m['qps']:,.0f} | {m['cold_qps']:,.0f} | {m['recall']:.4f} |"
            )
        lines += [
            "",
            f"- Redis queries/s = {rd['qps'] / lm['qps']:.0%} of LMDB's",
            f"- Redis memory per vector: {mem:,.0f} bytes (raw vector + sketch: {raw:,} bytes; ratio {mem / raw:.2f})",
        ]
        lines += [f"- {name}: a 500-row write (half replacements) put into the search mirror, up to "
                  f"{m['rows']:,} rows, from the batch the writer holds {m['own_ms']:.1f} ms at the median; read "
                  f"back from the store {m['back_ms']:.1f} ms" for name, m in applied.items()]
        if not a.no_peer:
            Xp, Sp = X[:n_peer], S[:, :n_peer]
            tp = np.argsort(-Sp, axis=1)[:, :10]
            redis.Redis.from_url(url).flushall()
            p = peer(url, Xp, Q[:200], tp[:200])
            redis.Redis.from_url(url).flushall()
            o = ours(url, Xp, Q[:200], tp[:200], "same")
            np.save(work / "xp.npy", Xp)
            o["bulk"] = bulk_load(url, work / "xp.npy", prefix="samebulk")
            lines += [
                "",
                f"Peer: datasketch MinHashLSH (Redis storage, threshold 0.5, WeightedMinHash k=256) and "
                f"gmmlsh on the same {n_peer:,} vectors, measured the same way, one after the other:",
                "",
                "| | datasketch | gmmlsh (Redis) | ratio |",
                "|---|---|---|---|",
                f"| inserts/s (one at a time, 200 into the loaded index) | {p['insert']:,.0f} | "
                f"{o['insert']:,.0f} | {o['insert'] / p['insert']:.1f}× |",
                f"| inserts/s (datasketch insertion session vs our batches of 1,000) | {p['session']:,.0f} | "
                f"{o['session']:,.0f} | {o['session'] / p['session']:.1f}× |",
                f"| inserts/s (datasketch insertion session vs our bulk load: build, chunks of 1,000) | "
                f"{p['session']:,.0f} | {o['bulk']:,.0f} | {o['bulk'] / p['session']:.1f}× |",
                f"| hashing vectors/s | {p['hash']:,.0f} | | |",
                f"| lists and tuning after our batches (background upkeep in a server) | | {o['upkeep_s']:.1f} s | |",
                f"| queries/s (200) | {p['qps']:,.0f} | {o['qps']:,.0f} | {o['qps'] / p['qps']:.1f}× |",
                f"| deletes/s (one at a time) | {p['delete']:,.0f} | {o['delete']:,.0f} | "
                f"{o['delete'] / p['delete']:.1f}× |",
                f"| recall@10 | {p['recall']:.3f} (of unordered candidate sets, mean size {p['cands']:,.0f}) | "
                f"{o['recall']:.3f} (top 10, reranked) | |",
                f"| Redis memory | {p['mem']:,.0f} bytes/vector, {p['keys']:,} keys | {o['mem']:,.0f} bytes/vector | |",
            ]
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    emit(lines, a.out)


if __name__ == "__main__":
    main()
