"""The tables of ``bench_operate``: its timelines cut into intervals, its upkeep, its stalls.

Everything here reads the run's records only — query starts and latencies, the writer's
ticks, the upkeep events (all on ``time.monotonic``, seconds) — and prints markdown.
"""

from __future__ import annotations

import numpy as np


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _pct(lat: np.ndarray, p: float) -> str:
    return _ms(np.percentile(lat, p)) if lat.size else "–"


def _overlap(events: list[dict], t: float, lat: float) -> list[dict]:
    return [e for e in events if e["start"] < t + lat and e["end"] > t]


def intervals(q: dict, writer: dict, events: list[dict], t0: float, seconds: float, bucket: float,
              slow: float) -> list[str]:
    """Per interval: queries/s, p50/p99/max latency, slow queries; rows upserted and ids deleted
    a second by the ticks the writer ran in it, and their worst lag; the upkeep that started in it."""
    start, lat = np.asarray(q["start"]), np.asarray(q["latency"])
    ticks = np.asarray(writer["ticks"]).reshape(-1, 6)  # due, start, upserted, end, rows, deleted
    L = [f"| interval (s) | queries/s | p50 ms | p99 ms | max ms | > {slow * 1e3:.0f} ms | query errors | "
         "inserts/s | deletes/s | writer lag, max (s) | upkeep started |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
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
                 f"{rows_up / span:,.0f} | {ids_del / span:,.0f} | {lag} | {ups} |")
    return L


def _worth(e: dict) -> bool:
    """An upkeep event that did something (not a maintain call that found nothing due)."""
    return not (e["kind"] == "maintain" and "nothing" in e.get("detail", {}))


def runs(events: list[dict]) -> list[dict]:
    """Upkeep runs: each ``maintain`` call that did something, with the list build and the
    tuning inside it; a list build or tuning seen outside any (over HTTP) is a run of its own."""
    inner = [e for e in events if e["kind"] in ("lists", "tune")]
    out, used = [], set()
    for m in (e for e in events if e["kind"] == "maintain" and _worth(e)):
        parts = [i for i, e in enumerate(inner)
                 if e["thread"] == m["thread"] and m["start"] <= e["start"] and e["end"] <= m["end"]]
        used.update(parts)
        out.append({**m, "parts": [inner[i] for i in parts]})
    out += [{**e, "parts": [e]} for i, e in enumerate(inner) if i not in used]
    return sorted(out, key=lambda r: r["start"])


def _part_s(run: dict, kind: str) -> float | None:
    d = [e["end"] - e["start"] for e in run["parts"] if e["kind"] == kind]
    return sum(d) if d else None


def _started(rs: list[dict], lo: float, hi: float) -> str:
    """The upkeep runs that started in [lo, hi), in a few words."""
    rs = [r for r in rs if lo <= r["start"] < hi]
    if any(r.get("seen_between_polls") for r in rs):  # over HTTP: counts only
        kinds = [r["kind"] for r in rs]
        return ", ".join(f"{k} ×{kinds.count(k)}" for k in ("lists", "tune") if k in kinds) + " (seen in /stats)"
    lists = [d for r in rs if (d := _part_s(r, "lists")) is not None]
    tunes = [d for r in rs if (d := _part_s(r, "tune")) is not None]
    words = ([f"lists ×{len(lists)} (max {max(lists):.1f} s)"] if lists else []) + \
        [f"re-tune {d:.1f} s" for d in tunes]
    return ", ".join(words) or "–"


def upkeep(q: dict, events: list[dict], t0: float) -> list[str]:
    """Each upkeep run: when, how long (its list build and tuning apart), what it did, and the
    queries it overlapped."""
    start, lat = np.asarray(q["start"]), np.asarray(q["latency"])
    rs = runs(events)
    if not rs:
        return ["No upkeep ran during the load."]
    L = ["| upkeep run | start (s) | duration (s) | lists (s) | tuning (s) | what | queries during it | "
         "their max ms |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rs:
        during = (start < r["end"]) & (start + lat > r["start"])
        lists, tune = _part_s(r, "lists"), _part_s(r, "tune")
        what = "; ".join(_detail(e.get("detail", {})) for e in r["parts"]) or _detail(r.get("detail", {}))
        if r.get("seen_between_polls"):  # over HTTP: it ended between two polls of /stats, duration unknown
            lists = tune = None
            what = f"ended between {r['start'] - t0:,.1f} and {r['end'] - t0:,.1f} s: {what}"
        took = "?" if r.get("seen_between_polls") else f"{r['end'] - r['start']:,.2f}"
        L.append(f"| {r['kind']} ({r['thread']}) | {r['start'] - t0:,.1f} | {took} | "
                 f"{'–' if lists is None else f'{lists:.2f}'} | {'–' if tune is None else f'{tune:.2f}'} | "
                 f"{what} | {int(during.sum()):,} | {_ms(lat[during].max()) if during.any() else '–'} |")
    return L


def _detail(d: dict) -> str:
    return "; ".join(f"{k} {v}" for k, v in d.items() if k != "params").replace("|", "/")


def syncs(events: list[dict], query_thread: str) -> list[str]:
    """How long applying the writer's changes took on the query thread and elsewhere."""
    out = []
    for who, sel in (("the query thread", lambda e: e["thread"] == query_thread),
                     ("upkeep threads", lambda e: e["thread"] != query_thread)):
        d = np.array([e["end"] - e["start"] for e in events if e["kind"] == "sync" and sel(e)])
        if d.size:
            out.append(f"- mirror syncs on {who}: {d.size:,}, p50 {_ms(np.percentile(d, 50))} ms, "
                       f"p99 {_ms(np.percentile(d, 99))} ms, max {_ms(d.max())} ms, total {d.sum():,.1f} s")
    return out


def slow_queries(q: dict, events: list[dict], t0: float, slow: float, worst: int = 5) -> list[str]:
    """The queries slower than ``slow``: how many, and the worst, with the upkeep under way then."""
    start, lat = np.asarray(q["start"]), np.asarray(q["latency"])
    over = np.flatnonzero(lat > slow)
    L = [f"Queries slower than {slow * 1e3:.0f} ms: **{over.shape[0]:,}** of {lat.shape[0]:,}"
         + (f"; the worst {_ms(lat.max())} ms." if lat.size else ".")]
    for i in over[np.argsort(-lat[over])][:worst]:
        busy = sorted({f"{e['kind']} ({e['thread']})" for e in _overlap(events, start[i], lat[i]) if _worth(e)})
        L.append(f"- at {start[i] - t0:,.2f} s: {_ms(lat[i])} ms; under way: {', '.join(busy) or 'no upkeep seen'}")
    return L


def writer_summary(writer: dict, t0: float, seconds: float, target_rows: float, target_deletes: float
                   ) -> list[str]:
    """What the writer held against its targets, and how late it ran."""
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
         f"- a batch upsert took p50 {_ms(np.percentile(upsert_s, 50))} ms, max {_ms(upsert_s.max())} ms; "
         f"a tick's deletes p50 {_ms(np.percentile(delete_s, 50))} ms, max {_ms(delete_s.max())} ms",
         f"- write errors (each retried until acknowledged): {len(writer['errors'])}"]
    for t, what, why in writer["errors"][:5]:
        L.append(f"  - at {t - t0:,.1f} s, {what}: {why}")
    return L
