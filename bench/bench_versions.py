"""Before/after: the same build, query and insert measurements on this checkout and on an
older commit, alternating, in one run.

    python -m bench.bench_versions OLD_COMMIT [--n 60000] [--rounds 3] [--out bench/out/versions.md]

The older commit is checked out in a temporary git worktree with its own virtualenv
(``pip install -e``). Each version first builds once untimed (its first run compiles its
numba kernels into its cache). Then, for each version and round: ``gmmlsh build`` of the
first ``n`` rows of :mod:`bench.scale_data` into LMDB (whole command), then in a fresh
process: 1,000 test queries one per call on one thread with the index's defaults (recall@10
against exact GMM), and inserts of 5 batches of 1,000 new rows.
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

import numpy as np

from bench import scale_data
from bench.common import emit

ROOT = Path(__file__).resolve().parents[1]

# Runs inside each version's interpreter: only the API both versions share.
_MEASURE = r"""
import json, sys, time, numpy as np, numba
from gmmlsh.core import parallel
try:
    from gmmlsh import Index
except ImportError:
    from index.index import Index
path, data, truth, extra = sys.argv[1:5]
Q = np.load(data)["test"][:1000].astype(np.float32)
T = np.load(truth)
X = np.load(extra)
parallel.set_threads(1)
ix = Index.open(path)
for q in Q[:200]:
    ix.query(q, k=10)
time.sleep(2)  # background upkeep a server would run (where the version has any)
t = time.perf_counter()
res = [ix.query(q, k=10) for q in Q]
qps = len(Q) / (time.perf_counter() - t)
rec = float(np.mean([len({int(n.id) for n in r.neighbors} & set(T[i].tolist())) / 10 for i, r in enumerate(res)]))
parallel.set_threads(2)
t = time.perf_counter()
for b in range(5):
    ix.upsert([f"x{b}-{i}" for i in range(1000)], X[b * 1000:(b + 1) * 1000])
ins = 5000 / (time.perf_counter() - t)
print(json.dumps({"qps": qps, "recall": rec, "inserts": ins}))
"""


def _version(rev: str, work: Path) -> Path:
    """A worktree of ``rev`` with its own virtualenv; returns its python."""
    tree = work / f"tree-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", str(tree), rev], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
    subprocess.run([str(tree / ".venv/bin/pip"), "install", "-q", "-e", str(tree)], check=True)
    return tree / ".venv/bin/python"


def _build(python: Path, n: int, work: Path, name: str) -> tuple[Path, float]:
    """``gmmlsh build`` of the first ``n`` rows into a fresh index; (its directory, seconds)."""
    idx = work / f"idx-{name}"
    shutil.rmtree(idx, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([str(python.parent / "gmmlsh"), "build", str(scale_data.data_path(n)), "--index", str(idx),
                    "--no-progress"],
                   check=True, capture_output=True, cwd=work)
    return idx, time.perf_counter() - t


def _measure(python: Path, n: int, work: Path, name: str) -> dict:
    idx, build_s = _build(python, n, work, name)
    out = subprocess.run([str(python), "-c", _MEASURE, str(idx), str(scale_data.DATA / "fashion-mnist.npz"),
                          str(work / "truth.npy"), str(work / "extra.npy")],
                         check=True, capture_output=True, text=True, cwd=work)
    return {"build_s": build_s, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("--n", type=int, default=60_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-versions-"))
    try:
        scale_data.data(a.n)
        np.save(work / "truth.npy", scale_data.truth(a.n, 1000))
        np.save(work / "extra.npy", scale_data.extra(5000, a.n))
        pythons = {"old": _version(a.old, work), "new": Path(sys.executable)}
        for name, python in pythons.items():
            _build(python, a.n, work, name)  # compiles the version's kernels: not part of a build's time
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(a.rounds):
            for name, python in pythons.items():
                runs[name].append(_measure(python, a.n, work, name))
                print(name, runs[name][-1], flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / f"tree-{a.old}")],
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}
    L = [f"Fashion-MNIST, n = {a.n:,}, median of {a.rounds} alternating rounds; old = `{a.old}`, new = this checkout.",
         "", "| version | build (whole command) | queries/s (one per call) | recall@10 | inserts/s (batches of 1,000) "
         "|",
         "|---|---:|---:|---:|---:|"]
    for name in ("old", "new"):
        m = med[name]
        L.append(f"| {name} | {m['build_s']:.1f} s | {m['qps']:,.0f} | {m['recall']:.3f} | {m['inserts']:,.0f} |")
    L.append(f"| new ÷ old | {med['new']['build_s'] / med['old']['build_s']:.2f}× the time | "
             f"{med['new']['qps'] / med['old']['qps']:.2f}× | | {med['new']['inserts'] / med['old']['inserts']:.2f}× |")
    emit(L, a.out)


if __name__ == "__main__":
    main()
