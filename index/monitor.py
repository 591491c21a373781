"""The online recall monitor: the recall@10 of the answers an index actually serves.

The tuner plans for a recall target on sample queries (:mod:`gmmlsh.index.tuner`); the
monitor checks what came of it on live traffic. A small share of the queries answered by the
tuned search (sketch or postings; exact answers are exact) is *recorded* — the query as the
kernels saw it and the similarities of the 10 best rows the search scored — and answered
again by exact search, later and elsewhere: in the index's upkeep worker process
(:mod:`gmmlsh.index.upkeep`), at its lower CPU priority, never on a query's thread.

**Query side** (:class:`Recorder`, one per opened index): a query answered by the tuned
search is recorded with probability ``share``, derived so that the exact re-runs cost at most
``budget`` (default :data:`BUDGET`, 2 %) of what the served searches cost: ``share = budget ·
served / exact``, ``served`` the process's running mean of a served search's CPU time and
``exact`` the CPU time of an exact re-run: the worker's running mean of those it ran, and
before it has run one the tuner's measure of the index's exact search (its wall time on all the
threads a query may use, times their number: an over-estimate, so the share starts low rather
than high); where neither is known (the monitor's state was lost), a process records its first
served query alone, for the worker to time. The share is always derived from a measure, never
guessed. Records are kept in memory and written now and then, a
small file each time, to the mirror directory's ``monitor/`` inbox.

**Worker side** (:class:`Checker`): takes the inbox's records, answers each by exact search
over the rows the index had when it was served (rows added since are left out; deletions since
count as they are now), and scores it as the tuner does: the share of its 10 best at or above
the true 10th similarity (ties count). It spends at most ``budget`` of one core's time (records
beyond it are dropped at random, so the sample stays uniform) whatever the traffic.

**The estimate** is kept per *epoch*: the search as tuned (its parameters, the operator's
overrides and the rows it was tuned at). A new tuning starts a new epoch (records served
before it are dropped). The estimate is the mean recall of the epoch's last :data:`WINDOW`
records with a two-sided 90 % interval: each end the tuner's one-sided 95 % normal bound
(:func:`gmmlsh.index.tuner.bound`), with a binomial floor on its width (:func:`interval`).
It lives in the mirror directory's ``monitor.json`` (inside an LMDB index's directory; on the
machine's cache for a Redis one, next to the tuning it measures), so restarts keep it.

**Re-tuning.** At :data:`CHECKS` records of an epoch (and every :data:`WINDOW` // 2 after),
the monitor asks the upkeep for a re-tune when the whole interval lies below the target
(:data:`gmmlsh.index.tuner.TARGET_RECALL`): the recall is then below it with 95 % confidence.
(The lower bound alone falls below the target for a sound tuning too until enough queries are
checked — at a true recall of 0.97, about 100 — and would re-tune it for nothing.) Where the
operator overrode the search, it only reports.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from pathlib import Path

import numpy as np

from gmmlsh.core import parallel
from gmmlsh.core.bundles import Query
from gmmlsh.core.ivf import FIRST_WORDS
from gmmlsh.index import tuner
from gmmlsh.index.mirror import View
from gmmlsh.index.search import Prepared, run_exact_many

log = logging.getLogger("gmmlsh.monitor")

#: Share of the served searches' CPU time the exact re-runs may take (and of one core, whatever
#: the traffic): the default of the ``monitor_budget`` setting; 0 turns the monitor off.
BUDGET = 0.02
#: Records an estimate is made of: the epoch's last this many.
WINDOW = 1024
#: Records of an epoch at which the monitor decides whether to re-tune (then every WINDOW // 2).
CHECKS = (16, 32, 64, 128, 256, 512)
#: A process writes its records to the inbox after this many, or this many seconds.
FLUSH_RECORDS = 8
FLUSH_SECONDS = 10.0
#: Seconds of exact search the worker may run ahead of its budget (a burst), and at most
#: records it takes from the inbox at once.
BURST_SECONDS = 2.0
BATCH = 64
#: Re-tunes remembered in the report.
HISTORY = 10
#: Served queries between looks at the share while it is 0 (no cost measured yet).
RECHECK = 64
#: Two-sided 90 %: each end one-sided 95 %, the tuner's bound below.
Z = tuner.CONFIDENCE_Z

_NO_PLANES = np.zeros(0, np.uint64)
_NO_FIRST = np.zeros(FIRST_WORDS, np.uint64)


def check_budget(budget: float, name: str = "monitor_budget") -> float:
    """The monitor's budget (or fixed share), checked: a share between 0 and 1."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0.0 <= budget <= 1.0:
        raise ValueError(f"{name}: must be a number between 0 and 1, got {budget!r}")
    return float(budget)


