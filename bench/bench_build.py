"""Batch build benchmark: `gmmlsh build` of Fashion-MNIST into LMDB and Redis, against
`POST /vectors` and pynndescent's build, in one run.

    python -m bench.bench_build [--quick] [--no-peer] [--out FILE]

Times the whole command (process start, numba cache load, reading the .npy,
hashing on all cores, writing) as a user sees it.
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

from bench.bench_http import start_server
from bench.common import DATA, emit, gmm_distance, start_redis


def cli_build(args: list[str]) -> tuple[float, dict]:
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "gmmlsh.service.cli", "build", *args, "--no-progress", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - t, json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10,000 vectors")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    n = 10_000 if a.quick else 60_000
    X = np.load(DATA / "fashion-mnist.npz")["train"][:n]
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-bench-build-"))
    redis_proc, url = start_redis(work)
    lines = [f"Fashion-MNIST train, {n:,} × 784 uint8 as `.npy`; default parameters; 2 cores.", ""]
    try:
        npy = work / "train.npy"
        np.save(npy, X)
        cli_build([str(npy), "--index", str(work / "warm")])  # numba's on-disk cache is filled by this run
        lm_s, lm = cli_build([str(npy), "--index", str(work / "lmdb")])
        rd_s, rd = cli_build([str(npy), "--redis", url, "--prefix", "build"])
        lines += [
            "| build | seconds (whole command) | vectors/s |",
            "|---|---|---|",
            f"| `gmmlsh build` → LMDB | {lm_s:.1f} | {n / lm_s:,.0f} |",
            f"| `gmmlsh build` → Redis | {rd_s:.1f} | {n / rd_s:,.0f} |",
        ]
        # The same vectors through the REST API, batches of 1,000, into a fresh index.
        shutil.copytree(work / "warm", work / "http")  # an index with the same parameters, 1 vector...
        proc, api = start_server(work / "http", 2)
        try:
            with httpx.Client(base_url=api, timeout=300) as c:
                t = time.perf_counter()
                for lo in range(0, n, 1000):
                    body = {"vectors": [{"id": f"h{i}", "values": X[i].tolist()} for i in range(lo, min(n, lo + 1000))]}
                    c.post("/vectors", json=body).raise_for_status()
                http_s = time.perf_counter() - t
        finally:
            proc.terminate()
            proc.wait(30)
        lines.append(f"| `POST /vectors` (batches of 1,000, 2 workers) | {http_s:.1f} | {n / http_s:,.0f} |")
        peer_s = None
        if not a.no_peer:
            from pynndescent import NNDescent

            Xf = X.astype(np.float32)
            numba.set_num_threads(2)
            NNDescent(Xf[:2000], metric=gmm_distance, n_neighbors=30, random_state=0).prepare()  # compile
            t = time.perf_counter()
            NNDescent(Xf, metric=gmm_distance, n_neighbors=30, random_state=0).prepare()
            peer_s = time.perf_counter() - t
            lines.append(
                f"| pynndescent warm build + prepare (2 threads, compiled) | {peer_s:.1f} | {n / peer_s:,.0f} |"
            )
        lines += ["", f"- `POST /vectors` takes {http_s / lm_s:.1f}× as long as the file build"]
        if peer_s:
            lines.append(f"- `gmmlsh build` → LMDB is {peer_s / lm_s:.1f}× faster than pynndescent's warm build")
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    emit(lines, a.out)


if __name__ == "__main__":
    main()
