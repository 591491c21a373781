"""Work spread over the cores: serial kernels that release the GIL, run on chunks by a pool of threads.

Every kernel is compiled once, serial, ``nogil``; a batch worth spreading is cut into one
chunk per core and each chunk handed to a thread of one shared pool. numba's own parallel
regions (``parallel=True``) did the same work, but each such kernel was compiled twice (a
serial twin for small work, which must not load the parallel one's cached machine code), a
parallel region is the costliest kind of numba function to compile (the query search's alone
took two minutes of a first start's compile), and its default threading layer aborts the
process when two Python threads enter parallel regions at once, which a threaded web server
does. A chunk per core and a thread per chunk need none of that.

A thread that runs beside others doing the same work (a bulk load's hashing workers, a web
server's query lane) calls :func:`set_threads` with 1 (a per-thread setting): its calls then
run on it alone. The default is numba's (``NUMBA_NUM_THREADS``, else the cores); numba's own
thread functions are never called, since calling them starts numba's thread pool.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba

#: Below this many inner-loop steps a batch runs on the calling thread (threads cost more than they save).
PARALLEL_MIN_WORK = 1 << 20

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def threads() -> int:
    """Threads the calling thread's batches are spread over (its :func:`set_threads`, or the default)."""
    return getattr(_LOCAL, "threads", numba.config.NUMBA_NUM_THREADS)


def set_threads(n: int) -> None:
    """Spread the calling thread's batches over at most ``n`` threads (1: run them on it)."""
    _LOCAL.threads = max(1, int(n))


def parallel_pays(work: int) -> bool:
    """Whether a batch of ``work`` inner-loop steps is worth spreading over the cores: it is big
    enough, and the calling thread may use more than one (a chunk of a spread batch may not)."""
    return work >= PARALLEL_MIN_WORK and threads() > 1


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="gmmlsh-core",
                                       initializer=set_threads, initargs=(1,))
        return _POOL


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``parts`` ranges of near-equal size (none empty)."""
    parts = max(1, min(parts, n))
    edges = [n * i // parts for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts) if edges[i + 1] > edges[i]]


def spread(run: Callable[[int, int], object], n: int, work: int) -> list:
    """``run(lo, hi)`` over ``[0, n)``: on this thread, or — when ``work`` (inner-loop steps in
    all) makes it pay (:func:`parallel_pays`) — over one chunk per core, on the pool's threads.
    Returns the chunks' results in order."""
    if n <= 1 or not parallel_pays(work):
        return [run(0, n)]
    return list(_pool().map(lambda span: run(*span), chunks(n, threads())))
