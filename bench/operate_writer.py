"""The writer of ``bench_operate``: upserts and deletes at a fixed pace, in its own process.

Every ``period = batch / write_rate`` seconds (0.25 s at the defaults) a *tick* is due:
one upsert of ``batch`` rows — a share ``replace_share`` of them replacing ids stored
now, the rest new ids — then the deletion of the tick's share of ``delete_rate`` ids
stored now. The ids are row numbers as ``gmmlsh build`` gives them ("0", "1", …; new
ids go on from ``n``); the vectors are the shape's rows after the first ``n`` (the
zoo's grown rows, each used once), so that the data a vector holds is known by its row.

What is written is decided by :class:`WritePlan` from a seed alone, in order, so the
writer knows what the store holds at the end without reading it back (the id → row
map saved beside the result; ``bench_operate`` checks a sample against the store).
A failed write is retried until it is acknowledged (upserts and deletes are
idempotent), so the plan and the store never part.

The writer keeps to its schedule: a tick starts when it is due, or at once when the
writer is late; its *lag* is how late it started. It never runs ahead to make up.

    python -c "from bench.operate_writer import main; main()" \
        --shape fashion --n 100000 --rows 240500 --index DIR --result FILE
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench.operate_proc import ready, wait_until
from bench.zoo import SHAPES
from gmmlsh.client import ARROW, arrow_body
from gmmlsh.index.store.location import DEFAULT_PREFIX

#: How long a write is retried before the writer gives up.
RETRY_SECONDS = 60.0


class WritePlan:
    """What each tick writes, decided from a seed; tracks which row each id holds."""

    def __init__(self, n: int, rows: int, batch: int, replace_share: float, deletes_per_s: float, period: float,
                 seed: int):
        self.batch, self.replace = batch, int(round(batch * replace_share))
        self.deletes_per_tick = deletes_per_s * period
        #: ``source[id]``: the data row the id holds, or −1 (never written, or deleted)
        self.source = np.full(n + rows, -1, np.int64)
        self.source[:n] = np.arange(n)
        self._alive = np.arange(n + rows, dtype=np.int64)  # ids stored: the first `live` entries
        self._where = np.arange(n + rows, dtype=np.int64)  # position of each id in _alive
        self.live = n
        self.next_id = n
        self.next_row = n
        self.rows_end = n + rows
        self.ticks = 0
        self.rng = np.random.default_rng([seed, 30])

    def _pick(self, count: int) -> np.ndarray:
        return self._alive[self.rng.choice(self.live, size=min(count, self.live), replace=False)]

    def _add(self, ids: np.ndarray) -> None:
        for i in ids.tolist():  # swapped in at position `live`
            p, other = self._where[i], self._alive[self.live]
            self._alive[self.live], self._alive[p] = i, other
            self._where[i], self._where[other] = self.live, p
            self.live += 1

    def _remove(self, ids: np.ndarray) -> None:
        for i in ids.tolist():
            p, last = self._where[i], self._alive[self.live - 1]
            self._alive[p], self._alive[self.live - 1] = last, i
            self._where[last], self._where[i] = p, self.live - 1
            self.live -= 1

    def next(self) -> tuple[np.ndarray, int, np.ndarray]:
        """The next tick: (ids upserted, the first of their consecutive data rows, ids deleted)."""
        if self.next_row + self.batch > self.rows_end:
            raise RuntimeError("the writer ran out of data rows: give it more (--rows)")
        replaced = self._pick(self.replace)
        new = np.arange(self.next_id, self.next_id + self.batch - replaced.shape[0])
        self.next_id += new.shape[0]
        self._add(new)
        ids = np.concatenate([replaced, new])
        lo = self.next_row
        self.source[ids] = np.arange(lo, lo + ids.shape[0])
        self.next_row += ids.shape[0]
        due = int((self.ticks + 1) * self.deletes_per_tick) - int(self.ticks * self.deletes_per_tick)
        deleted = self._pick(due)
        self._remove(deleted)
        self.source[deleted] = -1
        self.ticks += 1
        return ids, lo, deleted


class ApiSink:
    """Writes through the Python API of an index opened in this process (no upkeep here)."""

    def __init__(self, location: str, prefix: str, cache_dir: str | None):
        from gmmlsh.index.compile import compile_kernels
        from gmmlsh.index.index import Index

        compile_kernels()  # loaded before the clock starts, on throwaway indexes
        self.ix = Index.open(location, prefix=prefix, cache_dir=cache_dir, maintain=False)

    def upsert(self, ids: list[str], X) -> None:
        self.ix.upsert(ids, X)

    def delete(self, ids: list[str]) -> None:
        self.ix.delete(ids)


class HttpSink:
    """Writes over the REST API: ``POST /vectors`` for a batch, ``DELETE /vectors/{id}`` for each
    deletion (over a few keep-alive connections at once), or ``POST /delete`` with ``each=False``."""

    def __init__(self, url: str, each: bool = True, connections: int = 4):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=connections + 1))
        self.each = each
        self.pool = ThreadPoolExecutor(connections)

    def _ok(self, r, allowed=(200,)) -> None:
        if r.status_code not in allowed:
            raise RuntimeError(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:200]}")

    def upsert(self, ids: list[str], X) -> None:
        # The API's Arrow body (what gmmlsh.Client sends for a batch): no decimal text to parse.
        self._ok(self.client.post("/vectors", content=arrow_body(ids, X), headers={"content-type": ARROW}))

    def delete(self, ids: list[str]) -> None:
        if not self.each:
            self._ok(self.client.post("/delete", json={"ids": ids}))
            return
        # 404: deleted already (a retry after a lost answer); the plan only deletes stored ids
        list(self.pool.map(lambda i: self._ok(self.client.delete(f"/vectors/{i}"), (200, 404)), ids))


def _retry(op: Callable[[], None], what: str, errors: list) -> None:
    """Run ``op`` until it succeeds; each failure is recorded (time, what, why)."""
    give_up = time.monotonic() + RETRY_SECONDS
    while True:
        try:
            op()
            return
        except Exception as exc:  # noqa: BLE001 - any failure is recorded and retried
            errors.append((time.monotonic(), what, str(exc)[:300]))
            if time.monotonic() > give_up:
                raise
            time.sleep(0.2)


def run(plan: WritePlan, sink, rows_of: Callable[[int, int], object], period: float, t0: float, t_end: float
        ) -> dict:
    """Ticks from ``t0`` until ``t_end``, each when due (or at once when late)."""
    ticks, errors = [], []
    wait_until(t0)
    i, warned = 0, -math.inf
    while (due := t0 + i * period) < t_end and time.monotonic() < t_end:
        wait_until(due)
        start = time.monotonic()
        if start - due > period and start - warned > 10.0:  # said as it happens (the log), not only at the end
            print(f"writer: {start - due:.2f} s behind at {start - t0:.1f} s", file=sys.stderr, flush=True)
            warned = start
        ids, lo, deleted = plan.next()
        X = rows_of(lo, lo + ids.shape[0])
        _retry(partial(sink.upsert, [str(v) for v in ids.tolist()], X), f"upsert tick {i}", errors)
        upserted = time.monotonic()
        if deleted.shape[0]:
            _retry(partial(sink.delete, [str(v) for v in deleted.tolist()]), f"delete tick {i}", errors)
        ticks.append((due, start, upserted, time.monotonic(), ids.shape[0], deleted.shape[0]))
        i += 1
    return {"ticks": ticks, "errors": errors, "live": plan.live, "next_id": plan.next_id,
            "rows_used": plan.next_row, "period": period}


def writer_rows(shape, n: int, rows: int) -> Callable[[int, int], object]:
    """``rows_of(lo, hi)``: data rows ``lo … hi − 1`` (``n ≤ lo``) of the shape grown to ``n + rows``."""
    X = shape.data(n + rows)
    if sp.issparse(X):
        X = X[n:].tocsr()  # the rows the writer uses; the index's own are not needed here
        return lambda lo, hi: X[lo - n:hi - n]
    return lambda lo, hi: np.ascontiguousarray(X[lo:hi])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--n", type=int, required=True, help="rows the index was built with (ids 0 … n−1)")
    p.add_argument("--rows", type=int, required=True, help="data rows the writer may use after the first n")
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--write-rate", type=float, default=2000.0, help="rows upserted a second")
    p.add_argument("--delete-rate", type=float, default=200.0, help="ids deleted a second")
    p.add_argument("--replace-share", type=float, default=0.5, help="share of each batch replacing stored ids")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--index", help="LMDB index directory (Python API)")
    g.add_argument("--redis", help="Redis URL (Python API)")
    g.add_argument("--url", help="base URL of a gmmlsh server (REST API)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--cache-dir")
    p.add_argument("--http-delete", choices=("each", "batch"), default="each")
    p.add_argument("--result", type=Path, required=True)
    a = p.parse_args(argv)
    shape = SHAPES[a.shape]
    rows_of = writer_rows(shape, a.n, a.rows)
    period = a.batch / a.write_rate
    plan = WritePlan(a.n, a.rows, a.batch, a.replace_share, a.delete_rate, period, a.seed)
    if a.url:
        sink = HttpSink(a.url, each=a.http_delete == "each")
    else:
        sink = ApiSink(a.index or a.redis, a.prefix, a.cache_dir)
    first = rows_of(a.n, a.n + a.batch)  # paged in before the clock
    if isinstance(sink, ApiSink):
        sink.ix.prepare(["start-up"], first[:1])  # hashes one row, writes nothing: the process's tables made
    t0, t_end = ready()
    out = run(plan, sink, rows_of, period, t0, t_end)
    np.save(a.result.with_suffix(".source.npy"), plan.source[:plan.next_id])
    a.result.write_text(json.dumps(out))

