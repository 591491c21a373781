"""What every benchmark script shares: the data, recall, a throwaway redis-server, output."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numba import njit

from gmmlsh.index.store.location import DEFAULT_PREFIX, is_redis

DATA = Path(os.environ.get("GMMLSH_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def recall_at(found: list[set[int]], truth: np.ndarray) -> float:
    """Mean share of each query's true neighbours among those found."""
    return float(np.mean([len(f & set(t.tolist())) / truth.shape[1] for f, t in zip(found, truth, strict=True)]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A redis-server on loopback (``port``, or a free one), persistence off; returns (process, URL)."""
    import redis

    port = port or free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # a pipe held open by the server would outlive the caller
    )
    r = redis.Redis(port=port)
    for _ in range(100):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's, from /proc; none once it has exited)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def emit(lines: list[str], out: Path | None) -> str:
    """Print a markdown report and, with ``--out``, write it there too."""
    text = "\n".join(lines)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text


@njit(fastmath=True, cache=True)
def gmm_distance(x, y):
    """1 − GMM, the metric pynndescent is given (its metrics are distances)."""
    s = 0.0
    nx = 0.0
    ny = 0.0
    for i in range(x.shape[0]):
        a = x[i]
        b = y[i]
        s += max(min(a, b), 0.0) - min(max(a, b), 0.0)
        nx += abs(a)
        ny += abs(b)
    return 1.0 - s / (nx + ny - s)


def store_args(location: Path | str, prefix: str | None = None, cache_dir: Path | str | None = None) -> list[str]:
    """The command-line options naming an index: ``--index DIR``, or ``--redis URL --prefix P [--cache-dir D]``."""
    if not is_redis(location):
        return ["--index", str(location)]
    return ["--redis", str(location), "--prefix", prefix or DEFAULT_PREFIX,
            *(["--cache-dir", str(cache_dir)] if cache_dir else [])]


def build_index(src: Path | str, where: list[str], *extra: str) -> dict:
    """``gmmlsh build SRC`` into ``where`` (see :func:`store_args`), timed as a command (process
    start included); returns its JSON summary with ``command_seconds``."""
    cmd = [sys.executable, "-m", "gmmlsh.service.cli", "build", str(src), *where, "--no-progress", "--json", *extra]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)
    summary["command_seconds"] = time.perf_counter() - t
    return summary


def serve(index_dir: Path | str, workers: int = 1, env: dict | None = None, *, prefix: str | None = None,
          cache_dir: Path | str | None = None, log: int | None = None) -> tuple[subprocess.Popen, str]:
    """``gmmlsh serve`` on a free loopback port, once it answers /health and its workers have
    mapped the mirror in; returns (process, base URL). ``index_dir``: an LMDB directory or a
    Redis URL (with ``prefix``, ``cache_dir``); ``env``: extra environment (e.g. GMMLSH_DIM);
    ``log``: where the server's standard error goes (e.g. ``subprocess.PIPE``; default: nowhere)."""

    port = free_port()
    env = {**os.environ, "GMMLSH_ACCESS_LOG": "false", "GMMLSH_LOG_LEVEL": "warning", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.cli", "serve",
                             *store_args(index_dir, prefix, cache_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if log is None else log,
                            text=log is not None)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    time.sleep(2.0)  # every worker brings its mirror up to date and maps it in, in the background
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 600.0) -> None:
    """Until the server at ``url`` answers ``GET /health`` with 200 (polled every 50 ms); raises if
    its process exits first or ``seconds`` pass."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"gmmlsh serve exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"gmmlsh serve at {url} not healthy after {seconds:.0f} s")


def data_main(doc: str, make: Callable[[int], object], truth: Callable[[int, int], object], path: Callable[[int], Path],
              queries: int) -> None:
    """The command line of a data generator: write the first N rows and their truth, print where."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n", type=int)
    p.add_argument("--queries", type=int, default=queries)
    a = p.parse_args()
    make(a.n)
    truth(a.n, a.queries)
    print(path(a.n))
