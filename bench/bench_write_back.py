"""Small LMDB commits of another process while upkeep puts a fit's gigabytes on the disk.

A process commits LMDB transactions of 300 random 1 kB values (the kind of commit a 500-row
upsert makes) every 50 ms; meanwhile this one fills ``--gib`` of a file through a mapping, as
upkeep fills a fit's arenas, and puts it on the disk either with one ``fsync`` (as checkpoints
did) or with :func:`gmmlsh.index.columns.make_durable` (written back 8 MiB at a time, then
``fsync``). Reported: the commits' latency before and during the flush, and the flush's time,
for each way, ``--rounds`` times alternating.

    python -m bench.bench_write_back [--gib 2] [--rounds 3] [--dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from bench.common import emit
from gmmlsh.index.columns import make_durable

KEYS = 200_000


def _committer(directory: str, stop, out) -> None:
    env = lmdb.open(directory, map_size=1 << 34, max_dbs=2)
    db = env.open_db(b"x")
    with env.begin(write=True) as txn:
        for i in range(KEYS):
            txn.put(i.to_bytes(4, "big"), b"x" * 1000, db=db)
    rng = np.random.default_rng(0)
    times = []
    out.put("ready")
    while not stop.is_set():
        t = time.monotonic()
        with env.begin(write=True) as txn:
            for k in rng.choice(KEYS, 300, replace=False).tolist():
                txn.put(k.to_bytes(4, "big"), b"y" * 1000, db=db)
        times.append((t, time.monotonic() - t))
        time.sleep(0.05)
    out.put(times)


def _flush(path: Path, size: int, way: str) -> tuple[float, float]:
    """Fill ``size`` bytes of ``path`` through a mapping, then put them on disk ``way``; returns
    (start, seconds) of the flush."""
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, size) as m:
            np.frombuffer(m, dtype=np.uint8)[:] = 7
        time.sleep(1.0)
        t = time.monotonic()
        if way == "fsync":
            os.fsync(fd)
        else:
            make_durable(path)
        return t, time.monotonic() - t
    finally:
        os.close(fd)
        path.unlink()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB filled and flushed a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, help="where the files go (default: a temporary directory)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-write-back-", dir=a.dir))
    rows = []
    try:
        for r in range(a.rounds):
            for way in ("fsync", "write back"):
                stop, out = mp.Event(), mp.Queue()
                shutil.rmtree(work / "db", ignore_errors=True)
                proc = mp.Process(target=_committer, args=(str(work / "db"), stop, out))
                proc.start()
                out.get()
                time.sleep(2.0)
                t, took = _flush(work / "big", int(a.gib * (1 << 30)), way)
                time.sleep(1.0)
                stop.set()
                times = np.asarray(out.get())
                proc.join()
                before = times[times[:, 0] < t - 1.0][:, 1] * 1e3
                during = times[(times[:, 0] >= t) & (times[:, 0] < t + took)][:, 1] * 1e3
                rows.append(f"| {r + 1} | {way} | {took:.2f} | {np.median(before):.1f} | {during.size} | "
                            f"{np.median(during):.1f} | {during.max():.1f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit([f"    python -m bench.bench_write_back --gib {a.gib:g} --rounds {a.rounds}", "",
          "| round | flush | seconds | commit p50 before (ms) | commits during | p50 during (ms) | max during (ms) |",
          "|---:|---|---:|---:|---:|---:|---:|", *rows], a.out)


if __name__ == "__main__":
    main()
