"""Faults under load in the sharded layout (issue 32, acceptance 4 and 6).

A Redis Cluster of 3 masters with a replica each (``--port`` … ``--port``+5, node timeout
1.5 s), an index of Fashion-MNIST rows (16 id-shards), 2 groups × 2 search nodes sharing a
snapshots directory, and a router. A writer (upserts of new ids, and deletes, through the
router; each acknowledged write is looked for at once by an exact query: read-your-writes)
and a reader (the index's own search, k = 10) run throughout, bounded in time. Phases, one
after another:

1. baseline;
2. SIGKILL a search node, restart it on its disk (it catches up from its state);
3. wipe a node's disk and restart it: it starts from its group's snapshot (Redis'
   ``INFO commandstats``: HMGET calls during its start, against a replay);
4. SIGKILL the Redis master of an id-shard: its replica is promoted, the old master is started
   again and rejoins as the new one's replica. With ``--wait 1`` (``GMMLSH_REDIS_WAIT``, the
   default here) a write is acknowledged once a replica holds it, so nothing acknowledged is
   lost; writes to a master without a live replica fail (503) until it has one. With
   ``--wait 0`` writes acknowledged in the master's last moments may be lost: counted, and
   only the shards that went back are resynced — the nodes' logs say which;
5. ``redis-cli --cluster reshard`` of 3,000 slots under load;
6. SIGSTOP one replica of a group for 5 s (the router hedges to the other);
7. grow G from 2 to 4 while serving: the router switches once the 4 new nodes are ready;
   exact answers before and after are compared, and Redis' key count is unchanged.

At the end every acknowledged upsert is read back (GET /vectors) and every acknowledged
delete must be gone. Per phase: queries answered and failed (by status), p50/p99, writes
acknowledged and failed, read-your-writes misses.

    python -m bench.bench_shard_faults --rows 6000 --phase-seconds 15
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.bench_shards import Proc
from bench.common import DATA

PREFIX = "faults"


def cli(port: int, *args: str, timeout: float = 120) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=timeout).stdout


def redis_node(work: Path, p: int) -> subprocess.Popen:
    """The Cluster's node on port ``p`` (its data and ``nodes.conf`` in ``work``: a restart rejoins)."""
    d = work / f"redis{p}"
    d.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--dir", str(d), "--cluster-enabled", "yes",
         "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1500", "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def start_cluster(work: Path, port: int) -> dict[int, subprocess.Popen]:
    procs = {p: redis_node(work, p) for p in range(port, port + 6)}
    time.sleep(1.0)
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in range(port, port + 6)],
                    "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=120)
    wait_ok(port)
    return procs