def epoch_key(view: View, overrides: dict) -> str:
    """The search as tuned, named: what an estimate is of."""
    return json.dumps({"search": view.search.to_dict(), "tuned_rows": view.tuned_rows,
                       "overrides": overrides}, sort_keys=True)


def interval(recalls: np.ndarray) -> tuple[float, float, float]:
    """(mean, lower, upper) of per-query recalls: the tuner's normal bound (:func:`tuner.bound`:
    ``Z`` standard errors of the mean) on each side, its standard error at least the binomial one
    of the neighbours counted, Agresti–Coull adjusted (``p̃ = (hits + Z²/2) / (N + Z²)`` over
    ``N = 10·n`` neighbours): few queries that all found every neighbour (a sample standard
    deviation of 0) must not make an interval of width 0."""
    n = recalls.shape[0]
    if not n:
        return float("nan"), 0.0, 1.0
    mean = float(recalls.mean())
    if n < 2:
        return mean, 0.0, 1.0
    trials = tuner.NEIGHBORS * n
    adjusted = (mean * trials + Z * Z / 2) / (trials + Z * Z)
    se = max((mean - tuner.bound(recalls)) / Z, np.sqrt(adjusted * (1 - adjusted) / (trials + Z * Z)))
    return mean, max(0.0, mean - Z * se), min(1.0, mean + Z * se)


# --- the query side -------------------------------------------------------------------------------


class Recorder:
    """Records a share of one process's served queries for the monitor (thread-safe)."""

    def __init__(self, directory: str | os.PathLike, budget: float = BUDGET, seed: int | None = None):
        self.dir = Path(directory) / "monitor"
        self.state_path = Path(directory) / "monitor.json"
        self.budget = check_budget(budget)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self._flushed_at = time.monotonic()
        #: Running means (CPU seconds): a served search, this process's; an exact re-run, the worker's.
        self.served_seconds = 0.0
        self.exact_seconds = self._exact_seconds()
        #: A share fixed by hand instead of derived from the budget (a benchmark's, a test's).
        self.fixed_share: float | None = None
        #: Whether this process recorded a query for want of a measured exact cost (once).
        self._probed = False
        #: Served queries to pass before the next look at the share; whether that one is recorded.
        self._next, self._armed = 0, False

    @property
    def share(self) -> float:
        """The share of served queries recorded now (see the module docstring); 0 until both
        costs are known: the first served search measures its own, the tuning the exact one."""
        if self.fixed_share is not None:
            return self.fixed_share
        if self.budget <= 0 or self.exact_seconds <= 0 or self.served_seconds <= 0:
            return 0.0
        return min(1.0, self.budget * self.served_seconds / self.exact_seconds)

    def _exact_seconds(self) -> float:
        self._read_at = time.monotonic()
        try:
            return float(json.loads(self.state_path.read_text()).get("exact_seconds") or 0.0)
        except (OSError, ValueError):
            return 0.0

    def offer(self, view: View, qs: list[Prepared], found: list, seconds: float, overrides: dict) -> None:
        """Queries just answered by the tuned search (``found``: each one's rows and exact
        similarities, ``seconds``: the CPU time their search took; ``overrides``: the operator's):
        record a share of them. Each query is recorded with probability ``share``, drawn as the
        gap to the next recorded one (geometric: the same chance per query, one draw per record),
        so a query that is not recorded costs a subtraction."""
        if not qs or not self.active:
            return
        n = len(qs)
        per = seconds / n
        self.served_seconds = per if self.served_seconds <= 0 else 0.99 * self.served_seconds + 0.01 * per
        j = self._next
        if j >= n:
            self._next = j - n
            return
        if self.exact_seconds <= 0 and time.monotonic() - self._read_at > 1.0:  # tuned since we looked?
            self.exact_seconds = self._exact_seconds()
        if self.exact_seconds <= 0 and self.fixed_share is None and not self._probed:
            # nothing measured an exact re-run: this query alone, to have one timed
            self._probed, self._flushed_at, self._armed = True, float("-inf"), True
        key = None
        while j < n:
            if self._armed:
                key = key or epoch_key(view, overrides)
                self._record(view, qs[j], found[j][1], key, overrides)
                j += 1
            share = self.share
            self._armed = share > 0
            j += self._gap(share) if share > 0 else RECHECK
        self._next = j - n

    def _gap(self, share: float) -> int:
        """Queries passed over before the next recorded one, each recorded with chance ``share``."""
        if share >= 1.0:
            return 0
        return int(math.log(1.0 - self._rng.random()) / math.log1p(-share))

    def _record(self, view: View, p: Prepared, sims: np.ndarray, key: str, overrides: dict) -> None:
        nz = p.coordinates()
        top = np.sort(sims)[::-1][:tuner.NEIGHBORS]
        with self._lock:
            self._records.append({
                "indices": np.asarray(nz, np.int32), "values": p.q.dense[nz].astype(np.float64),
                "norm": float(p.q.norm),
                "exclude": int(view.iid[p.exclude]) if 0 <= p.exclude < view.rows else -1,
                "rows": view.rows, "sims": np.pad(top, (0, tuner.NEIGHBORS - top.shape[0]), constant_values=-1.0),
                "at": time.time(), "key": key, "overridden": bool(overrides)})

    @property
    def active(self) -> bool:
        """Whether served queries are offered at all (the monitor is on)."""
        return self.fixed_share > 0 if self.fixed_share is not None else self.budget > 0

    @property
    def held(self) -> int:
        """Records not yet written to the inbox."""
        return len(self._records)

    def due(self) -> bool:
        return bool(self._records) and (len(self._records) >= FLUSH_RECORDS
                                        or time.monotonic() - self._flushed_at > FLUSH_SECONDS)

    def flush(self) -> int:
        """Write the records held to the inbox (one file); returns how many."""
        with self._lock:
            records, self._records = self._records, []
            self._flushed_at = time.monotonic()
        if not records:
            return 0
        self.dir.mkdir(exist_ok=True)
        name = f"{time.time_ns():020d}-{os.getpid()}-{threading.get_ident()}"
        tmp = self.dir / f".{name}.tmp.npz"
        lengths = np.array([r["indices"].shape[0] for r in records], np.int64)
        np.savez(tmp, indptr=np.concatenate([[0], np.cumsum(lengths)]),
                 indices=np.concatenate([r["indices"] for r in records]),
                 values=np.concatenate([r["values"] for r in records]),
                 norm=np.array([r["norm"] for r in records]), exclude=np.array([r["exclude"] for r in records]),
                 rows=np.array([r["rows"] for r in records], np.int64), sims=np.stack([r["sims"] for r in records]),
                 at=np.array([r["at"] for r in records]),
                 keys=np.array(json.dumps([[r["key"], r["overridden"]] for r in records])))
        os.replace(tmp, self.dir / f"{name}.npz")
        self.exact_seconds = self._exact_seconds()
        return len(records)


