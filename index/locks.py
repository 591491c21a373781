"""Named locks on a directory, held across the threads of a process and across processes.

Each name is a lock of its own (a thread lock and a ``flock`` on ``{name}.lock``), so the long
locks of upkeep never stand in the way of the short ``sync`` lock a query may need; a thread
holding one may take it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
from collections.abc import Iterator
from pathlib import Path


class DirectoryLocks:
    """The named locks of ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self._thread_locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()
        self._flock_owner: dict[str, int] = {}  # lock name → the thread holding its file lock

    @contextlib.contextmanager
    def locked(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """Hold the lock ``name``; yields False (holding nothing) if not ``blocking`` and
        another thread or process has it."""
        with self._guard:
            lock = self._thread_locks.setdefault(name, threading.RLock())
        if not lock.acquire(blocking=blocking):
            yield False
            return
        try:
            me = threading.get_ident()
            if self._flock_owner.get(name) == me:  # taken again inside its holder
                yield True
                return
            with open(self.dir / f"{name}.lock", "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                except BlockingIOError:
                    yield False
                    return
                self._flock_owner[name] = me
                try:
                    yield True
                finally:
                    del self._flock_owner[name]
                    fcntl.flock(f, fcntl.LOCK_UN)
        finally:
            lock.release()
