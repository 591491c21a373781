"""Operation under load (issue 30, acceptance 1 and 4): queries, writes and upkeep at once.

    python -m bench.bench_operate --shape strokes --n 100000 --minutes 2 [--backend lmdb|redis]
                                  [--http] [--workdir DIR] [--out bench/out/operate-strokes.md]

For one shape of the data zoo (:mod:`bench.zoo`) at ``n`` rows:

1. ``gmmlsh build`` of the first ``n`` rows (defaults, no sample queries: as a user would),
   into a real LMDB on disk or a real ``redis-server`` on loopback (port ``--redis-port``).
2. For ``--minutes``, all at once, from one moment T0:
   * one thread asking held-out queries round-robin, one per call, ``k = 10``, as fast as it
     can (in process: ``Index.query`` on the index opened as a server opens it — upkeep on,
     the warm-up a server's worker runs before it says ready, and ``PREFLIGHT`` queries as the
     HTTP client sends; with ``--http``: a separate client
     process on one keep-alive connection to a 2-worker ``gmmlsh serve``);
   * a writer **process** (:mod:`bench.operate_writer`) upserting ``--write-rate`` rows/s in
     batches of ``--batch`` (new ids and replacements) and deleting ``--delete-rate`` ids/s,
     paced, through the Python API or over HTTP (``POST /vectors`` with the Arrow body, as
     ``gmmlsh.Client`` sends a batch; ``DELETE /vectors/{id}`` or ``POST /delete``);
   * the index's own upkeep, as it falls due (lists, re-tunes on served queries): never
     called by the benchmark, only watched (:mod:`bench.upkeep_watch`).
3. A final round of other held-out queries, and their recall@10 against the exact truth of
   the **final contents** (the writer knows, from its seed, which row every id holds; a
   sample is checked against the store, and every neighbour answered is checked to be a
   stored id with its exact similarity).

Reported per interval (``--bucket`` seconds): queries/s, p50/p99/max latency, queries over
``--slow-ms`` (default 50; 100 over HTTP, acceptance 4), inserts/s and deletes/s achieved,
the writer's lag, the CPU time the host took from this virtual machine (``steal``) and the
kernel's memory stalls (direct compactions and reclaims, file refaults), both sampled by
:mod:`bench.machine_watch` (a query on a CPU the host took is stopped meanwhile); then every
upkeep run with its duration and the queries it overlapped, and the slowest queries with what
was under way; over HTTP, which server worker held each client's connection
(:mod:`bench.sockets`). Fixed seeds: the same command writes the same rows. The tables go to
``--out`` (markdown), the raw records beside it (.json, .npz).

Data: the first ``n`` rows and, for the writer, the rows after them (``write-rate × seconds``
more), both cached (:mod:`bench.grown`; ``--prepare-only`` makes them and stops); the final
truth is computed after the run. At 1M rows and 10 minutes the writer's rows take the data to
2,200,500 rows (fashion and signed: 6.9 GB, strokes ~2.5 GB, text ~1.9 GB, beside the 1M
files the build reads).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench import exact, operate_report, sockets
from bench.common import build_index, emit, serve, start_redis, store_args
from bench.machine_watch import MachineLog, MachineSampler
from bench.operate_proc import Child
from bench.operate_query import PREFLIGHT, loop, query_rows
from bench.upkeep_watch import HttpWatch, InProcessWatch
from bench.zoo import SHAPES, Shape
from gmmlsh.core.gmm import gmm

LOAD_QUERIES = 2000
FINAL_QUERIES = 500
#: Stored vectors read back and compared with what the writer says they hold.
CHECK_SAMPLE = 200


def writer_rows(args) -> int:
    """Data rows the writer may use: every tick's batch for the whole run, and one more."""
    ticks = math.ceil(args.minutes * 60 * args.write_rate / args.batch) + 1
    return ticks * args.batch


def prepare(shape: Shape, n: int, rows: int) -> dict:
    """The build's input and the writer's rows, cached; how long each took (~0 when cached)."""
    t = time.perf_counter()
    shape.data(n)
    built = time.perf_counter() - t
    t = time.perf_counter()
    shape.data(n + rows)
    return {"data_s": built, "writer_rows_s": time.perf_counter() - t}