def pending(directory: str | os.PathLike) -> bool:
    """Whether the inbox of a mirror directory holds records (one directory listing)."""
    try:
        with os.scandir(Path(directory) / "monitor") as it:
            return any(e.name.endswith(".npz") and not e.name.startswith(".") for e in it)
    except OSError:
        return False


# --- the estimate ---------------------------------------------------------------------------------


def _fresh(tuned_at: float = 0.0) -> dict:
    return {"key": None, "started": tuned_at, "recalls": [], "checked": 0, "next_check": CHECKS[0],
            "overridden": False, "retune": None, "retunes": [], "previous": None, "exact_seconds": 0.0,
            "exact_measured": False,
            "spent_seconds": 0.0, "total_checked": 0, "dropped": 0, "tuned_at": tuned_at}


def read_state(directory: str | os.PathLike) -> dict:
    """The monitor's state in a mirror directory (a fresh one when there is none)."""
    try:
        state = json.loads((Path(directory) / "monitor.json").read_text())
    except (OSError, ValueError):
        return _fresh()
    return {**_fresh(), **state}


def _write_state(directory: Path, state: dict) -> None:
    tmp = directory / f"monitor.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, directory / "monitor.json")


def report(directory: str | os.PathLike, budget: float | None = None, share: float | None = None) -> dict:
    """What ``stats()`` shows of the monitor: the current epoch's estimate, interval and counts,
    what it did, and what it costs."""
    state = read_state(directory)
    recalls = np.array(state["recalls"], np.float64)
    mean, lower, upper = interval(recalls)
    out: dict = {"target": tuner.TARGET_RECALL, "checked": state["checked"],
                 "estimate": None if np.isnan(mean) else round(mean, 4),
                 "lower": round(lower, 4) if recalls.shape[0] >= 2 else None,
                 "upper": round(upper, 4) if recalls.shape[0] >= 2 else None,
                 "window": int(recalls.shape[0]), "total_checked": state["total_checked"],
                 "dropped_over_budget": state["dropped"], "retunes": state["retunes"],
                 "exact_ms": round(1e3 * state["exact_seconds"], 3), "since": state["started"] or None,
                 "previous": state["previous"]}
    if state["retune"]:
        out["retune_requested"] = state["retune"]
    if state["overridden"] and recalls.shape[0] >= 2 and upper < tuner.TARGET_RECALL:
        out["note"] = "below the target; the search is overridden by the operator: reported, not re-tuned"
    if budget is not None:
        out["budget"] = budget
    if share is not None:
        out["share"] = round(share, 6)
    return out


