"""The query lane: a worker's single queries, answered on one engine thread, in batches.

A request holding one query (``GET /neighbors``, a one-query ``POST /neighbors/search``)
hands it to the lane and awaits the answer, already encoded as JSON. The lane's thread
takes every query queued by then and answers them together: dense vectors of the same
index with the same options go to ``Index.query_batch`` as one call, the rest (stored ids,
sparse vectors, filters) one ``Index.query`` each. No window, no timer: a query arriving
while the thread is idle runs at once (light load adds no latency), and those arriving
while it is busy form the next batch (under load, one hand-off between threads serves
many requests, and the batch call shares its fixed cost).

Why not the shared thread pool: each ``run_in_threadpool`` costs a thread hand-off and a
wake-up both ways per request, more than a query's own Python at 60,000 vectors; and a
batch call answers a dense query in less CPU than a call of its own.

Requests of many queries (``{"queries": [...]}``, a binary body of many rows) and writes
keep the thread pool: a 10,000-query batch must not hold the lane's other queries up.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gmmlsh.core import parallel
from gmmlsh.core.validate import VectorError
from gmmlsh.index.index import Index
from gmmlsh.results import QueryResult


@dataclass(eq=False)
class Job:
    """One query: ``run(index)`` answers it alone; ``vector`` (dense, 1-D), ``key`` (its options,
    hashable) and ``finish`` let the lane answer it in a batch; ``finish(result)`` turns an
    answer into what the request sends."""

    index: Index
    run: Callable[[], QueryResult]
    finish: Callable[[QueryResult], Any]
    vector: np.ndarray | None = None
    key: Any = None
    future: asyncio.Future | None = None


#: Queries answered by one batch call at most (the engine's own chunk of a batch).
MAX_BATCH = 256


class QueryLane:
    """One engine thread per worker process, fed from the event loop (see the module)."""

    def __init__(self, max_batch: int = MAX_BATCH) -> None:
        self.max_batch = max_batch
        self._queue: deque[Job] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; answers are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="gmmlsh-lane", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def answer(self, job: Job) -> Any:
        """``job.finish`` of the job's answer (or its exception), once the lane has worked it out."""
        job.future = self._loop.create_future()
        self._queue.append(job)
        self._wake.set()
        return await job.future

    # --- the lane's thread ------------------------------------------------------------------
    def _serve(self) -> None:
        parallel.set_threads(1)  # this thread's batches run serial kernels (see the module)
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            while self._queue:
                jobs = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
                outcomes = answer_jobs(jobs)
                self._loop.call_soon_threadsafe(_deliver, jobs, outcomes)


def _deliver(jobs: list[Job], outcomes: list[Any]) -> None:
    """On the event loop: each answer (or exception) to its request, unless it went away."""
    for job, out in zip(jobs, outcomes, strict=True):
        if job.future.done():  # cancelled: the client left
            continue
        if isinstance(out, BaseException):
            job.future.set_exception(out)
        else:
            job.future.set_result(out)


def answer_jobs(jobs: list[Job]) -> list[Any]:
    """Every job's finished answer, or the exception it raised, in order. Dense vectors of one
    index and one set of options are answered by one ``query_batch``; a batch refused as a whole
    (one bad vector) is answered job by job, so each request gets its own answer or error."""
    out: list[Any] = [None] * len(jobs)
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.vector is not None and job.key is not None:
            groups.setdefault((id(job.index), job.vector.shape, job.key), []).append(i)
    alone = [i for i, job in enumerate(jobs) if job.vector is None or job.key is None]
    for members in groups.values():
        if len(members) == 1:
            alone += members
            continue
        first = jobs[members[0]]
        try:
            results = first.index.query_batch(np.stack([jobs[i].vector for i in members]), **first.key.kwargs())
        except VectorError:
            alone += members
            continue
        except Exception as exc:  # noqa: BLE001 - e.g. the store is down: every member's answer
            for i in members:
                out[i] = exc
            continue
        for i, r in zip(members, results, strict=True):
            out[i] = _finish(jobs[i], r)
    for i in alone:
        try:
            out[i] = _finish(jobs[i], jobs[i].run())
        except Exception as exc:  # noqa: BLE001 - handed to the request, which answers it
            out[i] = exc
    return out


def _finish(job: Job, result: QueryResult) -> Any:
    try:
        return job.finish(result)
    except Exception as exc:  # noqa: BLE001
        return exc
