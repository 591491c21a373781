"""One lock around every parallel numba kernel.

numba's default ``workqueue`` threading layer aborts the process when two
Python threads enter parallel regions at once — exactly what a threaded web
server does. Work that is small (one query) runs serial kernels, which need no
lock; big batch work takes this lock, so it is safe under any threading layer.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable

import numba
from numba import njit

PARALLEL_LOCK = threading.RLock()

#: Below this many inner-loop steps a batch runs serially (threads cost more than they save).
PARALLEL_MIN_WORK = 1 << 20


def parallel_pays(work: int) -> bool:
    """Whether a batch of ``work`` inner-loop steps takes the parallel twin of its kernel: it is
    big enough, and the calling thread lets numba use more than one thread. A thread that
    runs beside others doing the same work (a bulk load's hashing workers) sets
    ``numba.set_num_threads(1)`` and so runs serial kernels: no lock, and no parallel region
    waiting on a thread that another one has preempted."""
    return work >= PARALLEL_MIN_WORK and numba.get_num_threads() > 1


def twin_kernels(impl: Callable, **options) -> tuple[Callable, Callable]:
    """``(parallel, serial)`` dispatchers of one kernel, each cached in its own file.

    numba's on-disk cache names its files after the function's qualified name and
    keys entries by signature only, not by ``parallel``: two ``njit`` wrappers of
    one function share a cache file, and the serial one can load the parallel
    machine code. A query then starts an OpenMP region whose threads spin after
    it, costing CPU and time (docs/tuning.md). Each twin is
    therefore a copy of ``impl`` under its own name.
    """

    def copy(suffix: str) -> Callable:
        fn = types.FunctionType(impl.__code__, impl.__globals__, impl.__name__ + suffix,
                                impl.__defaults__, impl.__closure__)
        fn.__qualname__ = impl.__qualname__ + suffix
        fn.__doc__ = impl.__doc__
        return fn

    return (njit(parallel=True, **options)(copy("_parallel")),
            njit(**options)(copy("_serial")))