def query_counts(shape: Shape, args) -> tuple[int, int]:
    """(final round, load) queries: held-out rows, the final round's first."""
    final = min(args.final_queries, shape.held_out // 2)
    return final, min(LOAD_QUERIES, shape.held_out - final)


# --- the load ----------------------------------------------------------------------------------


def writer_args(args, opened: dict, rows: int, url: str | None) -> list[str]:
    where = ["--url", url, "--http-delete", args.http_delete] if url else (
        ["--index", opened["location"]] if args.backend == "lmdb" else
        ["--redis", opened["location"], "--prefix", opened["prefix"], "--cache-dir", opened["cache_dir"]])
    return ["--shape", args.shape, "--n", str(args.n), "--rows", str(rows), "--batch", str(args.batch),
            "--write-rate", str(args.write_rate), "--delete-rate", str(args.delete_rate),
            "--replace-share", str(args.replace_share), "--seed", str(args.seed), *where]


def run_in_process(args, shape: Shape, opened: dict, rows: int, workdir: Path, log) -> dict:
    from gmmlsh.index.compile import compile_kernels
    from gmmlsh.index.index import Index
    from gmmlsh.service.app import warm_queries

    final_n, load_n = query_counts(shape, args)
    compile_kernels()  # numba's kernels loaded (or compiled) on throwaway indexes: not timed as a query
    ix = Index.open(**opened)  # upkeep on, as a server opens it
    watch = InProcessWatch(ix)
    writer = Child("bench.operate_writer", writer_args(args, opened, rows, None), workdir / "writer.json", log,
                   env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    try:
        # What a server's worker does before /health says ready: the mirror mapped, a query by id
        # and a stored vector through the query kernels, the start-up heap frozen out of the
        # collector's sight (gmmlsh.service.app).
        ix.warm()
        warm_queries(ix)
        # Hashes one row and writes nothing: the process's hashing tables (built on a process's first
        # hash: 0.5 s at 784-d) are made before the clock, as start-up, not as a query's cost.
        ix.prepare(["start-up"], shape.queries(1, 0))
        Q = query_rows(shape.queries(load_n, final_n))
        for i in range(PREFLIGHT):  # as the HTTP client does: its worker's first queries before the clock
            ix.query(Q[i % len(Q)], k=10)
        gc.collect()
        gc.freeze()
        writer.wait_ready()
        t0 = time.monotonic() + 1.0
        t_end = t0 + args.minutes * 60
        writer.go(t0, t_end)
        def ask(i: int) -> None:
            ix.query(Q[i], k=10)

        trace = SlowTrace(ask, args.trace_slow, workdir / "slow-stacks.txt") if args.trace_slow is not None else None
        answered = watch.answers
        q = loop(trace or ask, len(Q), t0, t_end, after=trace.again if trace is not None else None)
        answered = watch.answers - answered - (trace.asked_again if trace is not None else 0)
        w = writer.collect(timeout=args.minutes * 60 + 900)
        final = final_in_process(ix, shape.queries(final_n, 0))
        final["upkeep_running"] = watch.running()
        return {"t0": t0, "queries": q, "writer": w, "events": watch.events, "logs": watch.logs,
                "final": final, "query_thread": threading.current_thread().name, "answers": answered,
                "slow_stacks": trace.summary() if trace is not None else [],
                "search_after": ix.stats()["search"]}
    finally:
        writer.stop()
        watch.close()
        ix.close()


class SlowTrace:
    """A query callable traced for slowness: for each call still running ``after_ms`` after it
    started (seen by a watchdog thread that looks every quarter of that time), every thread's
    Python stack goes to ``path`` and the query thread's innermost frames are counted — where a
    slow query was waiting, and what the process's other threads were doing then; once such a
    call ends, what the query thread's kernel counted for it (``getrusage``: CPU time, page
    faults, context switches) says whether it computed, waited for the disk, or was not given
    a core; and the same query asked again at once (:meth:`again`, outside the timed call) says
    whether the query is slow on the index as it stands, or the moment was. :meth:`summary`
    sums them up for the report.

    The watchdog reads the stacks with ``sys._current_frames`` under the interpreter lock.
    ``faulthandler.dump_traceback_later``, which reads them from a C thread without that lock,
    crashed a 10-minute run with a segfault when a frame it walked was freed under it."""

    def __init__(self, ask: Callable[[int], None], after_ms: float, path: Path):
        self.ask, self.after = ask, after_ms / 1000
        self.out = open(path, "w")  # noqa: SIM115 - written by the watchdog and the query thread for the whole run
        self.where: Counter[str] = Counter()  # the query thread's innermost frames, once a call passed the time
        self.counted: list[str] = []  # each slow call's getrusage
        self._current: tuple[int, int, float | None] = (0, 0, None)  # the call under way: number, thread, start
        self._again = False  # the last call was slow: ask its query again
        self.asked_again = 0  # queries asked again (answers the load did not ask for)
        threading.Thread(target=self._watch, name="bench-trace-slow", daemon=True).start()

    def __call__(self, i: int) -> None:
        before = resource.getrusage(resource.RUSAGE_THREAD)
        t = time.perf_counter()
        self._current = (self._current[0] + 1, threading.get_ident(), t)
        try:
            self.ask(i)
        finally:
            self._current = (self._current[0], 0, None)
            took = time.perf_counter() - t
            if took > self.after:
                u = resource.getrusage(resource.RUSAGE_THREAD)
                cpu = u.ru_utime + u.ru_stime - before.ru_utime - before.ru_stime
                self.counted.append(
                    f"{took * 1e3:.1f} ms; cpu {cpu * 1e3:.1f} ms; major faults {u.ru_majflt - before.ru_majflt}; "
                    f"minor faults {u.ru_minflt - before.ru_minflt}; involuntary switches "
                    f"{u.ru_nivcsw - before.ru_nivcsw}; voluntary {u.ru_nvcsw - before.ru_nvcsw}")
                self.out.write(f"Counted: {self.counted[-1]}\n")
                self.out.flush()
                self._again = True

    def again(self, i: int) -> None:
        """After a slow call (passed to the load loop as its ``after``): the same query once more,
        timed, its time added to that call's line of the report."""
        if not self._again:
            return
        self._again = False
        t = time.perf_counter()
        self.ask(i)
        self.asked_again += 1
        self.counted[-1] += f"; asked again at once: {(time.perf_counter() - t) * 1e3:.1f} ms"
        self.out.write(f"Again: {self.counted[-1]}\n")
        self.out.flush()

    def _watch(self) -> None:
        dumped = 0
        while True:
            time.sleep(self.after / 4)
            n, thread, start = self._current
            if start is None or n == dumped or time.perf_counter() - start <= self.after:
                continue
            dumped = n
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"Call {n}, past {self.after * 1e3:g} ms:"]
            for ident, frame in sys._current_frames().items():
                # innermost first; no source lines: reading them held the interpreter lock for
                # tens of ms, which the slow query, waiting for that lock, was then charged
                stack = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
                if ident == thread:
                    self.where[" ← ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[:3])] += 1
                lines.append(f"Thread {names.get(ident, ident)}:")
                lines += [f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in stack]
            self.out.write("\n".join(lines) + "\n\n")
            self.out.flush()

    def summary(self, top: int = 8) -> list[str]:
        """Where the query thread was once a call passed the time, and each slow call's
        ``getrusage``; nothing where no call was slow."""
        if not self.where and not self.counted:
            return []
        L = [f"Where the query thread was once a query passed the trace time ({sum(self.where.values())} stacks):"]
        L += [f"- {n} × {frames}" for frames, n in self.where.most_common(top)]
        L += ["", f"What the kernel counted for each of the {len(self.counted)} (the query thread's `getrusage`):"]
        return L + [f"- {line}" for line in self.counted]


def final_in_process(ix, Q) -> dict:
    answers, lat = [], []
    for q in query_rows(Q):
        t = time.perf_counter()
        r = ix.query(q, k=10)
        lat.append(time.perf_counter() - t)
        answers.append([(int(nb.id), nb.similarity) for nb in r.neighbors])
    return {"answers": answers, "latency": lat}


def run_http(args, shape: Shape, opened: dict, rows: int, workdir: Path, log) -> dict:
    import httpx

    from bench.operate_query import http_bodies

    final_n, load_n = query_counts(shape, args)
    from gmmlsh.index.index import Index

    with Index.open(**opened, maintain=False) as ix:  # where the server's workers keep the mirror
        mirror_dir = ix.mirror_path
    proc, url = serve(opened["location"], workers=2, env={"GMMLSH_LOG_LEVEL": "info"},
                      prefix=opened.get("prefix"), cache_dir=opened.get("cache_dir"), log=subprocess.PIPE)
    watch = HttpWatch(url, proc.stderr, mirror_dir)
    children = []
    try:
        client = Child("bench.operate_query", ["--url", url, "--shape", args.shape, "--offset", str(final_n),
                                               "--count", str(load_n)], workdir / "client.json", log)
        children.append(client)
        writer = Child("bench.operate_writer", writer_args(args, opened, rows, url), workdir / "writer.json", log)
        children.append(writer)
        for c in children:
            c.wait_ready()
        t0 = time.monotonic() + 1.0
        t_end = t0 + args.minutes * 60
        for c in children:
            c.go(t0, t_end)
        placed: dict[str, list[int]] = {}
        look = threading.Timer(t0 + 5.0 - time.monotonic(), lambda: placed.update(sockets.workers_of(
            proc.pid, {"query client": client.proc.pid, "writer": writer.proc.pid}, int(url.rsplit(":", 1)[1]))))
        look.start()
        q = client.collect(timeout=args.minutes * 60 + 900)
        look.join()
        w = writer.collect(timeout=args.minutes * 60 + 900)
        answers, lat = [], []
        with httpx.Client(base_url=url, timeout=300) as c:
            for body in http_bodies(shape.queries(final_n, 0)):
                t = time.perf_counter()
                r = c.post("/neighbors/search", content=body, headers={"content-type": "application/json"})
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
                answers.append([(int(nb["id"]), nb["similarity"]) for nb in r.json()["neighbors"]])
        return {"t0": t0, "queries": q, "writer": w, "events": watch.events(), "logs": watch.logs,
                "polls": [(t, took, err) for t, took, _, err in watch.polls],
                "final": {"answers": answers, "latency": lat}, "query_thread": "client", "placed": placed,
                "search_after": watch.polls[-1][2]["search"] if watch.polls and watch.polls[-1][2] else None}
    finally:
        for c in children:
            c.stop()
        watch.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the final contents --------------------------------------------------------------------------


def final_truth(shape: Shape, args, rows: int, source: np.ndarray, Q) -> tuple[np.ndarray, np.ndarray]:
    """Exact top 10 of ``Q`` over what the store holds at the end: id ``i`` holds data row
    ``source[i]`` (−1: nothing). Rows are read in data order (a memory-mapped file streams)."""
    X = shape.data(args.n + rows)
    alive = np.flatnonzero(source >= 0)
    order = alive[np.argsort(source[alive], kind="stable")]
    parts = ((order[lo:lo + 100_000], X[source[order[lo:lo + 100_000]]]) for lo in range(0, order.shape[0], 100_000))
    return exact.top_k(Q, parts, 10)


def judge(final: dict, Q, X, source: np.ndarray, tenth: np.ndarray) -> dict:
    """Recall@10 of the final answers (a neighbour counts when it is stored now and its exact
    similarity reaches the true 10th: text has ties), and answers that are not what the store
    holds (a deleted id, or a similarity other than the exact one of the id's vector now)."""
    stale, wrong, hits = 0, 0, []
    rows = [Q[i] for i in range(Q.shape[0])]
    for qi, found in enumerate(final["answers"]):
        good = 0
        for ext, sim in found[:10]:
            if ext >= source.shape[0] or source[ext] < 0:
                stale += 1
                continue
            truth = gmm(rows[qi], X[source[ext]])
            if abs(truth - sim) > 1e-5:
                wrong += 1
                continue
            good += sim >= tenth[qi] - 1e-6
        hits.append(min(good, 10) / 10)
    lat = np.asarray(final["latency"])
    return {"recall": float(np.mean(hits)), "stale": stale, "wrong_similarity": wrong, "queries": len(hits),
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "max_ms": float(lat.max() * 1e3)}


def check_store(opened: dict, X, source: np.ndarray, seed: int) -> dict:
    """The store against the writer's account: the count, a sample of stored vectors read back,
    a sample of deleted ids absent."""
    from gmmlsh.index.index import Index

    rng = np.random.default_rng([seed, 31])
    alive = np.flatnonzero(source >= 0)
    gone = np.flatnonzero(source < 0)
    bad = []
    with Index.open(**opened, maintain=False) as ix:
        count = ix.count()
        for i in rng.choice(alive, min(CHECK_SAMPLE, alive.shape[0]), replace=False).tolist():
            sv = ix.get(str(i))
            got = np.zeros(X.shape[1], np.float32)
            if sv.indices is None:
                got[:] = sv.values
            else:
                got[sv.indices] = sv.values
            want = X[source[i]]
            want = want.toarray()[0] if sp.issparse(want) else np.asarray(want)
            if not np.array_equal(got, want):
                bad.append(i)
        present = [int(i) for i in rng.choice(gone, min(CHECK_SAMPLE, gone.shape[0]), replace=False)
                   if ix.contains(str(i))] if gone.shape[0] else []
    return {"count": count, "expected": int(alive.shape[0]), "vectors_differing": bad, "deleted_present": present}


# --- the run -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="fashion")
    p.add_argument("--n", type=int, default=100_000, help="rows the index is built with")
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--backend", choices=("lmdb", "redis"), default="lmdb")
    p.add_argument("--http", action="store_true", help="a 2-worker gmmlsh serve, the load over HTTP")
    p.add_argument("--write-rate", type=float, default=2000.0, help="rows upserted a second")
    p.add_argument("--delete-rate", type=float, default=200.0, help="ids deleted a second")
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--replace-share", type=float, default=0.5, help="share of a batch replacing stored ids")
    p.add_argument("--http-delete", choices=("each", "batch"), default="each",
                   help="over HTTP: DELETE /vectors/{id} for each id, or POST /delete with a tick's ids")
    p.add_argument("--final-queries", type=int, default=FINAL_QUERIES)
    p.add_argument("--slow-ms", type=float, help="a query slower than this is flagged (default 50; 100 over HTTP)")
    p.add_argument("--trace-slow", type=float, metavar="MS",
                   help="in process: for each query still running after MS, every thread's stack and the "
                        "query thread's getrusage (slow-stacks.txt in the workdir; summed up in the report)")
    p.add_argument("--bucket", type=float, default=60.0, help="seconds an interval of the report covers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-port", type=int, default=6393)
    p.add_argument("--workdir", type=Path, help="keep the index and the logs here (default: a temporary "
                                                "directory, removed)")
    p.add_argument("--out", type=Path)
    p.add_argument("--prepare-only", action="store_true",
                   help="make (or find) the data files this run needs, say how long it took, and stop")
    a = p.parse_args(argv)
    if a.http and a.trace_slow is not None:
        p.error("--trace-slow: the query thread must be this process's (not with --http)")
    shape = SHAPES[a.shape]
    slow = (a.slow_ms or (100.0 if a.http else 50.0)) / 1e3
    rows = writer_rows(a)
    prep = prepare(shape, a.n, rows)
    print(f"data ready: {shape.path(a.n)} ({prep['data_s']:.0f} s), the writer's rows in "
          f"{shape.path(a.n + rows)} ({prep['writer_rows_s']:.0f} s)", flush=True)
    if a.prepare_only:
        return
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="gmmlsh-operate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    redis_proc = None
    log = open(workdir / "children.log", "w")
    try:
        if a.backend == "lmdb":
            shutil.rmtree(workdir / "index", ignore_errors=True)
            opened = {"location": str(workdir / "index")}
        else:
            shutil.rmtree(workdir / "cache", ignore_errors=True)
            redis_proc, url = start_redis(workdir, a.redis_port)
            opened = {"location": url, "prefix": f"operate-{a.shape}", "cache_dir": str(workdir / "cache")}
        build = build_index(shape.path(a.n), store_args(**opened))
        print(f"built in {build['command_seconds']:.1f} s; search {build.get('search')}", flush=True)
        with MachineSampler(workdir / "machine.txt") as machine:
            run = (run_http if a.http else run_in_process)(a, shape, opened, rows, workdir, log)
        print("load done; the truth of the final contents …", flush=True)
        source = np.load(workdir / "writer.source.npy")
        final_n, _ = query_counts(shape, a)
        Qf = shape.queries(final_n, 0)
        t = time.perf_counter()
        _, sims = final_truth(shape, a, rows, source, Qf)
        truth_s = time.perf_counter() - t
        X = shape.data(a.n + rows)
        verdict = judge(run["final"], Qf, X, source, sims[:, -1])
        store = check_store(opened, X, source, a.seed)
    finally:
        log.close()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        if not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    res = {"args": {k: str(v) for k, v in vars(a).items()}, "prepare": prep, "build": build, "truth_s": truth_s,
           "final": verdict, "store": store, **{k: v for k, v in run.items() if k not in ("queries", "final")}}
    lines = report(a, shape, res, run, slow, machine.log)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(res, default=str))
        np.savez_compressed(a.out.with_suffix(".npz"), start=np.asarray(run["queries"]["start"]) - run["t0"],
                            latency=np.asarray(run["queries"]["latency"]))
    emit(lines, a.out)


def report(a, shape: Shape, res: dict, run: dict, slow: float, machine: MachineLog) -> list[str]:
    seconds = a.minutes * 60
    how = (f"HTTP, 2-worker `gmmlsh serve`, {a.backend}" if a.http else f"Python API in process, {a.backend}")
    cmd = " ".join(["python -m bench.bench_operate", f"--shape {a.shape}", f"--n {a.n}", f"--minutes {a.minutes:g}",
                    f"--backend {a.backend}", *([f"--http --http-delete {a.http_delete}"] if a.http else [])])
    b, f, s = res["build"], res["final"], res["store"]
    L = [f"### {a.shape}, {a.n:,} rows, {a.minutes:g} min, {how}", "", f"    {cmd}", "",
         f"- build (`gmmlsh build`, whole command): {b['command_seconds']:.1f} s ({a.n / b['command_seconds']:,.0f} "
         f"rows/s); search chosen: {(b.get('upkeep', {}).get('tune') or [{}])[-1].get('chosen', '?')} "
         f"{b.get('search')}",
         f"- load: one query thread, held-out queries round-robin; writer {a.write_rate:,.0f} rows/s in batches of "
         f"{a.batch} ({a.replace_share:.0%} replacements), {a.delete_rate:,.0f} deletes/s",
         "", *operate_report.intervals(run["queries"], run["writer"], run["events"], run["t0"], seconds, a.bucket,
                                       slow, machine),
         "", *operate_report.writer_summary(run["writer"], run["t0"], seconds, a.write_rate, a.delete_rate, slow),
         *operate_report.slow_upserts(run["writer"], run["events"], run["t0"], slow, machine),
         *operate_report.placement(run.get("placed")),
         *operate_report.syncs(run["events"], run["query_thread"], run["queries"], run.get("answers")),
         "", *operate_report.slow_queries(run["queries"], run["events"], run["t0"], slow, machine),
         *run.get("slow_stacks", []),
         "", *operate_report.upkeep(run["queries"], run["events"], run["t0"]), "",
         f"Final round ({f['queries']} other held-out queries, right after the load): **recall@10 {f['recall']:.3f}** "
         f"against the exact truth of the final contents ({s['expected']:,} vectors; truth in {res['truth_s']:.0f} s); "
         f"p50 {f['p50_ms']:.2f} ms, max {f['max_ms']:.1f} ms; answers naming a deleted id: {f['stale']}, with a "
         f"similarity not the exact one of the id's vector now: {f['wrong_similarity']}"
         + (f"; upkeep running: {run['final']['upkeep_running'] or 'none'}." if "upkeep_running" in run["final"]
            else "."),
         f"Store against the writer's account: count {s['count']:,} (expected {s['expected']:,}); "
         f"{CHECK_SAMPLE} stored vectors read back, differing: {len(s['vectors_differing'])}; deleted ids "
         f"present: {len(s['deleted_present'])}.",
         f"Search after the run: {run.get('search_after')}"]
    if a.http:
        took = [p[1] for p in run["polls"]]
        L.append(f"`GET /stats` polled {len(took)} times (once a second) during the run: slowest {max(took):.2f} s, "
                 f"failed {sum(p[2] is not None for p in run['polls'])}." if took else "`GET /stats` never answered.")
    errors = [line for _, line in run["logs"] if "Traceback" in line or "ERROR" in line] if a.http else \
        [m for _, lvl, m in run["logs"] if lvl in ("ERROR", "CRITICAL")]
    if errors:
        L.append(f"Errors logged by the index/server: {len(errors)}; first: {errors[0][:300]}")
    return L


if __name__ == "__main__":
    main()
