"""The query load of ``bench_operate``: one thread asking one query per call, as fast as it can.

The queries are held-out rows of a zoo shape, asked round-robin with ``k = 10``. Each
call is timed on its own (``time.perf_counter``) and its start noted (``time.monotonic``,
the clock every process of the run shares), so latencies can be set beside what the
writer and the index's upkeep were doing at that moment.

In process, :func:`loop` calls ``Index.query``. Over HTTP this module runs as its own
process (the client must not share the server's interpreter, nor the harness's) and
posts each query to ``POST /neighbors/search`` on one keep-alive connection
(``bench_operate`` starts it; by hand:)

    python -c "from bench.operate_query import main; main()" \
        --url URL --shape fashion --offset 1000 --count 2000 --result FILE
"""

from __future__ import annotations

import argparse
import json
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench.operate_proc import ready, wait_until
from bench.zoo import SHAPES

#: Queries sent over the client's connection before the load: the worker serving that
#: connection loads numba's kernels on its first queries (seconds), which is start-up, not upkeep.
PREFLIGHT = 16


def query_rows(Q) -> list:
    """Queries as ``Index.query`` takes them, cut before the clock starts: dense rows, or
    ``(indices, values)`` pairs (scipy's row slicing is the harness's cost, not the search's)."""
    if sp.issparse(Q):
        Q = sp.csr_matrix(Q)
        return [(Q.indices[Q.indptr[i]:Q.indptr[i + 1]], Q.data[Q.indptr[i]:Q.indptr[i + 1]])
                for i in range(Q.shape[0])]
    return [np.ascontiguousarray(q, dtype=np.float32) for q in Q]


def loop(ask: Callable[[int], None], count: int, t0: float, t_end: float,
         after: Callable[[int], None] | None = None) -> dict:
    """Call ``ask(i mod count)`` from ``t0`` until ``t_end``, one call after the other; then
    ``after(i mod count)``, outside the call's time, where given.

    Returns each call's start (monotonic seconds), latency (seconds) and, for calls
    that raised, (start, error)."""
    starts, lats, errors = array("d"), array("d"), []
    wait_until(t0)
    i = 0
    while (now := time.monotonic()) < t_end:
        t = time.perf_counter()
        try:
            ask(i % count)
        except Exception as exc:  # noqa: BLE001 - a failed query is counted, and the load goes on
            errors.append((now, f"{type(exc).__name__}: {str(exc)[:200]}"))
        lats.append(time.perf_counter() - t)
        starts.append(now)
        if after is not None:
            after(i % count)
        i += 1
    return {"start": starts.tolist(), "latency": lats.tolist(), "errors": errors}


def http_bodies(Q, k: int = 10) -> list[bytes]:
    """``POST /neighbors/search`` bodies, encoded before the clock starts."""
    import orjson

    rows = query_rows(Q)
    if sp.issparse(Q):
        return [orjson.dumps({"indices": i, "values": v, "k": k}, option=orjson.OPT_SERIALIZE_NUMPY)
                for i, v in rows]
    return [orjson.dumps({"values": q, "k": k}, option=orjson.OPT_SERIALIZE_NUMPY) for q in rows]


def main(argv: list[str] | None = None) -> None:
    import httpx

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--offset", type=int, required=True, help="first held-out query")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--preflight", type=int, default=PREFLIGHT, help="queries sent before the clock starts")
    p.add_argument("--result", type=Path, required=True)
    a = p.parse_args(argv)
    bodies = http_bodies(SHAPES[a.shape].queries(a.count, a.offset))
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=a.url, timeout=300) as client:
        def ask(i: int) -> None:
            r = client.post("/neighbors/search", content=bodies[i], headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:200]}")

        for i in range(a.preflight):  # the worker on this connection loads its kernels before the clock
            ask(i % len(bodies))
        t0, t_end = ready()
        out = loop(ask, len(bodies), t0, t_end)
    a.result.write_text(json.dumps(out))

