"""Upkeep of an index's search mirror, beside the queries: segments, fits, tuning.

Queries never wait for upkeep. Every task builds what it makes aside (segments at the end
of the arenas, a new fit in its own directory, a tuning in memory) and publishes it with one
short state update (:meth:`gmmlsh.index.mirror.Mirror.publish`); what it read stays valid
meanwhile, since segments never change and rows are only appended.

Tasks run in two *lanes*, each holding a lock of the mirror's directory (so one process of the
machine runs each lane at a time; the others pick up what it publishes):

* the **fast** lane keeps the tail short: it makes the tail a segment once it holds
  :func:`~gmmlsh.index.segments.tail_limit` rows, and merges or rebuilds small segments —
  work in proportion to the rows it absorbs, whatever the index's size — on its own thread:
  spread over the process's pool (:mod:`gmmlsh.core.parallel`), an absorb of 1,500 rows
  queued behind the slow lane's fit of 1.4M rows for 5.6 s, while the tail every query scans grew;
* the **slow** lane makes a new fit when the index has doubled since the last (or its arenas
  hold more dead segments than live ones) and builds every segment again under it while the
  fast lane keeps absorbing under the old one (it catches up before it publishes), merges or
  rebuilds big segments, and tunes the search.

In the background, upkeep runs in a **process of its own** (:func:`main`, started by the first
process of the machine that finds upkeep due and no worker running it; it stops once idle): the
serving processes' cores and their interpreter lock are the queries'. Threads beside the
queries held that lock for their Python parts and made a query wait for it (95 ms at the median
when a sync met an absorb). Its lanes run at a lower CPU priority (``nice``, per thread); its
*follower* thread, which keeps the mirror up with the store, does not: it takes the ``sync``
lock a query may wait for, and a holder starved of CPU by the queries it blocks would make
them wait for its whole time slice (a priority inversion). :meth:`Upkeep.run_now` does what is
due in the calling thread instead (a bulk load's end, a test).

Each task is recorded (kind, lane, process, start, seconds, what it did) for the machine, not
the process: a task under way is named in ``upkeep-<lane>.json`` of the mirror's directory and
every task done is a line of its ``upkeep.log``, so every worker of a server reports the same
upkeep (``Index.stats()``), and a benchmark reads them all.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from gmmlsh.core import parallel
from gmmlsh.index import monitor, nearcopies, segments, tuner
from gmmlsh.index.mirror import Stale, View
from gmmlsh.index.segments import ArenaWriter, Fit

log = logging.getLogger("gmmlsh.upkeep")

#: Merges and rebuilds of segments up to this many rows run in the fast lane; bigger ones in the slow.
FAST_ROWS = 1 << 16
#: How much lower a background lane's CPU priority is than the queries' (``nice`` increment).
NICE = 10
#: Seconds a lane waits before it runs again after a task failed.
RETRY_SECONDS = 30.0
#: Seconds a worker process waits for more work before it stops, and between its looks for work
#: (the recall monitor's inbox: less often).
IDLE_SECONDS = 20.0
POLL_SECONDS = 0.1
MONITOR_POLL_SECONDS = 0.5
#: The locks a worker's lanes hold (one process of the machine runs each).
LANES = ("fast", "slow", "monitor-lane")
#: Seconds between a serving process's looks for whether a worker should be started.
SPAWN_CHECK_SECONDS = 0.5
#: The environment variable a worker process finds its index's opening arguments in (JSON).
WORKER_ENV = "GMMLSH_UPKEEP_INDEX"
#: Seconds between checkpoints of the mirror (:meth:`~gmmlsh.index.mirror.Mirror.checkpoint`).
CHECKPOINT_SECONDS = 30.0
#: Events kept in memory; lines the log keeps (it is cut to half when it holds twice as many).
EVENTS = 1024
LOG_LINES = 4096


class Upkeep:
    """The upkeep of one :class:`~gmmlsh.index.index.Index` (see the module docstring)."""

    def __init__(self, index):
        self.index = index
        self.mirror = index.mirror
        self.config = index.config
        self.events: deque[dict] = deque(maxlen=EVENTS)
        self._worker: subprocess.Popen | None = None
        self._next_check = 0.0
        self._guard = threading.Lock()
        self._planned: tuple[View | None, dict[str, bool]] = (None, {})
        self._served: tuple[float, int] = (0.0, 0)
        self._asked: tuple[float, View | None, bool] = (0.0, None, False)
        #: Whether a follower thread keeps the mirror up with the store (a worker's lanes then read it).
        self._followed = False
        #: When a lane of this worker last ended a task (monotonic seconds), and the lanes in one
        #: now: the lanes stop together, once none is in a task and none has been for the idle time.
        self._worked = 0.0
        self._busy: set[str] = set()

    # --- what is due ------------------------------------------------------------------------
    def due(self, view: View) -> dict[str, bool]:
        """Which lanes have work: what the published state calls for (worked out once per state)
        and whether enough queries were served to tune on them."""
        planned_for, due = self._planned
        if planned_for is not view:
            fast = view.fit is not None and (view.rows - view.tail_start >= segments.tail_limit(view.rows)
                                              or self._merge(view, small=True) is not None)
            slow = self._fit_due(view) or self._merge(view, small=False) is not None
            due = {"fast": fast, "slow": slow}
            self._planned = (view, due)
        return {"fast": due["fast"], "slow": due["slow"] or self._tuning_due(view),
                "monitor": monitor.pending(self.mirror.dir)}

    def _fit_due(self, view: View) -> bool:
        if view.fit is None:
            return segments.lists_due(view.live)
        if view.rows >= 2 * max(view.fit.rows, 1):
            return True
        used = sum(segments.size_of(s, view.fit, view.dim) for s in view.segments)
        return view.garbage > max(used, 1 << 20)

    def _merge(self, view: View, small: bool, dead: bool = False) -> tuple[int, int] | None:
        """The segments ``[i, j)`` one lane would merge next, or, with ``dead``, rebuild alone
        because most of its rows are retired (that check reads every live flag: the lanes make
        it, not :meth:`poke`)."""
        segs = list(view.segments)
        plan = segments.merge_plan(segs)
        if plan is None and dead:
            d = segments.dead_segment(segs, view.alive)
            plan = (d, d + 1) if d is not None else None
        if plan is None:
            return None
        rows = segs[plan[1] - 1]["hi"] - segs[plan[0]]["lo"]
        return plan if (rows <= FAST_ROWS) == small else None

    def _tuning_due(self, view: View) -> bool:
        """Tune when the index has doubled since it was last tuned, or when it was tuned on
        stored vectors and enough served queries have come in since to tune on them instead."""
        if view.rows < tuner.MIN_ROWS or view.live < tuner.MIN_ROWS:
            return False
        return view.rows >= 2 * max(view.tuned_rows, 1) or (
            not view.tuned_on_queries and self._served_count() >= tuner.MIN_QUERIES) or self._monitor_asks(view)

    def _monitor_asks(self, view: View) -> bool:
        """Whether the recall monitor asked for a re-tune of the search now tuned (read at most once a second)."""
        at, seen, asked = self._asked
        if seen is not view or time.monotonic() - at > 1.0:
            asked = monitor.retune_requested(self.mirror.dir, view)
            self._asked = (time.monotonic(), view, asked)
        return asked

    def _served_count(self) -> int:
        """Queries in the index's shared sample (read at most once a second)."""
        at, count = self._served
        if time.monotonic() - at > 1.0:
            count = self.index.shared.count()
            self._served = (time.monotonic(), count)
        return count

    # --- running ---------------------------------------------------------------------------
    def poke(self, view: View) -> None:
        """Start a worker process if upkeep is due and none runs on this machine (a look at most
        every :data:`SPAWN_CHECK_SECONDS`: a few comparisons, and two lock probes when due)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + SPAWN_CHECK_SECONDS
        due = self.due(view)
        if not any(due.values()):
            return
        with self._guard:
            if self._worker is not None and self._worker.poll() is None:
                return  # ours runs
            if any(self._held(lane) for lane in LANES):
                return  # another process's runs
            env = {**os.environ, WORKER_ENV: json.dumps(self.index.open_args, default=str)}
            # A process group of its own (a terminal's Ctrl-C is not its), the session of this
            # process: Linux's autogroups share the CPU between sessions first, so a worker in a
            # session of its own took half of a busy machine whatever its lanes' nice values.
            self._worker = subprocess.Popen([sys.executable, "-m", "gmmlsh.index.upkeep"], env=env,
                                            stdin=subprocess.DEVNULL, process_group=0)

    def _held(self, lane: str) -> bool:
        with self.mirror.locked(lane, blocking=False) as mine:
            return not mine

    def work(self, idle: float = IDLE_SECONDS) -> None:
        """Run both lanes, at a lower priority, until neither has had work for ``idle`` seconds,
        and the follower beside them: a worker process's life."""
        stop = threading.Event()
        self._worked = time.monotonic()
        lanes = [threading.Thread(target=self._lane, args=(lane, idle, stop), name=f"gmmlsh-upkeep-{lane}")
                 for lane in ("fast", "slow")]
        watch = threading.Thread(target=self._monitor_lane, args=(idle, lanes), name="gmmlsh-upkeep-monitor")
        self._followed = True
        follower = threading.Thread(target=self._follow, args=(stop,), name="gmmlsh-upkeep-follower")
        follower.start()
        for t in (*lanes, watch):
            t.start()
        for t in (*lanes, watch):
            t.join()
        stop.set()
        follower.join()

    def _follow(self, stop: threading.Event) -> None:
        """Bring the mirror up to the store every :data:`POLL_SECONDS` (at the process's own
        priority: see the module docstring) while the lanes run."""
        while not stop.is_set() and self.mirror.dir.exists():
            try:
                if self.mirror.refresh().token != self.index.store.token():  # the lock only when behind
                    self.mirror.sync(self.index.store)
            except Exception:  # the lanes go on with the mirror as it is; say why it fell behind
                log.exception("index upkeep: the mirror could not follow the store")
                stop.wait(RETRY_SECONDS)
            stop.wait(POLL_SECONDS)

    def _monitor_lane(self, idle: float, lanes: list[threading.Thread]) -> None:
        """The recall monitor's checks (:mod:`gmmlsh.index.monitor`), one thread of numba, until
        the other lanes are done and no record came for ``idle`` seconds."""
        if self.index.recorder.budget <= 0:
            return
        _lower_priority()
        parallel.set_threads(1)  # beside the queries: a thread of its own, at the lanes' priority
        checker = monitor.Checker(self.mirror, self.config, self.index.recorder.budget, self.index.overrides)
        with self.mirror.locked("monitor-lane", blocking=False) as mine:
            if not mine:
                return
            last = time.monotonic()
            while self.mirror.dir.exists():
                try:
                    if checker.run():
                        last = time.monotonic()
                except Exception:  # the index keeps answering; say why the monitor failed
                    log.exception("recall monitor failed")
                    time.sleep(RETRY_SECONDS)
                if time.monotonic() - last > idle and not any(t.is_alive() for t in lanes):
                    return
                time.sleep(MONITOR_POLL_SECONDS)

    def _lane(self, lane: str, idle: float, stop: threading.Event) -> None:
        """One lane's tasks as they fall due, until no lane is in a task or has ended one for
        ``idle`` seconds: a lane idle alone stays, since while the process lives no other starts
        on this machine (a slow lane that stopped after 20 s without work left a re-tune the
        recall monitor asked for undone for as long as a writer kept the fast lane busy)."""
        _lower_priority()
        if lane == "fast":  # its tasks are small: on its own thread, never queued behind the slow lane's in the pool
            parallel.set_threads(1)
        with self.mirror.locked(lane, blocking=False) as mine:
            if not mine:
                return
            while not stop.is_set() and self.mirror.dir.exists():
                try:
                    self._run(lane)
                except Exception:  # the index keeps answering with what it has; say why upkeep failed
                    log.exception("index upkeep (%s lane) failed", lane)
                    stop.wait(RETRY_SECONDS)
                if not self._busy and time.monotonic() - self._worked > idle:
                    return
                stop.wait(POLL_SECONDS)

    def _run(self, lane: str, queries: list | None = None, done: dict | None = None) -> dict:
        """Run the lane's tasks until none is due (its lock held)."""
        done = {} if done is None else done
        tasks = self._fast_tasks if lane == "fast" else self._slow_tasks
        while True:
            view = self.mirror.refresh() if self._followed else self.mirror.sync(self.index.store)
            task = tasks(view, queries)
            if task is None:
                return done
            kind, run = task
            t0, at = time.perf_counter(), time.time()
            running = self.mirror.dir / f"upkeep-{lane}.json"
            running.write_text(json.dumps({"kind": kind, "lane": lane, "pid": os.getpid(), "started": at}))
            log.info("upkeep %s (%s lane) started", kind, lane)
            self._busy.add(lane)
            try:
                what = run(view)
            except Stale as exc:  # another task moved the state first: plan again
                what = {"stale": str(exc)}
            except FileNotFoundError as exc:  # the fit it wrote into was replaced meanwhile: plan again
                if view.fit is None or self.mirror.refresh().fit is view.fit:
                    raise
                what = {"stale": f"the fit was replaced ({exc.filename})"}
            finally:
                running.unlink(missing_ok=True)
                self._busy.discard(lane)
                self._worked = time.monotonic()
            seconds = time.perf_counter() - t0
            event = {"kind": kind, "lane": lane, "pid": os.getpid(), "started": at, "seconds": round(seconds, 4),
                     **what}
            self.events.append(event)
            self._record(event)
            log.info("upkeep %s (%s lane) done in %.2f s: %s", kind, lane, seconds, what)
            done.setdefault(kind, []).append(what)
            if kind == "tune":
                queries = None
            if time.monotonic() - self.mirror.checkpointed > CHECKPOINT_SECONDS:
                self.mirror.checkpoint()
                segments.delete_retired(self.mirror.dir)

    def _record(self, event: dict) -> None:
        """Append a finished task to the machine's upkeep log (cut to its last half when long)."""
        path = self.mirror.dir / "upkeep.log"
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")
        if path.stat().st_size > 2 * LOG_LINES * 256:
            with self.mirror.locked("upkeep-log"):
                lines = path.read_text().splitlines()[-LOG_LINES:]
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text("\n".join(lines) + "\n")
                os.replace(tmp, path)

    def report(self, recent: int = 20) -> dict:
        """The machine's upkeep: tasks under way (by any process) and the last ``recent`` done."""
        running = []
        for lane in ("fast", "slow"):
            try:
                task = json.loads((self.mirror.dir / f"upkeep-{lane}.json").read_text())
            except (OSError, ValueError):
                continue
            if _alive(task.get("pid", -1)):
                running.append(task)
        return {"running": running, "recent": recent_events(self.mirror.dir, recent)}

    def run_now(self, queries: list | None = None) -> dict:
        """Everything due, now, in the calling thread (both lanes' locks, waiting for them; all of
        numba's threads): a bulk load's end, a test. ``queries``: tune on these now."""
        done: dict = {}
        self.index.flush_served()
        self.index.flush_recorded()
        if monitor.pending(self.mirror.dir):  # the recall monitor's checks first: they may ask for a re-tune
            with self.mirror.locked("monitor-lane", blocking=False) as mine:  # else a worker checks them
                checked = monitor.Checker(self.mirror, self.config, self.index.recorder.budget,
                                          self.index.overrides, budgeted=False).run() if mine else 0
            if checked:
                done["monitor"] = [{"checked": checked}]
        with self.mirror.locked("fast"):
            self._run("fast", done=done)
        with self.mirror.locked("slow"):
            self._run("slow", queries=queries, done=done)
        with self.mirror.locked("fast"):  # what arrived meanwhile
            self._run("fast", done=done)
        self.mirror.checkpoint()
        return done

    # --- the tasks ----------------------------------------------------------------------------
    def _fast_tasks(self, view: View, queries) -> tuple[str, Callable[[View], dict]] | None:
        if view.fit is None:
            return None
        if view.rows - view.tail_start >= segments.tail_limit(view.rows):
            return "absorb", self._absorb
        plan = self._merge(view, small=True, dead=True)
        if plan is not None:
            return "merge", lambda v: self._merge_run(v, plan)
        return None

    def _slow_tasks(self, view: View, queries) -> tuple[str, Callable[[View], dict]] | None:
        if self._fit_due(view):
            return "fit", self._refit
        plan = self._merge(view, small=False, dead=True)
        if plan is not None:
            return "merge", lambda v: self._merge_run(v, plan)
        if queries is not None and view.live >= tuner.MIN_ROWS or self._tuning_due(view):
            return "tune", lambda v: self._tune(v, queries)
        return None

    def _writer(self, fit: Fit) -> ArenaWriter:
        return ArenaWriter(self.mirror.dir / fit.name, fit, self.mirror.words,
                           lambda sizes: self.mirror.reserve(fit.name, sizes))

    def _absorb(self, view: View) -> dict:
        """The tail, a new segment."""
        fit, lo, hi = view.fit, view.tail_start, view.rows
        writer = self._writer(fit)
        record = segments.build_segment(writer, view, lo, hi)

        def append(state: dict) -> None:
            lists = state.get("lists")
            if not lists or lists["fit"] != fit.name:
                raise Stale("a new fit was published")
            tail = lists["segments"][-1]["hi"] if lists["segments"] else 0
            if tail != lo:
                raise Stale("the tail moved")
            lists["segments"].append(record)

        self.mirror.publish(append)
        return {"rows": hi - lo, "segments": len(view.segments) + 1}

    def _merge_run(self, view: View, plan: tuple[int, int]) -> dict:
        """Segments ``[i, j)`` merged into one (a single mostly retired one: rebuilt without its
        retired rows). Rows keep their lists: a merge copies, it assigns nothing."""
        fit = view.fit
        group = list(view.segments[plan[0]:plan[1]])
        arrays = {"lrows": view.lists.lrows, "lstarts": view.lists.lstarts}
        live, labels = segments.merged_labels(view, arrays, group, fit.lists)
        writer = self._writer(fit)
        record = segments.build_segment(writer, view, group[0]["lo"], group[-1]["hi"], live, labels)

        def replace(state: dict) -> None:
            lists = state.get("lists")
            if not lists or lists["fit"] != fit.name:
                raise Stale("a new fit was published")
            segs = lists["segments"]
            at = next((i for i, s in enumerate(segs) if s["lo"] == group[0]["lo"]), None)
            if at is None or segs[at:at + len(group)] != group:
                raise Stale("the segments changed")
            segs[at:at + len(group)] = [record]
            lists["garbage"] = lists.get("garbage", 0) + sum(segments.size_of(s, fit, view.dim) for s in group)

        self.mirror.publish(replace)
        return {"rows": group[-1]["hi"] - group[0]["lo"], "merged": len(group), "listed": record["n"]}

    def _refit(self, view: View) -> dict:
        """A new fit: new profiles where the index has doubled (else the old ones in fresh arenas),
        every segment built again under it while the fast lane keeps absorbing under the old;
        published once it covers what the old fit covers."""
        old = view.fit
        refit = old is None or view.rows >= 2 * old.rows
        number = old.number + 1 if old is not None else 1
        fit = segments.make_fit(self.mirror.dir, view, number, self.config.bits, self.config.seed,
                                previous=None if refit else old)
        ends: dict[str, int] = {}
        writer = ArenaWriter(self.mirror.dir / fit.name, fit, self.mirror.words, segments.local_allocator(ends))
        records = [segments.build_segment(writer, view, 0, view.rows)]
        covered = view.rows
        while True:  # catch up with what the old fit listed meanwhile
            now = self.mirror.refresh()
            if now.tail_start <= covered or now.fit is None or old is None or now.fit.name != old.name:
                break
            records.append(segments.build_segment(writer, now, covered, now.tail_start))
            covered = now.tail_start

        def switch(state: dict) -> None:
            lists = state.get("lists")
            named = lists["fit"] if lists else None
            if named != (old.name if old else None) and (self.mirror.dir / named).exists():
                raise Stale("another fit was published")
            state["lists"] = {"fit": fit.name, "segments": records, "ends": ends, "garbage": 0}

        try:
            self.mirror.publish(switch)
        except Stale:
            segments.remove_fit(self.mirror.dir / fit.name)
            raise
        self.mirror.checkpoint()  # a restart of the machine finds this fit, not the one just removed
        segments.sweep(self.mirror.dir, {fit.name})
        return {"fit": fit.number, "lists": fit.lists, "refit": refit, "rows": covered,
                "segments": len(records)}

    def _tune(self, view: View, queries: list | None) -> dict:
        served = queries or (self.index.shared.rows(tuner.MAX_QUERIES)
                             if self._served_count() >= tuner.MIN_QUERIES else None)
        params, report = tuner.tune(view, self.config, seed=self.config.seed, served=served)
        if not served:  # tuned on stored vectors: can they stand in for new queries?
            params, report = nearcopies.guard(view, self.config, params, report)

        def record(state: dict) -> None:
            state.update(search=params.to_dict(), tuned_rows=view.rows, tuned_lists=view.list_count,
                         tuned_on_queries=served is not None)

        self.mirror.publish(record)
        monitor.tuned(self.mirror.dir, self.mirror.locked, report)  # the recall monitor's new epoch
        self.index.last_tuning = report
        return report