def wait_ok(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "cluster_state:ok" in cli(port, "cluster", "info"):
            return
        time.sleep(0.2)
    raise TimeoutError("cluster not ok")


def masters(port: int) -> dict[str, dict]:
    """Masters by node id: port and slot ranges."""
    out = {}
    for line in cli(port, "cluster", "nodes").splitlines():
        f = line.split()
        if "master" in f[2] and "fail" not in f[2]:
            out[f[0]] = {"port": int(f[1].split(":")[1].split("@")[0]), "slots": f[8:]}
    return out


def owner(port: int, slot: int) -> dict:
    for node_id, m in masters(port).items():
        for r in m["slots"]:
            if r.startswith("["):
                continue
            lo, _, hi = r.partition("-")
            if int(lo) <= slot <= int(hi or lo):
                return {"id": node_id, **m}
    raise LookupError(slot)


def hmget_calls(port: int) -> int:
    total = 0
    for m in masters(port).values():
        for line in cli(m["port"], "info", "commandstats").splitlines():
            if line.startswith("cmdstat_hmget:"):
                total += int(line.split("calls=")[1].split(",")[0])
    return total


def data_keys(port: int) -> int:
    """Keys of the index's records in the Cluster (not the nodes' announcements or leases)."""
    total = 0
    for m in masters(port).values():
        keys = cli(m["port"], "--scan", "--pattern", f"{{{PREFIX}:*").split()
        total += len(keys)
    return total


class Load:
    """The writer and the reader, recording by phase."""

    def __init__(self, url: str, X: np.ndarray, Q: np.ndarray):
        self.url, self.X, self.Q = url, X, Q
        self.phase = "setup"
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.lock = threading.Lock()
        self.stats: dict[str, dict] = {}
        self.acked: dict[str, np.ndarray] = {}
        self.deleted: set[str] = set()

    def _rec(self, key: str, value) -> None:
        with self.lock:
            s = self.stats.setdefault(self.phase, {"queries": Counter(), "took": [], "writes": Counter(),
                                                   "ryw_miss": 0, "hedged": 0})
            if key == "took":
                s["took"].append(value)
            elif key == "ryw_miss":
                s["ryw_miss"] += 1
            else:
                s[key][value] += 1

    def reader(self) -> None:
        rng = np.random.default_rng(1)
        with httpx.Client(timeout=30, headers={"content-type": "application/octet-stream"}) as c:
            while not self.stop.is_set():
                q = self.Q[rng.integers(self.Q.shape[0])]
                t0 = time.perf_counter()
                try:
                    r = c.post(self.url + "/neighbors/search", content=q.astype("<f4").tobytes(), params={"k": 10})
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self._rec("queries", status)
                if status == 200:
                    self._rec("took", time.perf_counter() - t0)
                time.sleep(0.01)

    def writer(self) -> None:
        rng = np.random.default_rng(2)
        n = 0
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.05)
                    continue
                ext = f"w{n}"
                n += 1
                v = (self.X[rng.integers(self.X.shape[0])] + rng.integers(1, 30, self.X.shape[1])).astype(np.float32)
                try:
                    r = c.post(self.url + "/vectors", json={"id": ext, "values": v.tolist()})
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self._rec("writes", status)
                if status != 200:
                    time.sleep(0.05)
                    continue
                with self.lock:
                    self.acked[ext] = v
                try:
                    q = c.post(self.url + "/neighbors/search", content=v.astype("<f4").tobytes(),
                               params={"k": 1, "mode": "exact"}, headers={"content-type": "application/octet-stream"})
                    if q.status_code == 200 and q.json()["results"][0]["neighbors"][0]["id"] != ext:
                        self._rec("ryw_miss", 1)
                except httpx.HTTPError:
                    pass
                if n % 10 == 0:  # delete an earlier one
                    victim = f"w{n - 5}"
                    if victim in self.acked:
                        try:
                            d = c.delete(self.url + f"/vectors/{victim}")
                            if d.status_code == 200:
                                with self.lock:
                                    self.deleted.add(victim)
                                    self.acked.pop(victim, None)
                        except httpx.HTTPError:
                            pass
                time.sleep(0.02)

    def summary(self) -> dict:
        out = {}
        for phase, s in self.stats.items():
            took = np.array(s["took"]) * 1000 if s["took"] else np.zeros(1)
            out[phase] = {"queries": dict(s["queries"]), "p50_ms": round(float(np.percentile(took, 50)), 1),
                          "p99_ms": round(float(np.percentile(took, 99)), 1), "max_ms": round(float(took.max()), 1),
                          "writes": dict(s["writes"]), "ryw_miss": s["ryw_miss"]}
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--phase-seconds", type=float, default=15.0)
    ap.add_argument("--port", type=int, default=7020, help="first of the Cluster's 6 ports")
    ap.add_argument("--wait", type=int, default=1, help="replicas a write waits for (GMMLSH_REDIS_WAIT)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.index import Index

    d = np.load(DATA / "fashion-mnist.npz")
    X, Q = d["train"][:args.rows].astype(np.float32), d["test"][:500].astype(np.float32)
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-bench-faults-"))
    snaps = work / "snapshots"
    cluster = start_cluster(work, args.port)
    url = f"redis://127.0.0.1:{args.port}/0"
    env = {"NUMBA_NUM_THREADS": "1", "GMMLSH_SNAPSHOTS": str(snaps), "GMMLSH_SNAPSHOT_EVERY": "3",
           "GMMLSH_LOG_LEVEL": "info"}
    nodes: dict[str, Proc] = {}
    report: dict = {"rows": args.rows, "wait": args.wait, "events": []}

    def note(text: str, **facts) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text} {json.dumps(facts) if facts else ''}", flush=True)
        report["events"].append({"at": time.time(), "what": text, **facts})

    def start_node(name: str, group: str) -> Proc:
        p = Proc(["serve", "--redis", url, "--prefix", PREFIX, "--group", group, "--cache-dir", str(work / name)],
                 work / f"{name}.log", env)
        nodes[name] = p
        return p

    load = None
    threads: list[threading.Thread] = []
    try:
        with Index.open(url, IndexConfig(dim=784), prefix=PREFIX, shards=16, cache_dir=str(work / "w"),
                        maintain=False) as ix:
            for lo in range(0, args.rows, 2000):
                ix.upsert([f"f{i}" for i in range(lo, min(args.rows, lo + 2000))], X[lo:lo + 2000])
        for g in range(2):
            for r in "ab":
                start_node(f"g{g}of2{r}", f"{g}/2")
        router = Proc(["route", "--redis", url, "--prefix", PREFIX], work / "router.log",
                      {"NUMBA_NUM_THREADS": "1", "GMMLSH_REDIS_WAIT": str(args.wait)})
        for p in nodes.values():
            p.wait()
        router.wait({"groups": 2})
        note("serving", nodes=len(nodes))
        load = Load(router.url, X, Q)
        threads = [threading.Thread(target=load.reader), threading.Thread(target=load.writer)]
        for t in threads:
            t.start()

        def phase(name: str) -> None:
            load.phase = name
            note(f"phase {name}")

        phase("1 baseline")
        time.sleep(args.phase_seconds)

        phase("2 SIGKILL a node, restart on its disk")
        victim = nodes["g0of2a"]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        time.sleep(2)
        t0 = time.perf_counter()
        start_node("g0of2a", "0/2").wait()
        note("node back from its disk", seconds=round(time.perf_counter() - t0, 1))
        time.sleep(args.phase_seconds)

        phase("3 wipe a node's disk, restart from the snapshot")
        time.sleep(4)  # the builder's next round
        victim = nodes["g1of2b"]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        shutil.rmtree(work / "g1of2b")
        calls0 = hmget_calls(args.port)
        t0 = time.perf_counter()
        start_node("g1of2b", "1/2").wait()
        restored = [json.loads(p.read_text())["snapshot"] for p in (work / "g1of2b").rglob("restored.json")]
        note("wiped node back", seconds=round(time.perf_counter() - t0, 1), from_snapshot=restored,
             hmget_calls_during_start=hmget_calls(args.port) - calls0,
             group_rows=httpx.get(nodes["g1of2b"].url + "/stats").json()["mirror"]["rows"])
        time.sleep(args.phase_seconds)

        phase("4 SIGKILL a Redis master")
        slot = int(cli(args.port, "cluster", "keyslot", f"{{{PREFIX}:1}}").strip())
        m = owner(args.port, slot)
        if m["port"] == args.port:  # keep the router's seed node up
            slot = int(cli(args.port, "cluster", "keyslot", f"{{{PREFIX}:2}}").strip())
            m = owner(args.port, slot)
        note("killing master", port=m["port"], slot=slot)
        cluster[m["port"]].send_signal(signal.SIGKILL)
        t0 = time.perf_counter()
        alive = next(p for p in cluster if p != m["port"])
        while time.perf_counter() - t0 < 60:
            try:
                if owner(alive, slot)["port"] != m["port"]:
                    break
            except LookupError:
                pass
            time.sleep(0.2)
        note("replica promoted", seconds=round(time.perf_counter() - t0, 1), new_master=owner(alive, slot)["port"])
        cluster[m["port"]] = redis_node(work, m["port"])
        while "master_link_status:up" not in cli(m["port"], "info", "replication") and time.perf_counter() - t0 < 120:
            time.sleep(0.2)
        note("old master back as a replica", seconds=round(time.perf_counter() - t0, 1))
        time.sleep(args.phase_seconds)

        phase("5 reshard under load")
        ms = masters(alive)
        src, dst = list(ms)[:2]
        t0 = time.perf_counter()
        r = subprocess.run(["redis-cli", "--cluster", "reshard", f"127.0.0.1:{ms[src]['port']}", "--cluster-from", src,
                            "--cluster-to", dst, "--cluster-slots", "3000", "--cluster-yes"], capture_output=True,
                           text=True, timeout=600)
        note("resharded 3000 slots", ok=r.returncode == 0, seconds=round(time.perf_counter() - t0, 1))
        time.sleep(args.phase_seconds)

        phase("6 SIGSTOP one replica for 5 s")
        nodes["g0of2b"].proc.send_signal(signal.SIGSTOP)
        time.sleep(5)
        nodes["g0of2b"].proc.send_signal(signal.SIGCONT)
        time.sleep(args.phase_seconds)

        phase("7 grow G 2 → 4 while serving")
        load.paused.set()
        time.sleep(1)
        keys0 = data_keys(alive)
        before = httpx.post(router.url + "/neighbors/search", content=Q[:50].astype("<f4").tobytes(),
                            params={"k": 10, "mode": "exact"},
                            headers={"content-type": "application/octet-stream"}, timeout=120).json()
        t0 = time.perf_counter()
        for g in range(4):
            start_node(f"g{g}of4", f"{g}/4")
        router.wait({"groups": 4}, timeout=1800)
        note("router switched to G=4", seconds=round(time.perf_counter() - t0, 1))
        after = httpx.post(router.url + "/neighbors/search", content=Q[:50].astype("<f4").tobytes(),
                           params={"k": 10, "mode": "exact"},
                           headers={"content-type": "application/octet-stream"}, timeout=120).json()
        same = [[(n["id"], n["similarity"]) for n in a["neighbors"]] for a in before["results"]] == \
               [[(n["id"], n["similarity"]) for n in a["neighbors"]] for a in after["results"]]
        note("exact answers before and after", identical=same, redis_keys_before=keys0,
             redis_keys_after=data_keys(alive))
        load.paused.clear()
        time.sleep(args.phase_seconds)

        load.stop.set()
        for t in threads:
            t.join()
        lost, back = [], []
        with httpx.Client(timeout=30) as c:
            for ext in list(load.acked):
                if c.get(router.url + f"/vectors/{ext}").status_code == 404:
                    lost.append(ext)
            for ext in load.deleted:
                if c.get(router.url + f"/vectors/{ext}").status_code == 200:
                    back.append(ext)
        resyncs = [line for p in work.glob("g*.log") for line in p.read_text().splitlines() if "went back" in line]
        note("checked", acked=len(load.acked), lost_acked=len(lost), deleted=len(load.deleted),
             deletes_undone=len(back), shard_resyncs=len(resyncs))
        report["resyncs"] = resyncs[:8]
        report["phases"] = load.summary()
        report["router"] = httpx.get(router.url + "/stats").json()
        print(json.dumps(report["phases"], indent=1))
    finally:
        if load is not None:
            load.stop.set()
            for t in threads:
                t.join(timeout=60)
        for p in list(nodes.values()):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.stop()
        if "router" in locals():
            router.stop()
        for p in cluster.values():
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1, default=str))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
