"""``gmmlsh info``, ``check`` and ``snapshot``: an index's facts, its integrity, a hot copy."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gmmlsh.index.store.location import describe
from gmmlsh.service.cli.common import (
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    Formatter,
    UsageError,
    add_store,
    describe_search,
    location,
    open_index,
)


def add(sub) -> None:
    p = sub.add_parser("info", help="parameters, counts, search and size of an index",
                       description="Show an index's parameters, vector count, the search it tuned for itself, "
                       "and its size.", epilog="Examples:\n  gmmlsh info --index ./idx\n"
                       "  gmmlsh info --redis redis://localhost:6379/0 --prefix news --json",
                       formatter_class=Formatter)
    add_store(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=info)

    p = sub.add_parser("check", help="integrity check of an index", description=CHECK_HELP,
                       epilog="Examples:\n  gmmlsh check --index ./idx\n"
                       "  gmmlsh check --redis redis://localhost:6379/0 --prefix news --json",
                       formatter_class=Formatter)
    add_store(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=check)

    p = sub.add_parser("snapshot", help="hot copy of an LMDB index (backup)", description=SNAPSHOT_HELP,
                       epilog="Examples:\n  gmmlsh snapshot --index ./idx ./backups/idx-2026-06-01\n"
                       "  gmmlsh snapshot --index ./idx ./backups/latest --verify", formatter_class=Formatter)
    p.add_argument("dest", metavar="DEST", help="new (or empty) directory for the copy")
    add_store(p)
    p.add_argument("--verify", action="store_true", help="run the integrity check on the copy")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=snapshot)


def info(args) -> int:
    from gmmlsh.index.ingest.build import human_bytes

    kind, loc, prefix = location(args)
    with open_index(args, maintain=False) as index:
        stats = index.stats()
    if args.json:
        print(json.dumps({"location": describe(loc, prefix), **stats}, default=str))
        return EXIT_OK
    cfg, search, mirror, store = stats["config"], stats["search"], stats["mirror"], stats["store"]
    store_bytes = store.get("bytes") or store.get("redis_used_memory")
    rows = [
        ("index", describe(loc, prefix)),
        ("vectors", f"{stats['count']:,}"),
        ("store", f"{human_bytes(store_bytes)}" + (" (the whole Redis server)" if kind == "redis" else "")),
        ("dimension", f"{cfg['dim']:,}"),
        ("sketch", f"{cfg['samples']} samples, {cfg['bits']} bits each"
                   + (f", t_bits {cfg['t_bits']}" if cfg.get("t_bits") else "") + f", seed {cfg['seed']}"),
        ("nrff", f"{cfg['nrff_k']} features, γ = {cfg['gamma']}" if cfg.get("nrff_k") else "off"),
        ("centre", "none" if cfg.get("center") is None else f"{len(cfg['center'])} values"),
        ("mirror", f"{mirror['rows']:,} rows on this machine, {human_bytes(mirror['disk_bytes'])}; "
                   f"{mirror['lists']:,} lists over {mirror['listed_rows']:,} rows, {mirror['tail_rows']:,} rows not "
                   "listed yet"),
        ("search", describe_search(search)),
        ("recall", describe_recall(stats["recall"])),
        ("served", f"{stats['served']['seen']:,} queries served and kept in a sample of {stats['served']['queries']:,} "
                   "(the tuner's)"),
        ("format", f"version {cfg.get('format_version')}, generator {cfg.get('generator_version')}"),
    ]
    for k, v in rows:
        print(f"{k:<10} {v}")
    return EXIT_OK


CHECK_HELP = """\
Check an index's integrity by a full scan of the store (every id names a whole
record that names it back; every record decodes, has its true L1 norm and a
sketch equal to a re-hash of its vector; no field outlives its record; the
count is exact) and of this machine's search mirror (it holds exactly the live
records, as stored; its lists cover every listed live row once). It only reads,
so it runs on a full disk too: the mirror is checked as it stands, and vectors
written since it last caught up are counted ("behind the store"), not reported.
Exit code 0 when sound, 1 when problems are found. Check a quiet index (or a
snapshot): a write landing during the scan can look like a problem. A damaged
mirror is repaired by deleting its directory: it is rebuilt from the store.
"""


def describe_recall(rec: dict) -> str:
    """The recall monitor's report (:func:`gmmlsh.index.monitor.report`) in a line."""
    if rec.get("estimate") is None:
        line = "no served query of this tuning checked yet"
    else:
        line = f"{rec['estimate']:.3f} measured on {rec['checked']:,} served queries answered again by exact search"
        if rec.get("lower") is not None:
            line += f" (90 % interval {rec['lower']:.3f}-{rec['upper']:.3f})"
    line += f"; target {rec['target']:.2f}"
    if rec.get("note"):
        line += f"; {rec['note']}"
    if rec.get("retunes"):
        line += f"; {len(rec['retunes'])} re-tune(s) the monitor asked for"
    return line


def check(args) -> int:
    with open_index(args, maintain=False) as index:
        report = index.check()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.summary())
    return EXIT_OK if report.ok else EXIT_RUNTIME


SNAPSHOT_HELP = """\
Write a consistent copy of an LMDB index to a new directory while it is in use
(one read transaction: writers go on, the copy holds exactly the batches
committed when it started). The copy is complete or absent, never partial; its
search mirror is rebuilt on first use. Restore: stop the server, then serve the
snapshot directory (or move it where the index was); `gmmlsh check --index DEST`
verifies it.

Redis keeps its own backups: run BGSAVE and copy dump.rdb, or copy the AOF
directory (appendonly yes); this command exits 2 for a Redis index.
"""


def snapshot(args) -> int:
    from gmmlsh.index.index import Index

    kind, loc, _ = location(args)
    if kind == "redis":
        print("gmmlsh snapshot: a Redis index is backed up by Redis itself: run `redis-cli BGSAVE` and copy "
              "dump.rdb once `LASTSAVE` changes, or copy the append-only directory (appendonly yes); "
              "see the README's 'Backups' section", file=sys.stderr)
        return EXIT_USAGE
    dest = Path(args.dest)
    if dest.resolve() == Path(loc).resolve():
        raise UsageError("DEST is the index itself; give a new directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not an empty directory; a snapshot never overwrites")
    t0 = time.monotonic()
    with open_index(args, maintain=False) as index:
        n = index.count()
        index.snapshot(dest)
    seconds = time.monotonic() - t0
    size = (dest / "data.mdb").stat().st_size
    out: dict = {"snapshot": str(dest), "vectors": n, "bytes": size, "seconds": round(seconds, 3)}
    if args.verify:
        with Index.open(str(dest), None, create=False, maintain=False) as copy:
            report = copy.check()
        out["check"] = {"ok": report.ok, "summary": report.summary()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"snapshot of {n:,} vectors written to {dest} ({size:,} bytes, {seconds:.2f} s)")
        if args.verify:
            print("check: " + out["check"]["summary"])
    return EXIT_OK if out.get("check", {"ok": True})["ok"] else EXIT_RUNTIME
