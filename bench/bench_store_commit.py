"""What one writer tick costs the LMDB store, against n: a 500-row upsert and its deletes.

The operation load's writer (``bench.operate_writer``) upserts 500 rows a tick, half of them
replacing live ids, and deletes 50 ids; each is one LMDB write transaction, synced at commit.
A replaced or deleted record's pages are scattered over the B-trees (its iid is anywhere in
``[0, n)``), so the commit writes one page per record per database it touches: the cost this
benchmark follows as n grows. Records are a shape's sizes (``--record``: fashion's dense
3,152-byte vector blob, or strokes' ~1,136-byte sparse one; the default sketch; a 7-byte id) of
random bytes: the store never looks inside them.

    python -m bench.bench_store_commit --sizes 100000,1000000 --record fashion|strokes [--ticks 100] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import emit
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.store.base import RecordBatch
from gmmlsh.index.store.lmdb import LmdbStore

VECTOR_BYTES = {"fashion": 3152, "strokes": 1136}
SKETCH_BYTES = IndexConfig(dim=784).sketch_bytes  # the default sketch
UPSERT, REPLACED, DELETED = 500, 250, 50


def records(ids: list[str], vector_bytes: int, rng: np.random.Generator) -> RecordBatch:
    blobs = rng.integers(0, 256, (len(ids), vector_bytes), dtype=np.uint8)
    return RecordBatch(ids=ids, vectors=[b.tobytes() for b in blobs],
                       sketches=rng.integers(0, 256, (len(ids), SKETCH_BYTES), dtype=np.uint8))


def fill(store: LmdbStore, n: int, vector_bytes: int, rng: np.random.Generator) -> float:
    t = time.perf_counter()
    for a in range(0, n, 10_000):
        store.write(records([f"r{i}" for i in range(a, min(n, a + 10_000))], vector_bytes, rng))
    return time.perf_counter() - t


def ticks(store: LmdbStore, n: int, count: int, vector_bytes: int, rng: np.random.Generator
          ) -> tuple[list[float], list[float]]:
    """``count`` writer ticks on a store of ids ``r0 … r{n-1}``: the seconds of each upsert and
    of each delete."""
    live = list(range(n))
    fresh = n
    ups, dels = [], []
    for _ in range(count):
        pick = rng.choice(len(live), REPLACED + DELETED, replace=False)
        replaced = [live[p] for p in pick[:REPLACED]]
        ids = [f"r{i}" for i in replaced] + [f"r{i}" for i in range(fresh, fresh + UPSERT - REPLACED)]
        batch = records(ids, vector_bytes, rng)
        t = time.perf_counter()
        store.write(batch)
        ups.append(time.perf_counter() - t)
        gone = [f"r{live[p]}" for p in pick[REPLACED:]]
        t = time.perf_counter()
        store.delete(gone)
        dels.append(time.perf_counter() - t)
        for p in sorted(pick[REPLACED:].tolist(), reverse=True):
            live[p] = live[-1]
            live.pop()
        live += range(fresh, fresh + UPSERT - REPLACED)
        fresh += UPSERT - REPLACED
    return ups, dels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,1000000", help="stored rows before the ticks, comma-separated")
    p.add_argument("--record", choices=sorted(VECTOR_BYTES), default="fashion")
    p.add_argument("--ticks", type=int, default=100)
    p.add_argument("--dir", type=Path, default=None, help="where the stores go (on the disk indexes use)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    vector_bytes = VECTOR_BYTES[a.record]
    lines = [f"{a.record} records ({vector_bytes}-byte vector, {SKETCH_BYTES}-byte sketch); a tick: "
             f"{UPSERT}-row upsert ({REPLACED} replacing), then {DELETED} deletes; {a.ticks} ticks", "",
             "| n | fill (rows/s) | upsert p50 ms | p90 | max | delete p50 ms | p90 | max | data.mdb GB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in (int(s) for s in a.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix="store-commit-", dir=a.dir))
        try:
            rng = np.random.default_rng(n)
            with LmdbStore(root / "lmdb") as store:
                filled = fill(store, n, vector_bytes, rng)
                ups, dels = ticks(store, n, a.ticks, vector_bytes, rng)
            size = (root / "lmdb" / "data.mdb").stat().st_size / 1e9
        finally:
            shutil.rmtree(root)
        u, d = np.percentile(ups, [50, 90]) * 1e3, np.percentile(dels, [50, 90]) * 1e3
        lines.append(f"| {n:,} | {n / filled:,.0f} | {u[0]:.1f} | {u[1]:.1f} | {max(ups) * 1e3:.1f} | "
                     f"{d[0]:.1f} | {d[1]:.1f} | {max(dels) * 1e3:.1f} | {size:.2f} |")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
