"""HTTP benchmark: a real `gmmlsh serve` under load from a separate process, beside the engine.

    python -m bench.bench_http [--sizes 60000,1000000] [--seconds 5] [--baseline PYTHON] [--out FILE]

For each size, an LMDB index of Fashion-MNIST (grown by :mod:`bench.scale_data` past 60,000)
is built with ``gmmlsh build`` (kept in ``--index-dir`` for the next run), and measured:

* in process, one thread: ``Index.query(id=…)``, ``Index.query(vector)`` and
  ``Index.query_batch`` of 100 held-out queries (numba on every core): queries/s and CPU
  per query;
* served with 1 and 2 uvicorn workers, each row driven for ``--seconds`` by the same load
  generator (:mod:`bench.loadgen`: a separate process, ``--connections`` keep-alive
  connections, one request in flight on each): ``GET /ping`` (the floor: a constant on the
  same server stack), ``GET /neighbors?id=``, ``POST /neighbors/search`` with one dense
  query as JSON and as the binary body, and batches of 100 queries as JSON
  (``{"queries": [...]}``) and binary; then upserts of 500 rows (held-out images under ids of
  their own, replaced over and over, deleted at the end) as JSON and as the Arrow body:
  requests/s, queries (or rows)/s, p50/p99 latency, and the server's CPU time per request
  (every process of the server; the load generator excluded).

*Over the floor* is a row's server CPU per request less the floor's; *HTTP adds* is that
less the in-process CPU of the same query: what serving costs beyond the query itself.
``--baseline PYTHON`` also serves another installation (e.g. a virtual environment of the
release an issue was measured on) for before/after rows in the same run: the same data, built
and tuned the same way by that installation's own code into an index of its own (kept beside
this one); its rows are the routes it has. On a 2-core machine the load generator shares the CPU with
the server: compare rows of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench import scale_data
from bench.common import children, emit, free_port
from bench.loadgen import request_bytes, write_requests
from gmmlsh.client import ARROW, arrow_body
from gmmlsh.core import parallel
from gmmlsh.index.index import Index

BATCH = 100
NQ = 1000  # held-out queries (test images), sent in turn
#: Rows an upsert request holds (the operation benchmark's batch), and their ids.
UPSERT = 500
UPSERT_IDS = [f"bench-http-{j}" for j in range(UPSERT)]


#: Tunes an index on held-out test images 5,000-5,255 (not the measured queries), run by the
#: installation that built it: ``python -c TUNE INDEX FASHION_NPZ``.
TUNE = """import sys, numpy as np
from gmmlsh.index.index import Index
tune = np.load(sys.argv[2])["test"][5000:5256].astype(np.float32)
with Index.open(sys.argv[1], create=False, maintain=False) as ix:
    ix.maintain(queries=tune)
"""


def build(n: int, where: Path, python: str = sys.executable, name: str = "fmnist") -> Path:
    """``gmmlsh build`` of the first ``n`` rows into ``where/NAME-n`` (kept: built once) by the
    installation of ``python`` (a baseline serves an index of its own format), tuned on held-out
    queries other than the measured ones: a server re-tunes an index tuned on stored vectors
    once it has served 128 queries, and that must not land inside a row."""
    index = where / f"{name}-{n}"
    if not (index / "data.mdb").exists():
        scale_data.data(n)
        subprocess.run([python, "-m", "gmmlsh.service.cli", "build", str(scale_data.data_path(n)),
                        "--index", str(index), "--no-progress"], check=True, cwd=tempfile.gettempdir())
        subprocess.run([python, "-c", TUNE, str(index), str(scale_data.DATA / "fashion-mnist.npz")], check=True,
                       cwd=tempfile.gettempdir())
    return index


def in_process(index: Path, Q: np.ndarray, n: int) -> dict[str, tuple[float, float]]:
    """(queries/s, CPU ms a query) of the index's calls, one thread."""
    out = {}
    rng = np.random.default_rng(0)
    ids = [str(i) for i in rng.integers(0, n, len(Q))]
    with Index.open(index, create=False, maintain=False) as ix:
        ix.warm()
        threads = parallel.threads()
        parallel.set_threads(1)  # one query at a time runs serial kernels anyway; the lane runs them too
        calls = {"id": lambda: [ix.query(id=i, k=10) for i in ids],
                 "vector": lambda: [ix.query(q, k=10) for q in Q]}
        for name, call in calls.items():
            call()
            out[name] = _timed(call, len(Q))
        parallel.set_threads(threads)
        batch = lambda: [ix.query_batch(Q[lo:lo + BATCH], k=10) for lo in range(0, len(Q), BATCH)]  # noqa: E731
        batch()
        out["batch"] = _timed(batch, len(Q))
    return out


