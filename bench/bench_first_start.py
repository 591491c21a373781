"""What a fresh install's first run costs: the quick start's two commands on an empty numba cache,
then again with the cache they left (issue 33, acceptance 5).

    python -m bench.bench_first_start [--workdir DIR] [--out bench/out/first-start.md]

Each round: ``gmmlsh build`` of Fashion-MNIST's 60,000 training rows into a new LMDB index, timed
as a command, then ``gmmlsh serve`` of it, timed from its start to the first ``GET /health`` that
answers 200 (the worker has mapped the index and compiled or loaded its query kernels). The
first round runs on an empty ``NUMBA_CACHE_DIR`` (a machine that never compiled), the second
on the cache the first left, into a second index; the difference is what compiling costs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import DATA, build_index, emit, free_port, wait_healthy


def serve_until_healthy(index: Path, env: dict) -> float:
    """Seconds from starting ``gmmlsh serve`` on ``index`` to its first ``/health`` 200."""
    port = free_port()
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.cli", "serve", "--index", str(index),
                             "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        return time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path,
                    help="where the indexes and the numba cache go (default: a temporary directory)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    src = DATA / "fashion-mnist.npz"
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        os.environ["NUMBA_CACHE_DIR"] = str(work / "numba")  # the commands' cache, not this process's
        env = {**os.environ, "GMMLSH_ACCESS_LOG": "false", "GMMLSH_LOG_LEVEL": "warning"}
        rounds = []
        for name in ("fresh cache", "cache warm"):
            index = work / f"index-{len(rounds)}"
            built = build_index(src, ["--index", str(index)], "--npz-key", "train", "--npz-label-key", "train_labels")
            rounds.append((name, built["command_seconds"], serve_until_healthy(index, env)))
            print(f"{name}: build {rounds[-1][1]:.1f} s, serve until /health 200 {rounds[-1][2]:.1f} s",
                  file=sys.stderr, flush=True)
    (_, b0, s0), (_, b1, s1) = rounds
    emit([f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs", "",
          "| | fresh cache | cache warm | compiling |", "|---|---:|---:|---:|",
          f"| `gmmlsh build` (60,000 Fashion-MNIST rows, lists and tuning included) | {b0:.1f} s | {b1:.1f} s "
          f"| {b0 - b1:.1f} s |",
          f"| `gmmlsh serve` until `/health` 200 | {s0:.1f} s | {s1:.1f} s | {s0 - s1:.1f} s |",
          f"| **together** | {b0 + s0:.1f} s | {b1 + s1:.1f} s | **{b0 + s0 - b1 - s1:.1f} s** |"], args.out)


if __name__ == "__main__":
    main()