# --- the worker side ------------------------------------------------------------------------------


class Checker:
    """Answers recorded queries exactly and keeps the estimate (in the upkeep worker process)."""

    def __init__(self, mirror, config, budget: float = BUDGET, overrides: dict | None = None,
                 seed: int | None = None, budgeted: bool = True):
        self.mirror = mirror
        self.dir: Path = mirror.dir
        self.config = config
        self.budget = check_budget(budget)
        self.overrides = overrides or {}
        self._rng = np.random.default_rng(seed)
        self._started = time.monotonic()
        self._spent = 0.0
        self.budgeted = budgeted

    def _allowance(self) -> float:
        """CPU seconds of exact search the budget allows now (unbounded when not ``budgeted``:
        :meth:`Upkeep.run_now <gmmlsh.index.upkeep.Upkeep.run_now>` checks everything)."""
        if not self.budgeted:
            return float("inf")
        return self.budget * (time.monotonic() - self._started) + BURST_SECONDS - self._spent

    def _take(self) -> list[dict]:
        """Every record of the inbox, its files removed (oldest first)."""
        inbox = self.dir / "monitor"
        try:
            names = sorted(n for n in os.listdir(inbox) if n.endswith(".npz") and not n.startswith("."))
        except OSError:
            return []
        out = []
        for name in names:
            path = inbox / name
            try:
                with np.load(path) as d:
                    keys = json.loads(str(d["keys"]))
                    for i, (key, overridden) in enumerate(keys):
                        lo, hi = d["indptr"][i], d["indptr"][i + 1]
                        out.append({"indices": d["indices"][lo:hi], "values": d["values"][lo:hi],
                                    "norm": float(d["norm"][i]), "exclude": int(d["exclude"][i]),
                                    "rows": int(d["rows"][i]), "sims": d["sims"][i], "at": float(d["at"][i]),
                                    "key": key, "overridden": bool(overridden)})
            except (OSError, ValueError, KeyError) as exc:  # a torn or foreign file: not a record
                log.warning("monitor: unreadable record file %s dropped: %s", name, exc)
            path.unlink(missing_ok=True)
        return out

    def run(self) -> int:
        """Check what the inbox holds (within the budget); returns how many records were checked.
        The exact searches run outside the state's lock (a new tuning may end the epoch meanwhile:
        what they found is then added as a straggler, or dropped)."""
        records = self._take()
        if not records:
            return 0
        state = read_state(self.dir)
        cost, measured = state["exact_seconds"], state["exact_measured"]
        checked: list[tuple[dict, float]] = []
        dropped, spent = 0, 0.0
        for lo in range(0, len(records), BATCH):
            batch = records[lo:lo + BATCH]
            allowed = self._allowance()
            fits = len(batch) if cost <= 0 or allowed == float("inf") else \
                max(0, min(len(batch), int(allowed / cost)))
            if allowed <= 0:
                fits = 0
            if fits < len(batch):  # what the allowance pays for, drawn at random
                dropped += len(batch) - fits
                batch = [batch[i] for i in sorted(self._rng.choice(len(batch), fits, replace=False))]
            if not batch:
                continue
            t0 = time.thread_time()
            recalls = self._recalls(batch)
            took = time.thread_time() - t0
            self._spent += took
            spent += took
            per = took / len(batch)
            cost = 0.8 * cost + 0.2 * per if measured else per  # the tuning's stand-in gives way at once
            measured = True
            checked += zip(batch, recalls, strict=True)
        with self.mirror.locked("monitor"):
            state = read_state(self.dir)
            state["exact_seconds"], state["exact_measured"] = cost, measured
            state["spent_seconds"] += spent
            state["dropped"] += dropped
            for r, recall in checked:
                if r["at"] >= state["tuned_at"]:  # else served before the last tuning
                    self._add(state, r, recall)
            _write_state(self.dir, state)
        return len(checked)

    def _recalls(self, batch: list[dict]) -> list[float]:
        """Each record's recall@10 against exact search over the rows of its time."""
        view = self.mirror.refresh()
        out: list[float] = [0.0] * len(batch)
        by_rows: dict[int, list[int]] = {}
        for i, r in enumerate(batch):
            by_rows.setdefault(min(r["rows"], view.rows), []).append(i)
        for rows, members in by_rows.items():
            alive = np.array(view.alive[:view.rows])
            alive[rows:] = 0
            then = view.restricted(alive, int(np.count_nonzero(alive)))
            qs = [self._prepared(then, batch[i]) for i in members]
            for i, (_, sims, _) in zip(members, run_exact_many(then, qs, tuner.NEIGHBORS), strict=True):
                out[i] = served_recall(batch[i]["sims"], sims)
        return out

    def _prepared(self, view: View, r: dict) -> Prepared:
        dense = np.zeros(self.config.dim)
        dense[r["indices"]] = r["values"]
        exclude = view.row_of(r["exclude"]) if r["exclude"] >= 0 else -1
        return Prepared(Query(_NO_PLANES, _NO_FIRST, dense, r["norm"], int(exclude)),
                        nonzero=np.asarray(r["indices"], np.int64))

    def _add(self, state: dict, r: dict, recall: float) -> None:
        """One checked record into its epoch; at a checkpoint, decide whether to re-tune."""
        if r["key"] != state["key"]:
            if r["at"] < state["started"]:
                return  # a straggler of an epoch already closed
            _close_epoch(state)
            state.update(key=r["key"], started=r["at"], overridden=r["overridden"])
        state["recalls"] = (state["recalls"] + [recall])[-WINDOW:]
        state["checked"] += 1
        state["total_checked"] += 1
        if state["checked"] < state["next_check"]:
            return
        state["next_check"] = next((c for c in CHECKS if c > state["checked"]), state["checked"] + WINDOW // 2)
        mean, lower, upper = interval(np.array(state["recalls"]))
        if upper >= tuner.TARGET_RECALL or state["overridden"] or state["retune"]:
            return
        state["retune"] = {"at": time.time(), "checked": state["checked"], "estimate": round(mean, 4),
                           "upper": round(upper, 4), "key": state["key"]}
        log.warning("recall monitor: recall@10 %.3f (90 %% interval %.3f-%.3f over %d queries) is below the "
                    "target %.2f: re-tuning", mean, lower, upper, len(state["recalls"]), tuner.TARGET_RECALL)


def served_recall(served: np.ndarray, exact: np.ndarray) -> float:
    """Recall@10 of a served answer's best similarities (``-1``: no row) against the exact ones:
    the share at or above the true 10th (ties count, as the tuner counts them)."""
    if not exact.shape[0]:
        return 1.0
    tenth = np.sort(exact)[::-1][min(tuner.NEIGHBORS, exact.shape[0]) - 1]
    want = min(tuner.NEIGHBORS, exact.shape[0])
    return min(want, int(np.count_nonzero(served >= tenth - 1e-9))) / want


def _close_epoch(state: dict) -> None:
    """Keep a summary of the epoch that ends and start afresh."""
    if state["checked"]:
        mean, lower, upper = interval(np.array(state["recalls"]))
        state["previous"] = {"checked": state["checked"], "estimate": round(mean, 4), "lower": round(lower, 4),
                             "upper": round(upper, 4), "since": state["started"]}
    state.update(key=None, recalls=[], checked=0, next_check=CHECKS[0], retune=None, overridden=False)


def tuned(directory: str | os.PathLike, lock, report_: dict | None = None) -> None:
    """A new tuning was published: the epoch ends (records served before now are dropped), a
    re-tune the monitor asked for is recorded as done, and, until the worker has timed an exact
    re-run, the tuning's measure of the exact search (``report_["exact_ms"]``, on up to
    :func:`parallel.threads` threads) stands for its CPU time, so the recorders' share is derived
    from the first query on."""
    directory = Path(directory)
    with lock("monitor"):
        state = read_state(directory)
        if not state["exact_measured"] and (report_ or {}).get("exact_ms"):
            state["exact_seconds"] = report_["exact_ms"] / 1e3 * parallel.threads()
        if state["retune"]:
            state["retunes"] = (state["retunes"] + [{**state["retune"], "done": time.time(),
                                                     "chosen": (report_ or {}).get("chosen")}])[-HISTORY:]
        _close_epoch(state)
        state["tuned_at"] = state["started"] = time.time()
        _write_state(directory, state)


def retune_requested(directory: str | os.PathLike, view: View) -> bool:
    """Whether the monitor asked for a re-tune of the search now tuned."""
    asked = read_state(directory)["retune"]
    if not asked:
        return False
    key = json.loads(asked["key"])
    return key["tuned_rows"] == view.tuned_rows and key["search"] == view.search.to_dict()
