"""What the index's own upkeep did during a ``bench_operate`` run, and when.

The engine records every upkeep task machine-wide (:mod:`gmmlsh.index.upkeep`): a line of the
mirror's ``upkeep.log`` per task done (kind, lane, process, start, seconds, what it did) and an
``upkeep-<lane>.json`` while one runs. :class:`UpkeepLog` reads the tasks a run saw, on the
benchmark's clock (``time.monotonic``). In process (:class:`InProcessWatch`) ``Mirror.sync`` is
also wrapped on the instance, to time the query thread applying the writer's changes, and the
``gmmlsh`` loggers' records are kept. Over HTTP (:class:`HttpWatch`) ``GET /stats`` is polled
once a second (its own latency recorded) and the server's log lines are kept.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO


class UpkeepLog:
    """The upkeep tasks recorded in a mirror directory after this object was made."""

    def __init__(self, mirror_dir: str | Path):
        self.dir = Path(mirror_dir)
        self.offset = time.monotonic() - time.time()  # wall clock → the benchmark's clock
        log = self.dir / "upkeep.log"
        self.skip = log.stat().st_size if log.exists() else 0

    def events(self) -> list[dict]:
        """Each task: kind (absorb, merge, fit, tune), ``thread`` (lane and process), ``start``,
        ``end`` (monotonic seconds) and ``detail`` (what it did)."""
        log = self.dir / "upkeep.log"
        if not log.exists():
            return []
        with open(log, "rb") as f:
            f.seek(min(self.skip, log.stat().st_size))
            lines = f.read().decode("utf-8", "replace").splitlines()
        out = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            start = e.pop("started") + self.offset
            out.append({"kind": e.pop("kind"), "thread": f"{e.pop('lane')} lane, pid {e.pop('pid')}", "start": start,
                        "end": start + e.pop("seconds"), "detail": e})
        return out

    def running(self) -> list[str]:
        """Upkeep under way now, by any process of the machine."""
        out = []
        for path in self.dir.glob("upkeep-*.json"):
            try:
                task = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            out.append(f"{task['kind']} ({task['lane']} lane, pid {task['pid']})")
        return out


class InProcessWatch:
    """The upkeep of one ``Index`` opened in this process, and its mirror syncs; :meth:`close` unwraps."""

    def __init__(self, ix):
        self.ix = ix
        self.upkeep = UpkeepLog(ix.mirror_path)
        #: the mirror's syncs: kind "sync", thread, start, end, detail
        self.syncs: list[dict] = []
        self.logs: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        inner = ix.mirror.sync

        def sync(*args, **kwargs):
            start = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                with self._lock:
                    self.syncs.append({"kind": "sync", "thread": threading.current_thread().name, "start": start,
                                       "end": time.monotonic(), "detail": {}})

        ix.mirror.sync = sync
        self._undo.append(lambda: delattr(ix.mirror, "sync"))
        #: answers worked out: a query that answered again on a newer view counts twice
        self.answers = 0
        answer = ix._answer

        def counted(*args, **kwargs):
            self.answers += 1
            return answer(*args, **kwargs)

        ix._answer = counted
        self._undo.append(lambda: delattr(ix, "_answer"))
        handler = _Collect(self.logs)
        logger = logging.getLogger("gmmlsh")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        self._undo.append(lambda: (logger.removeHandler(handler), logger.setLevel(level)))

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return sorted(self.upkeep.events() + list(self.syncs), key=lambda e: e["start"])

    def running(self) -> list[str]:
        return self.upkeep.running()

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class _Collect(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append((time.monotonic(), record.levelname, record.getMessage()[:500]))


class HttpWatch:
    """Polls a server's ``/stats`` and keeps its log lines, each with the moment seen; reads the
    upkeep the server's workers recorded in the mirror directory they share."""

    def __init__(self, url: str, log: IO[str] | None, mirror_dir: str | Path, interval: float = 1.0):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=30)
        self.upkeep = UpkeepLog(mirror_dir)
        self.interval = interval
        #: (moment, seconds the request took, the stats or None, error or None)
        self.polls: list[tuple[float, float, dict | None, str | None]] = []
        self.logs: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll, daemon=True, name="watch-stats")]
        if log is not None:
            self._threads.append(threading.Thread(target=self._read, args=(log,), daemon=True, name="watch-log"))
        for t in self._threads:
            t.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                r = self.client.get("/stats")
                r.raise_for_status()
                self.polls.append((t, time.monotonic() - t, r.json(), None))
            except Exception as exc:  # noqa: BLE001 - a failed poll is a finding, not a crash
                self.polls.append((t, time.monotonic() - t, None, str(exc)[:200]))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def _read(self, log: IO[str]) -> None:
        for line in log:
            self.logs.append((time.monotonic(), line.rstrip()))

    def events(self) -> list[dict]:
        return self.upkeep.events()

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(timeout=60)
        self.client.close()
