"""The tables of ``bench_operate``: its timelines cut into intervals, its upkeep, its stalls.

Everything here reads the run's records only — query starts and latencies, the writer's
ticks, the upkeep events (all on ``time.monotonic``, seconds) — and prints markdown.
"""

from __future__ import annotations

import numpy as np

from bench.machine_watch import MachineLog


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _pct(lat: np.ndarray, p: float) -> str:
    return _ms(np.percentile(lat, p)) if lat.size else "–"


def _overlap(events: list[dict], t: float, lat: float) -> list[dict]:
    return [e for e in events if e["start"] < t + lat and e["end"] > t]


def intervals(q: dict, writer: dict, events: list[dict], t0: float, seconds: float, bucket: float,
              slow: float, machine: MachineLog) -> list[str]:
    """Per interval: queries/s, p50/p99/max latency, slow queries; rows upserted and ids deleted
    a second by the ticks the writer ran in it, and their worst lag; the CPU time the host took
    from the machine and the kernel's memory stalls (:mod:`bench.machine_watch`); the upkeep
    that started in it."""
    start, lat = np.asarray(q["start"]), np.asarray(q["latency"])
    ticks = np.asarray(writer["ticks"]).reshape(-1, 6)  # due, start, upserted, end, rows, deleted
    L = [f"| interval (s) | queries/s | p50 ms | p99 ms | max ms | > {slow * 1e3:.0f} ms | query errors | "
         "inserts/s | deletes/s | writer lag, max (s) | host steal (CPU s) | "
         "direct compactions, reclaims, file refaults | upkeep started |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    errors = np.asarray([e[0] for e in q["errors"]]) if q["errors"] else np.zeros(0)
    for lo in np.arange(0.0, seconds, bucket):
        hi = min(lo + bucket, seconds)
        sel = (start >= t0 + lo) & (start < t0 + hi)
        ls = lat[sel]
        ts = ticks[(ticks[:, 1] >= t0 + lo) & (ticks[:, 1] < t0 + hi)] if ticks.size else ticks  # by when run
        ups = _started(runs(events), t0 + lo, t0 + hi)
        span = hi - lo
        rows_up, ids_del = (ts[:, 4].sum(), ts[:, 5].sum()) if ts.size else (0, 0)
        lag = f"{(ts[:, 1] - ts[:, 0]).max():.2f}" if ts.size else "–"
        L.append(f"| {lo:.0f}–{hi:.0f} | {ls.shape[0] / span:,.0f} | {_pct(ls, 50)} | {_pct(ls, 99)} | "
                 f"{_pct(ls, 100)} | {int((ls > slow).sum())} | "
                 f"{int(((errors >= t0 + lo) & (errors < t0 + hi)).sum())} | "
                 f"{rows_up / span:,.0f} | {ids_del / span:,.0f} | {lag} | "
                 f"{machine.total(t0 + lo, t0 + hi):.2f} | {_stalls(machine, t0 + lo, t0 + hi)} | {ups} |")
    return L


#: The engine's upkeep tasks (gmmlsh.index.upkeep): list work and tuning.
LIST_KINDS = ("absorb", "merge", "fit")
KINDS = (*LIST_KINDS, "tune")


def runs(events: list[dict]) -> list[dict]:
    """The upkeep tasks among the events (not the mirror's syncs), in the order they started."""
    return sorted((e for e in events if e["kind"] in KINDS), key=lambda r: r["start"])


def _started(rs: list[dict], lo: float, hi: float) -> str:
    """The upkeep tasks that started in [lo, hi), in a few words."""
    rs = [r for r in rs if lo <= r["start"] < hi]
    words = []
    for kind in KINDS:
        d = [r["end"] - r["start"] for r in rs if r["kind"] == kind]
        if d:
            words.append(f"{kind} ×{len(d)} (max {max(d):.1f} s)" if len(d) > 1 else f"{kind} {d[0]:.1f} s")
    return ", ".join(words) or "–"


def upkeep(q: dict, events: list[dict], t0: float, tasks: int = 40) -> list[str]:
    """The upkeep tasks: a summary per kind, then each of the longest ``tasks`` — when, how
    long, what it did, and the queries it overlapped."""
    start, lat = np.asarray(q["start"]), np.asarray(q["latency"])
    rs = runs(events)
    if not rs:
        return ["No upkeep ran during the load."]
    L = ["| upkeep | tasks | seconds, total | p50 | max |", "|---|---:|---:|---:|---:|"]
    for kind in KINDS:
        d = np.array([r["end"] - r["start"] for r in rs if r["kind"] == kind])
        if d.size:
            L.append(f"| {kind} | {d.size:,} | {d.sum():,.1f} | {np.percentile(d, 50):.2f} | {d.max():.2f} |")
    L += ["", "| upkeep task | start (s) | duration (s) | what | queries during it | their max ms |",
          "|---|---:|---:|---|---:|---:|"]
    for r in sorted(sorted(rs, key=lambda r: r["start"] - r["end"])[:tasks], key=lambda r: r["start"]):
        during = (start < r["end"]) & (start + lat > r["start"])
        L.append(f"| {r['kind']} ({r['thread']}) | {r['start'] - t0:,.1f} | {r['end'] - r['start']:,.2f} | "
                 f"{_detail(r.get('detail', {}))} | {int(during.sum()):,} | "
                 f"{_ms(lat[during].max()) if during.any() else '–'} |")
    return L


def _detail(d: dict) -> str:
    keep = ("rows", "segments", "merged", "listed", "fit", "lists", "refit", "chosen", "sample", "trials",
            "widened", "sample_recall_bound", "search_ms", "exact_ms", "truth_seconds", "stale")
    return "; ".join(f"{k} {d[k]}" for k in keep if k in d).replace("|", "/")


def syncs(events: list[dict], query_thread: str, q: dict, answers: int | None = None) -> list[str]:
    """How long applying the writer's changes took on the query thread and elsewhere; with
    ``answers`` (in process), how many queries answered twice (again on a newer view)."""
    out = []
    if answers is not None:
        asked = len(q["latency"])
        out.append(f"- queries answered again on a newer view: {answers - asked:,} of {asked:,}")
    for who, sel in (("the query thread", lambda e: e["thread"] == query_thread),
                     ("upkeep threads", lambda e: e["thread"] != query_thread)):
        d = np.array([e["end"] - e["start"] for e in events if e["kind"] == "sync" and sel(e)])
        if d.size:
            out.append(f"- mirror syncs on {who}: {d.size:,}, p50 {_ms(np.percentile(d, 50))} ms, "
                       f"p99 {_ms(np.percentile(d, 99))} ms, max {_ms(d.max())} ms, total {d.sum():,.1f} s")
    return out


def _stalls(machine: MachineLog, lo: float, hi: float) -> str:
    compactions, reclaims, refaults = machine.stalls_between(lo, hi)
    return f"{compactions:,}, {reclaims:,}, {refaults:,}"


def _over(start: np.ndarray, took: np.ndarray, slow: float, machine: MachineLog) -> tuple[np.ndarray, int, int]:
    """The spans over ``slow`` seconds; in how many the host's steal accounts for the time past
    ``slow``; during how many the kernel stalled a thread compacting or reclaiming memory, or
    read back dropped file pages."""
    over = np.flatnonzero(took > slow)
    hosts = sum(machine.accounts_for(start[i], start[i] + took[i], slow) for i in over)
    kernel = sum(machine.stalls_between(start[i], start[i] + took[i]).any() for i in over)
    return over, int(hosts), int(kernel)


def _worst(start: np.ndarray, took: np.ndarray, over: np.ndarray, events: list[dict], t0: float,
           machine: MachineLog, worst: int, bullet: str) -> list[str]:
    """A line for each of the ``worst`` longest spans ``over``: when, how long, the steal and the
    kernel's stalls around it, the upkeep under way."""
    L = []
    for i in over[np.argsort(-took[over])][:worst]:
        lo, hi = start[i], start[i] + took[i]
        busy = sorted({f"{e['kind']} ({e['thread']})" for e in _overlap(events, lo, took[i])})
        L.append(f"{bullet} at {lo - t0:,.2f} s: {_ms(took[i])} ms; host steal around it {_ms(machine.during(lo, hi))} "
                 f"ms; direct compactions, reclaims, file refaults around it {_stalls(machine, lo, hi)}; "
                 f"under way: {', '.join(busy) or 'no upkeep seen'}")
    return L


def slow_queries(q: dict, events: list[dict], t0: float, slow: float, machine: MachineLog, worst: int = 5
                 ) -> list[str]:
    """The queries slower than ``slow``: how many, how many of them the host's steal or the
    kernel's stalls explain (:func:`_over`), and the worst (:func:`_worst`)."""
    start, lat = np.asarray(q["start"]), np.asarray(q["latency"])
    over, hosts, kernel = _over(start, lat, slow, machine)
    L = [f"Queries slower than {slow * 1e3:.0f} ms: **{over.shape[0]:,}** of {lat.shape[0]:,}"
         + (f"; the worst {_ms(lat.max())} ms." if lat.size else ".")
         + (f" In **{hosts}** of them the host took a CPU for at least the time past {slow * 1e3:.0f} ms "
            f"(`steal`, between the samples around the query): without it they were under the bound. During "
            f"**{kernel}** of them the kernel stalled a thread compacting or reclaiming memory, or read back "
            "dropped file pages."
            if over.size else "")]
    return L + _worst(start, lat, over, events, t0, machine, worst, "-")


def placement(placed: dict[str, list[int]] | None) -> list[str]:
    """Over HTTP: which server worker held the query client's and the writer's connections
    (:func:`bench.sockets.workers_of`, looked up 5 s into the load)."""
    if placed is None:
        return []
    where = "; ".join(f"the {name}'s on worker {', '.join(map(str, pids)) or '?'}" for name, pids in placed.items())
    shared = len({tuple(p) for p in placed.values()}) == 1 and all(placed.values())
    return [f"- connections: {where}" + (" — **one worker served both**" if shared else "")]


def writer_summary(writer: dict, t0: float, seconds: float, target_rows: float, target_deletes: float,
                   slow: float) -> list[str]:
    """What the writer held against its targets, how late it ran, and how many of its writes took
    longer than ``slow`` seconds (the queries' bound: over HTTP, acceptance 4 holds writes to it)."""
    ticks = np.asarray(writer["ticks"]).reshape(-1, 6)
    if not ticks.size:
        return ["The writer wrote nothing."]
    lag = ticks[:, 1] - ticks[:, 0]
    due = int(np.ceil(seconds / writer["period"]))
    upsert_s, delete_s = ticks[:, 2] - ticks[:, 1], ticks[:, 3] - ticks[:, 2]
    L = [f"- writer: {ticks[:, 4].sum() / seconds:,.0f} rows/s upserted (target {target_rows:,.0f}), "
         f"{ticks[:, 5].sum() / seconds:,.0f} ids/s deleted (target {target_deletes:,.0f}); {ticks.shape[0]:,} of "
         f"{due:,} ticks done; lag p50 {np.percentile(lag, 50):.3f} s, max {lag.max():.2f} s"
         f"{' — **fell behind**' if lag.max() > writer['period'] or ticks.shape[0] < due else ''}",
         f"- a batch upsert took p50 {_ms(np.percentile(upsert_s, 50))} ms, max {_ms(upsert_s.max())} ms, "
         f"{int((upsert_s > slow).sum()):,} of {upsert_s.shape[0]:,} over {slow * 1e3:.0f} ms; a tick's deletes "
         f"p50 {_ms(np.percentile(delete_s, 50))} ms, max {_ms(delete_s.max())} ms, {int((delete_s > slow).sum()):,} "
         f"over {slow * 1e3:.0f} ms",
         f"- write errors (each retried until acknowledged): {len(writer['errors'])}"]
    for t, what, why in writer["errors"][:5]:
        L.append(f"  - at {t - t0:,.1f} s, {what}: {why}")
    return L


def slow_upserts(writer: dict, events: list[dict], t0: float, slow: float, machine: MachineLog, worst: int = 5
                 ) -> list[str]:
    """The writer's batch upserts slower than ``slow``, as :func:`slow_queries` tells the queries."""
    ticks = np.asarray(writer["ticks"]).reshape(-1, 6)
    if not ticks.size:
        return []
    start, took = ticks[:, 1], ticks[:, 2] - ticks[:, 1]
    over, hosts, kernel = _over(start, took, slow, machine)
    if not over.size:
        return [f"- no batch upsert over {slow * 1e3:.0f} ms"]
    return [f"- batch upserts over {slow * 1e3:.0f} ms: {over.shape[0]:,}; the host's steal accounts for {hosts}; "
            f"during {kernel} of them the kernel stalled a thread compacting or reclaiming memory, or read back "
            "dropped file pages", *_worst(start, took, over, events, t0, machine, worst, "  -")]
