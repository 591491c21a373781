"""HTTP benchmark: a real `gmmlsh serve` under load from a separate process.

    python -m bench.bench_http [--quick] [--seconds 10] [--out FILE]

Builds a Fashion-MNIST LMDB index, serves it with 1 and then 2 uvicorn workers,
and drives ``GET /neighbors?id=…&k=10`` from a separate load process (8 client
threads with keep-alive) for a fixed time: requests/s, p50 and p99. Then
``POST /vectors`` in batches of 1,000 (vectors/s), and the in-process query rate
of the same index for the HTTP/in-process ratio. On a 2-core machine the load
generator shares the CPU with the server: the figures are a floor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numba
import numpy as np

from bench.common import DATA, emit, serve
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index

LOAD = r"""
import json, random, sys, threading, time, httpx
url, n, seconds, threads = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
lat, errors = [], [0]
lock = threading.Lock()
def worker(seed):
    rnd = random.Random(seed)
    with httpx.Client(base_url=url, timeout=30) as c:
        end = time.perf_counter() + seconds
        mine = []
        while time.perf_counter() < end:
            t = time.perf_counter()
            r = c.get("/neighbors", params={"id": str(rnd.randrange(n)), "k": 10})
            mine.append(time.perf_counter() - t)
            if r.status_code != 200:
                errors[0] += 1
        with lock:
            lat.extend(mine)
ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
t0 = time.perf_counter()
[t.start() for t in ts]; [t.join() for t in ts]
dt = time.perf_counter() - t0
print(json.dumps({"n": len(lat), "seconds": dt, "errors": errors[0], "lat": sorted(lat)}))
"""


def load(url: str, n: int, seconds: float, threads: int = 8) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", LOAD, url, str(n), str(seconds), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout)
    lat = np.array(r["lat"])
    return {
        "rps": r["n"] / r["seconds"],
        "p50": np.percentile(lat, 50) * 1e3,
        "p99": np.percentile(lat, 99) * 1e3,
        "errors": r["errors"],
        "requests": r["n"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10,000 vectors, 3 s per load run")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    n = 10_000 if a.quick else 60_000
    seconds = 3.0 if a.quick else a.seconds
    d = np.load(DATA / "fashion-mnist.npz")
    X = d["train"][:n].astype(np.float32)
    extra = d["test"][:5000].astype(np.float32)
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-bench-http-"))
    lines = [
        f"Fashion-MNIST, {n:,} vectors, LMDB, `GET /neighbors?id=…&k=10` from a separate load process "
        f"(8 threads, keep-alive, {seconds:.0f} s per run).",
        "",
    ]
    try:
        numba.set_num_threads(2)
        with Index.open(work / "idx", IndexConfig(dim=784), maintain=False) as ix:
            for lo in range(0, n, 10_000):
                ix.upsert([str(i) for i in range(lo, min(n, lo + 10_000))], X[lo : lo + 10_000])
            ix.maintain()  # lists and tuning, as gmmlsh build ends (a server would do it in the background)
            numba.set_num_threads(1)
            ix.warm()
            rng = np.random.default_rng(0)
            ids = [str(i) for i in rng.integers(0, n, 500)]
            for i in ids[:20]:
                ix.query(id=i, k=10)
            t = time.perf_counter()
            for i in ids:
                ix.query(id=i, k=10)
            inproc = len(ids) / (time.perf_counter() - t)
        lines += ["| server | requests/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|"]
        rates = {}
        for workers in (1, 2):
            proc, url = serve(work / "idx", workers)
            try:
                r = load(url, n, seconds)
                rates[workers] = r["rps"]
                lines.append(
                    f"| {workers} worker(s) | {r['rps']:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
                    f"{r['errors']} of {r['requests']:,} |"
                )
                if workers == 2:
                    with httpx.Client(base_url=url, timeout=120) as c:
                        t = time.perf_counter()
                        for lo in range(0, extra.shape[0], 1000):
                            body = {
                                "vectors": [{"id": f"x{lo + j}", "values": extra[lo + j].tolist()} for j in range(1000)]
                            }
                            c.post("/vectors", json=body).raise_for_status()
                        post_rate = extra.shape[0] / (time.perf_counter() - t)
            finally:
                proc.terminate()
                proc.wait(30)
        lines += [
            "",
            f"- in-process `Index.query(id=…)`, one thread: {inproc:,.0f} queries/s; HTTP with 2 workers is "
            f"{rates[2] / inproc:.0%} of it (1 worker: {rates[1] / inproc:.0%})",
            f"- `POST /vectors`, batches of 1,000 (2 workers): {post_rate:,.0f} vectors/s",
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(lines, a.out)


if __name__ == "__main__":
    main()
