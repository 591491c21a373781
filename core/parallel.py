"""One lock around every parallel numba kernel.

numba's default ``workqueue`` threading layer aborts the process when two
Python threads enter parallel regions at once — exactly what a threaded web
server does. Work that is small (one query) runs serial kernels, which need no
lock; big batch work takes this lock, so it is safe under any threading layer.
"""

from __future__ import annotations

import threading

PARALLEL_LOCK = threading.RLock()

#: Below this many inner-loop steps a batch runs serially (threads cost more than they save).
PARALLEL_MIN_WORK = 1 << 20
