"""Sharded search (issue 32): recall and CPU per query through the router against G, and what
a search node holds in RAM and on disk.

One index of Fashion-MNIST rows in a local Redis Cluster (3 masters, ports ``--port`` to
``--port``+2); one plain ``gmmlsh serve`` over all of it (one node, the reference), then for
each G: G search nodes (``gmmlsh serve --group g/G``) and a router (``gmmlsh route --groups
G``). Every node tunes itself on its own rows (as it would in service) before the clock.
Queries go one at a time (binary, k = 10, the index's own search), the same queries to every
layout; recall@10 is against the exact top 10. CPU per query is the CPU time the nodes (and,
apart, the router) spent during the run, read from /proc: it does not depend on what else the
machine runs, unlike the latencies, which are shown for completeness.

    python -m bench.bench_shards --rows 20000 --queries 300 --groups 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import DATA, free_port

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a serving process itself (from /proc): not its upkeep worker, which
    is a child process of its own (tuning, segments) and is waited for before the clock."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12)) / TICK


def upkeep_idle(caches: list[Path], quiet: float = 3.0, timeout: float = 1800) -> None:
    """Until no mirror of ``caches`` has had an upkeep task running for ``quiet`` seconds."""
    deadline, calm = time.monotonic() + timeout, time.monotonic()
    while time.monotonic() < deadline:
        if any(c.rglob("upkeep-*.json") for c in caches if c.exists() and list(c.rglob("upkeep-*.json"))):
            calm = time.monotonic()
        elif time.monotonic() - calm > quiet:
            return
        time.sleep(0.5)


def memory(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def memory_cgroup(pid: int, name: str, limit: int = 0) -> Path | None:
    """A memory cgroup of its own for a process (cgroup v1, as root; None where there is none),
    capped at ``limit`` bytes (0: no cap, only measured). Its children (the upkeep worker) join it."""
    if not (CGROUP_V1 / "cgroup.procs").exists() or not os.access(CGROUP_V1, os.W_OK):
        return None
    d = CGROUP_V1 / f"gmmlsh-bench-{os.getpid()}-{name}"
    d.mkdir(exist_ok=True)
    if limit:
        (d / "memory.limit_in_bytes").write_text(str(limit))
    (d / "cgroup.procs").write_text(str(pid))
    return d


def cgroup_peak(d: Path | None) -> int | None:
    if d is None:
        return None
    try:
        return int((d / "memory.max_usage_in_bytes").read_text())
    except OSError:
        return None


def cgroup_oom_kills(d: Path | None) -> int:
    try:
        return int(next(line.split()[1] for line in (d / "memory.oom_control").read_text().splitlines()
                        if line.startswith("oom_kill ")))
    except (OSError, StopIteration, TypeError):
        return 0


def remove_cgroup(d: Path | None) -> None:
    if d is not None:
        for _ in range(50):
            try:
                d.rmdir()
                return
            except OSError:
                time.sleep(0.1)


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict | None = None, memory_limit: int = 0,
                 name: str = ""):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.cli", *args, "--port", str(self.port)],
                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "GMMLSH_LOG_LEVEL": "warning", "GMMLSH_ACCESS_LOG": "false",
                                          **(env or {})}, start_new_session=True)
        out.close()
        self.cgroup = memory_cgroup(self.proc.pid, name or str(self.port), memory_limit) if name else None

    def wait(self, want: dict | None = None, timeout: float = 3600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited {self.proc.returncode}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200 and all(r.json().get(k) == v for k, v in (want or {}).items()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.cgroup is not None:
            for pid in (self.cgroup / "cgroup.procs").read_text().split():  # its upkeep worker, if any
                try:
                    os.kill(int(pid), signal.SIGTERM)
                except OSError:
                    pass
            remove_cgroup(self.cgroup)


def start_cluster(work: Path, port: int) -> list[subprocess.Popen]:
    procs = []
    for p in range(port, port + 3):
        d = work / f"redis{p}"
        d.mkdir(parents=True)
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--dir", str(d), "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in range(port, port + 3)],
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    for _ in range(100):
        info = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True).stdout
        if "cluster_state:ok" in info:
            break
        time.sleep(0.2)
    return procs


def run_queries(url: str, Q: np.ndarray, k: int = 10) -> tuple[list[list[str]], list[float]]:
    found, took = [], []
    with httpx.Client(timeout=60, headers={"content-type": "application/octet-stream"}) as c:
        for q in Q:
            t0 = time.perf_counter()
            r = c.post(url + "/neighbors/search", content=q.astype("<f4").tobytes(), params={"k": k})
            took.append(time.perf_counter() - t0)
            r.raise_for_status()
            found.append([n["id"] for n in r.json()["results"][0]["neighbors"]])
    return found, took


def recall(found: list[list[str]], truth: list[list[str]]) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


def mirror_bytes(cache: Path) -> dict[str, int]:
    """Disk bytes of a mirror by column (allocated blocks)."""
    out: dict[str, int] = {}
    for p in cache.rglob("*"):
        if p.is_file():
            name = p.parent.name + "/" if p.parent.name.startswith("lists-") else ""
            key = (name.split("/")[0] + " (lists)") if name else p.name
            out[key] = out.get(key, 0) + p.stat().st_blocks * 512
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--port", type=int, default=7010, help="first of the Cluster's 3 ports")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--memory-limit", type=float, default=0, help="MB: cap every serving process (and its upkeep "
                    "worker) at this much memory, page cache included (a cgroup v1 of its own; as root)")
    args = ap.parse_args(argv)

    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.index import Index

    d = np.load(DATA / "fashion-mnist.npz")
    if args.rows <= 60000:
        X = d["train"][:args.rows].astype(np.float32)
    else:  # Fashion-MNIST grown by shifted, rescaled copies (bench/scale_data.py; cached on disk)
        from bench import scale_data

        X = np.asarray(scale_data.data(args.rows), dtype=np.float32)
    Q = d["test"][:args.queries].astype(np.float32)
    warm = d["test"][5000:5160].astype(np.float32)  # served before the clock: the nodes tune on them
    work = Path(tempfile.mkdtemp(prefix="gmmlsh-bench-shards-"))
    cluster = start_cluster(work, args.port)
    procs: list[Proc] = []
    results: dict = {"rows": args.rows, "queries": args.queries, "layouts": {}}
    env1 = {"NUMBA_NUM_THREADS": "1"}
    limit = int(args.memory_limit * 2**20)
    results["memory_limit_mb"] = args.memory_limit
    try:
        url = f"redis://127.0.0.1:{args.port}/0"
        t0 = time.perf_counter()
        with Index.open(url, IndexConfig(dim=784), prefix="bench", shards=16, cache_dir=str(work / "w"),
                        maintain=False) as ix:
            for lo in range(0, args.rows, 5000):
                ix.upsert([f"f{i}" for i in range(lo, min(args.rows, lo + 5000))], X[lo:lo + 5000])
            truth = [[n.id for n in r.neighbors] for r in ix.query_batch(Q, k=10, mode="exact")]
        print(f"loaded {args.rows} rows and the exact truth in {time.perf_counter() - t0:.0f} s", flush=True)

        layouts: list[tuple[str, int | None]] = [("one node", None)] + [(f"G={G}", G) for G in args.groups]
        for name, G in layouts:
            t0 = time.perf_counter()
            if G is None:
                nodes = [Proc(["serve", "--redis", url, "--prefix", "bench", "--cache-dir", str(work / "one")],
                              work / "one.log", env1, limit, "one")]
                front = nodes[0]
            else:
                nodes = [Proc(["serve", "--redis", url, "--prefix", "bench", "--group", f"{g}/{G}", "--cache-dir",
                               str(work / f"g{g}of{G}")], work / f"g{g}of{G}.log", env1, limit, f"g{g}of{G}")
                         for g in range(G)]
                front = Proc(["route", "--redis", url, "--prefix", "bench", "--groups", str(G)], work / f"r{G}.log",
                             env1)
                procs.append(front)
            procs.extend(nodes)
            try:
                for n in nodes:
                    n.wait()
            except RuntimeError as exc:  # a node died (over its memory limit?)
                ooms = sum(cgroup_oom_kills(n.cgroup) for n in nodes)
                results["layouts"][name] = {"failed": str(exc)[:300], "oom_kills": ooms}
                print(name, json.dumps(results["layouts"][name]), flush=True)
                for p in [*nodes, *([front] if G else [])]:
                    p.stop()
                    procs.remove(p) if p in procs else None
                continue
            front.wait({"groups": G} if G else None)
            try:
                run_queries(front.url, warm)  # every node warm, and tuned on served queries
                time.sleep(2 * 0.5 + 1)  # the upkeep worker started by the last of them
                upkeep_idle([work / ("one" if G is None else f"g{g}of{G}") for g in range(G or 1)])
                started = time.perf_counter() - t0
                before = [cpu_seconds(n.proc.pid) for n in nodes]
                rbefore = cpu_seconds(front.proc.pid) if G else 0.0
                found, took = run_queries(front.url, Q)
            except (httpx.HTTPError, OSError) as exc:  # a node died meanwhile (over its memory limit?)
                results["layouts"][name] = {"failed": f"{type(exc).__name__}: {exc}"[:300],
                                            "oom_kills": sum(cgroup_oom_kills(n.cgroup) for n in nodes)}
                print(name, json.dumps(results["layouts"][name]), flush=True)
                for p in [*nodes, *([front] if G else [])]:
                    p.stop()
                    procs.remove(p) if p in procs else None
                continue
            node_cpu = sum(cpu_seconds(n.proc.pid) - b for n, b in zip(nodes, before, strict=True))
            router_cpu = (cpu_seconds(front.proc.pid) - rbefore) if G else 0.0
            mem = [memory(n.proc.pid) for n in nodes]
            peaks = [cgroup_peak(n.cgroup) for n in nodes]
            disk = {}
            for g in range(G or 1):
                for key, v in mirror_bytes(work / ("one" if G is None else f"g{g}of{G}")).items():
                    disk[key] = disk.get(key, 0) + v
            res = {"recall@10": round(recall(found, truth), 4),
                   "node_cpu_ms_per_query": round(1000 * node_cpu / len(Q), 3),
                   "router_cpu_ms_per_query": round(1000 * router_cpu / len(Q), 3),
                   "p50_ms": round(1000 * float(np.percentile(took, 50)), 2),
                   "p99_ms": round(1000 * float(np.percentile(took, 99)), 2),
                   "start_s": round(started, 1),
                   "node_rss_mb": [round(m["VmRSS"] / 2**20, 1) for m in mem],
                   "node_rss_file_mb": [round(m.get("RssFile", 0) / 2**20, 1) for m in mem],
                   "node_peak_mb": [round(p / 2**20, 1) if p else None for p in peaks],
                   "oom_kills": sum(cgroup_oom_kills(n.cgroup) for n in nodes),
                   "mirror_disk_mb": {k: round(v / 2**20, 2) for k, v in sorted(disk.items())}}
            results["layouts"][name] = res
            print(name, json.dumps(res), flush=True)
            for p in [*nodes, *([front] if G else [])]:
                p.stop()
                procs.remove(p) if p in procs else None
    finally:
        for p in procs:
            p.stop()
        for c in cluster:
            c.terminate()
            c.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    one = results["layouts"].get("one node", {})
    print("\n| layout | recall@10 | Δ vs one node | node CPU ms/query | router CPU ms/query | p50 ms | p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results["layouts"].items():
        if "failed" in r:
            print(f"| {name} | failed: {r['failed'][:80]} (OOM kills {r['oom_kills']}) | | | | | |")
            continue
        delta = r["recall@10"] - one.get("recall@10", r["recall@10"])
        print(f"| {name} | {r['recall@10']:.4f} | {delta:+.4f} | {r['node_cpu_ms_per_query']} | "
              f"{r['router_cpu_ms_per_query']} | {r['p50_ms']} | {r['p99_ms']} |")


if __name__ == "__main__":
    main()
