"""A kill during a collection's creation or deletion leaves it whole or absent (LMDB and Redis).

A child process creates, fills and deletes collections in a tight loop and is SIGKILLed at
a random moment, ``GMMLSH_CRASH_KILLS`` times (default 12) per backend. After each kill:
every listed collection opens with the parameters it was created with and passes the
integrity check; every name not listed can be created afresh (nothing half-made blocks it);
and, once the leftovers are swept, nothing of a dead collection remains on disk or in Redis.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from redis_fixtures import redis_url  # noqa: F401

from gmmlsh.index.collections import Collections
from gmmlsh.index.config import IndexConfig

REPO = Path(__file__).resolve().parents[1]
KILLS = int(os.environ.get("GMMLSH_CRASH_KILLS", "12"))
NAMES = [f"c{j}" for j in range(4)]

CHILD = textwrap.dedent("""
    import sys, numpy as np
    from gmmlsh.index.collections import Collections
    from gmmlsh.index.config import IndexConfig
    loc, prefix, cache = sys.argv[1], sys.argv[2], sys.argv[3]
    opts = {"prefix": prefix, "cache_dir": cache} if loc.startswith("redis") else {}
    rng = np.random.default_rng()
    names = [f"c{j}" for j in range(4)]
    print("ready", flush=True)
    with Collections(loc, **opts) as cols:
        while True:
            name = names[rng.integers(4)]
            if cols.registry.get(name) is None:
                cols.create(name, IndexConfig(dim=3 + int(name[1:]), samples=32), indexed=["k"])
                with cols.open(name, maintain=False) as ix:
                    n = int(rng.integers(1, 50))
                    ix.upsert([str(i) for i in range(n)], rng.random((n, ix.config.dim)) + 0.1, [{"k": 1}] * n)
            else:
                cols.delete(name)
""")


def _leftovers(loc: str, opts: dict) -> list[str]:
    """What of collections not registered is still stored."""
    if not loc.startswith("redis"):
        d = Path(loc) / "collections"
        if not d.exists():
            return []
        linked = {os.readlink(p) for p in d.iterdir() if p.is_symlink() and not p.name.startswith(".")}
        return [p.name for p in d.iterdir() if p.name.startswith(".") and p.name not in linked]
    import redis

    r = redis.Redis.from_url(loc)
    with Collections(loc, **opts) as cols:
        live = {e["prefix"] for e in cols.list()}
    keys = [k.decode() for k in r.scan_iter(f"{{{opts['prefix']}.*", count=1000)]
    return [k for k in keys if k[1:].split(":")[0].rstrip("}") not in live]


def test_a_kill_during_create_or_delete_leaves_a_collection_whole_or_absent(location, tmp_path):
    loc, opts = location
    rng = random.Random(7)
    seen_listed = set()
    mid_operation = 0  # kills that left a half-made or half-removed collection to sweep
    for kill in range(KILLS):
        child = subprocess.Popen([sys.executable, "-c", CHILD, loc, opts.get("prefix", "-"),
                                  opts.get("cache_dir", "-")], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.05, 1.5))
        assert child.poll() is None, child.stderr.read()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        with Collections(loc, **opts) as cols:
            listed = {e["name"]: e for e in cols.list()}
            seen_listed |= set(listed)
            for name, entry in listed.items():  # whole: opens as created, passes the check
                with cols.open(name, maintain=False) as ix:
                    assert ix.config.dim == 3 + int(name[1:]) and ix.config.samples == 32
                    assert ix.indexed == ("k",) and entry["uid"] == ix.config.uid
                    report = ix.check()
                    assert report.ok, (kill, name, report.summary())
            for name in set(NAMES) - set(listed):  # absent: nothing blocks making it afresh
                cols.create(name, IndexConfig(dim=2))
                with cols.open(name, maintain=False) as ix:
                    assert ix.count() == 0 and ix.config.dim == 2
                cols.delete(name)
            mid_operation += bool(_leftovers(loc, opts))
            if opts:
                cols.registry.sweep(older_than=0)
            else:
                cols.sweep()
        assert _leftovers(loc, opts) == [], kill
    assert seen_listed  # the kills did land with collections in place
    print(f"\n{KILLS} kills, {mid_operation} in the middle of a creation or deletion, collections seen: "
          f"{sorted(seen_listed)}")