def recent_events(directory, count: int) -> list[dict]:
    """The last ``count`` tasks of a mirror's upkeep log (its end read: a task is well under 1 KiB)."""
    try:
        with open(os.path.join(directory, "upkeep.log"), "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - 1024 * count)
            f.seek(start)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines[1 if start else 0:][-count:]:  # the first line read may be cut
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`NICE` and make it a batch thread, which a
    wakeup does not let preempt a running query (Linux: per thread; the threads it starts,
    :mod:`gmmlsh.core.parallel`'s pool threads among them, inherit both). Both count only against
    threads of the same session: see :meth:`Upkeep.poke`."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:  # not allowed here: the lane runs at (or nearer) the process's priority
        log.info("upkeep: lane priority not lowered all the way: %s", exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True



def main() -> None:
    """A worker process: open the index named in :data:`WORKER_ENV` and run its upkeep until idle."""
    from gmmlsh.index.index import Index

    logging.basicConfig(level=os.environ.get("GMMLSH_LOG_LEVEL", "warning").upper(),
                        format="%(asctime)s %(levelname)s %(name)s [upkeep %(process)d] %(message)s")
    args = json.loads(os.environ[WORKER_ENV])
    location = args.pop("location")
    try:
        index = Index.open(location, None, create=False, maintain=False, **args)
    except (FileNotFoundError, OSError) as exc:  # the index went away (a test's temporary directory)
        log.info("upkeep worker: cannot open %s: %s", location, exc)
        return
    with index:
        index.upkeep.work()


if __name__ == "__main__":
    main()