def _timed(call, count: int) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    call()
    return count / (time.perf_counter() - t0), (time.process_time() - c0) / count * 1e3


def requests(n: int, Q: np.ndarray, work: Path) -> dict[str, tuple[Path, int]]:
    """Each row's requests (written once, sent in turn) and the queries one request holds."""
    rng = np.random.default_rng(1)
    raw = Q.astype("<f4")
    octets = "application/octet-stream"
    rows = {
        "floor: GET /ping": ([request_bytes("GET", "/ping")], 1),
        "GET /neighbors?id=": ([request_bytes("GET", f"/neighbors?id={i}&k=10") for i in rng.integers(0, n, NQ)], 1),
        "POST one dense query, JSON": ([request_bytes("POST", "/neighbors/search", orjson.dumps(
            {"values": q, "k": 10}, option=orjson.OPT_SERIALIZE_NUMPY), "application/json") for q in Q], 1),
        "POST one dense query, binary": ([request_bytes("POST", "/neighbors/search?k=10", q.tobytes(), octets)
                                          for q in raw], 1),
        f"POST {BATCH} queries, JSON": ([request_bytes("POST", "/neighbors/search", orjson.dumps(
            {"k": 10, "queries": [{"values": q} for q in Q[lo:lo + BATCH]]}, option=orjson.OPT_SERIALIZE_NUMPY),
            "application/json") for lo in range(0, NQ, BATCH)], BATCH),
        f"POST {BATCH} queries, binary": ([request_bytes("POST", "/neighbors/search?k=10",
                                                         raw[lo:lo + BATCH].tobytes(), octets)
                                           for lo in range(0, NQ, BATCH)], BATCH),
        f"POST /vectors, {UPSERT} rows, JSON": ([request_bytes("POST", "/vectors", orjson.dumps(
            {"vectors": [{"id": i, "values": q} for i, q in zip(UPSERT_IDS, raw[:UPSERT], strict=True)]},
            option=orjson.OPT_SERIALIZE_NUMPY), "application/json")], UPSERT),
        f"POST /vectors, {UPSERT} rows, Arrow": ([request_bytes("POST", "/vectors",
                                                               arrow_body(UPSERT_IDS, raw[:UPSERT]), ARROW)], UPSERT),
    }
    out = {}
    for i, (name, (reqs, per)) in enumerate(rows.items()):
        out[name] = (write_requests(work / f"requests-{i}.pickle", reqs), per)
    return out


#: Rows a baseline server (an earlier release, without /ping or binary bodies) can answer.
BASELINE_ROWS = ("GET /neighbors?id=", "POST one dense query, JSON", f"POST {BATCH} queries, JSON")


