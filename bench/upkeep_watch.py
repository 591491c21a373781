"""What the index's own upkeep did during a ``bench_operate`` run, and when.

The engine does not (yet) report its upkeep as events, so the benchmark watches it:

* In process (:class:`InProcessWatch`): the index's upkeep entry points are wrapped where
  they are looked up at call time — ``Index.maintain`` on the instance (the background
  thread's target), the list build (``generation.build``) and the tuner
  (``tuner.tune``) in their modules, and ``Mirror.sync`` on the instance (a query applying
  the writer's changes, or upkeep catching up) — and each call is recorded with its
  thread, start and end (``time.monotonic``). Nothing polls: the watch costs the query
  thread nothing. The ``gmmlsh`` loggers' records are kept too.
* Over HTTP (:class:`HttpWatch`): the server's workers are other processes, so ``GET
  /stats`` is polled (once a second, its own latency recorded) and a change of the lists
  (``mirror.lists``/``listed_rows``) or of the tuning (``search``) is an upkeep that ended
  between two polls; the server's log lines are kept with the moment they arrived.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import IO

from gmmlsh.index import generation, tuner


class InProcessWatch:
    """Records the upkeep of one ``Index`` opened in this process; :meth:`close` unwraps."""

    def __init__(self, ix):
        self.ix = ix
        #: dicts: kind ("maintain", "lists", "tune", "sync"), thread, start, end, detail
        self.events: list[dict] = []
        self.logs: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        self._wrap(ix, "maintain", "maintain", _maintain_detail, instance=True)
        self._wrap(ix.mirror, "sync", "sync", lambda out: {"rows": out.rows}, instance=True)
        self._wrap(generation, "build", "lists", lambda name: {"generation": str(name)})
        self._wrap(tuner, "tune", "tune", _tune_detail)
        handler = _Collect(self.logs)
        logger = logging.getLogger("gmmlsh")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        self._undo.append(lambda: (logger.removeHandler(handler), logger.setLevel(level)))

    def _wrap(self, owner, name: str, kind: str, detail: Callable, instance: bool = False) -> None:
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            start = time.monotonic()
            event = {"kind": kind, "thread": threading.current_thread().name, "start": start}
            try:
                out = inner(*args, **kwargs)
                event["detail"] = detail(out)
                return out
            except BaseException as exc:
                event["detail"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                raise
            finally:
                event["end"] = time.monotonic()
                with self._lock:
                    self.events.append(event)

        setattr(owner, name, wrapped)
        self._undo.append((lambda: delattr(owner, name)) if instance else (lambda: setattr(owner, name, inner)))

    def running(self) -> list[str]:
        """Upkeep under way now (kinds of calls started and not ended): unknowable from the
        recorded events alone, so read the index's own lock."""
        return ["maintain"] if self.ix._maintaining.locked() else []

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _maintain_detail(done: dict) -> dict:
    out = {}
    if "generation" in done:
        out["generation"] = done["generation"]
    if "tuned" in done:
        out["tuned"] = done["tuned"].get("chosen")
    return out or {"nothing": "not due, or another holder had the upkeep lock"}


def _tune_detail(out) -> dict:
    params, report = out
    return {"chosen": report.get("chosen"), "sample": report.get("sample"),
            "bound": report.get("sample_recall_bound"), "search_ms": report.get("search_ms"),
            "exact_ms": report.get("exact_ms"), "params": params.to_dict()}


class _Collect(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append((time.monotonic(), record.levelname, record.getMessage()[:500]))


class HttpWatch:
    """Polls a server's ``/stats`` and keeps its log lines, each with the moment seen."""

    def __init__(self, url: str, log: IO[str] | None, interval: float = 1.0):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=30)
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
        """Upkeep seen from outside: each change of the lists or of the tuning between two polls
        (it ended in that interval: ``start`` is the poll before, ``end`` the poll that saw it)."""
        out, last, last_t = [], None, None
        for t, _took, stats, _err in self.polls:
            if stats is None:
                continue
            m, s = stats["mirror"], stats["search"]
            now = {"lists": (m["lists"], m["listed_rows"]),
                   "tune": (s.get("tuned_at_rows"), s.get("tuned_on"),
                            tuple(sorted((k, str(v)) for k, v in s.items() if k != "overrides")))}
            if last is not None:
                for kind in ("lists", "tune"):
                    if now[kind] != last[kind]:
                        detail = ({"lists": m["lists"], "listed_rows": m["listed_rows"]} if kind == "lists" else
                                  {"tuned_at_rows": s.get("tuned_at_rows"), "tuned_on": s.get("tuned_on"),
                                   "exact": s.get("exact"), "rare": s.get("rare"), "probes": s.get("probes")})
                        out.append({"kind": kind, "thread": "server", "start": last_t, "end": t, "detail": detail,
                                    "seen_between_polls": True})
            last, last_t = now, t
        return out

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(timeout=60)
        self.client.close()