def serve(python: str, index: Path, workers: int) -> tuple[subprocess.Popen, int]:
    """``gmmlsh serve`` with ``python``, once it answers /health and its workers have mapped the index."""
    port = free_port()
    env = {**os.environ, "GMMLSH_ACCESS_LOG": "false", "GMMLSH_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([python, "-m", "gmmlsh.service.cli", "serve", "--index", str(index), "--port", str(port),
                             "--workers", str(workers)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    for _ in range(6000):
        if proc.poll() is not None:
            raise RuntimeError(f"gmmlsh serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    time.sleep(3.0)  # each worker maps the mirror in, in the background
    return proc, port


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants, from /proc."""
    total = 0.0
    stack = [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        stack += children(p)
    return total


def drive(proc: subprocess.Popen, port: int, reqs: Path, seconds: float, connections: int) -> dict:
    """One row: the load generator against the server; its figures and the server's CPU."""
    result = reqs.with_suffix(".json")
    cpu0 = _tree_cpu(proc.pid)
    subprocess.run([sys.executable, "-m", "bench.loadgen", "127.0.0.1", str(port), str(reqs), "--seconds",
                    str(seconds), "--connections", str(connections), "--out", str(result)],
                   check=True, cwd=Path(__file__).resolve().parents[1])
    cpu = _tree_cpu(proc.pid) - cpu0
    r = json.loads(result.read_text())
    lat = np.array(r["lat"])
    return {"rps": r["n"] / r["seconds"], "p50": np.percentile(lat, 50) * 1e3, "p99": np.percentile(lat, 99) * 1e3,
            "cpu": cpu / max(r["n"], 1) * 1e3, "errors": r["errors"], "n": r["n"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="60000", help="index sizes, comma-separated (e.g. 60000,1000000)")
    ap.add_argument("--workers", default="1,2", help="server worker counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=5.0, help="load per row")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--index-dir", type=Path, default=scale_data.CACHE / "http",
                    help="where the indexes are built (and kept for the next run)")
    ap.add_argument("--baseline", help="another installation's python, served beside this one")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    Q = scale_data.queries(NQ)
    workers = [int(w) for w in a.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-bench-http-"))
    lines = [f"LMDB, {NQ:,} held-out queries sent in turn, k=10; the load generator (`bench/loadgen.py`) in its "
             f"own process, {a.connections} keep-alive connections, {a.seconds:g} s a row; server CPU: every "
             "process of the server, per request.", ""]
    try:
        for n in (int(s) for s in a.sizes.split(",")):
            index = build(n, a.index_dir)
            local = in_process(index, Q, n)
            rows = requests(n, Q, work)
            lines += [f"### {n:,} vectors", "",
                      f"In process, one thread: `query(id=…)` {local['id'][0]:,.0f} queries/s "
                      f"({local['id'][1]:.3f} ms CPU a query), `query(vector)` {local['vector'][0]:,.0f}/s "
                      f"({local['vector'][1]:.3f} ms), `query_batch` of {BATCH} (numba on every core) "
                      f"{local['batch'][0]:,.0f} queries/s.", "",
                      "| server | row | requests/s | queries/s | p50 ms | p99 ms | server CPU ms/request | "
                      "over the floor | HTTP adds | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
            servers = [("gmmlsh", sys.executable, index)]
            if a.baseline:
                servers.append(("baseline", a.baseline, build(n, a.index_dir, a.baseline, "baseline-fmnist")))
            for w in workers:
                for label, python, served in servers:
                    proc, port = serve(python, served, w)
                    try:
                        floor = None
                        for name, (reqs, per) in rows.items():
                            if label == "baseline" and name not in BASELINE_ROWS:
                                continue
                            r = drive(proc, port, reqs, a.seconds, a.connections)
                            if name.startswith("floor"):
                                floor = r["cpu"]
                            over = r["cpu"] - floor if floor is not None and per == 1 else None
                            key = None if name.startswith("floor") else "id" if "id=" in name else \
                                "vector" if per == 1 else None
                            adds = over - local[key][1] if over is not None and key else None
                            lines.append(
                                f"| {label}, {w} worker{'s' * (w > 1)} | {name} | {r['rps']:,.0f} | "
                                f"{r['rps'] * per:,.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['cpu']:.3f} | "
                                + (f"{over:.3f}" if over is not None and not name.startswith("floor") else "")
                                + " | " + (f"{adds:.3f}" if adds is not None else "")
                                + f" | {r['errors']} of {r['n']:,} |")
                    finally:
                        if label == "gmmlsh":  # the index is kept for the next run as it was built
                            httpx.post(f"http://127.0.0.1:{port}/delete", json={"ids": UPSERT_IDS}, timeout=60)
                        proc.terminate()
                        proc.wait(60)
            lines.append("")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines += ["Command: `python -m bench.bench_http " + " ".join(argv if argv is not None else sys.argv[1:]) + "`"]
    emit(lines, a.out)


if __name__ == "__main__":
    main()
