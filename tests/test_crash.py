"""Crash tests: kill it at random moments, restart, and lose nothing (both backends).

1. A ``gmmlsh serve`` process under a stream of ``POST /vectors`` batches (and a
   few ``DELETE``s) is SIGKILLed at a random moment, ``GMMLSH_CRASH_KILLS``
   times (default 30) per backend, restarted on the same index each time.
2. A ``gmmlsh build`` of a file is SIGKILLed at random points
   (``GMMLSH_CRASH_BUILD_KILLS``, default 6 per backend) and re-run to the end.
3. ``redis-server`` itself (AOF on, ``appendfsync always``) is SIGKILLed under a
   stream of HTTP writes (``GMMLSH_CRASH_REDIS_KILLS``, default 10) and
   restarted from its AOF while the API server stays up.

After every kill the store is opened in this process and checked:

* every acknowledged write (HTTP 200) is there, byte-exact (values at float32,
  metadata), and every acknowledged delete is gone;
* an unacknowledged request is either applied or not — LMDB: the whole batch
  or none of it (one transaction); Redis: each vector on its own, and never
  half-visible (``get`` works iff its record holds a vector and a sketch iff an
  exact query finds it);
* the count is exact and :meth:`Index.check` passes (Redis writes each record in
  one script, so a killed writer leaves nothing behind either).

Figures (kills, requests served, ...) are printed and, when
``GMMLSH_RELIABILITY_LOG`` names a file, appended to it as JSON lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
from redis_fixtures import RedisServer, redis_url  # noqa: F401  (redis_url: session fixture)

from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.index.records import decode_vector

REPO = Path(__file__).resolve().parents[1]
#: Kills per run: a few in the suite; a long crash loop sets these (e.g. GMMLSH_CRASH_KILLS=200).
KILLS = int(os.environ.get("GMMLSH_CRASH_KILLS", "8"))
BUILD_KILLS = int(os.environ.get("GMMLSH_CRASH_BUILD_KILLS", "6"))
REDIS_KILLS = int(os.environ.get("GMMLSH_CRASH_REDIS_KILLS", "10"))
START_TIMEOUT = 120.0
DIM = 16
SAMPLES = 16


# --- shared helpers (also used by the soak, fuzz and hostile-input tests) ---------------------


def record(test: str, **figures) -> None:
    """Print a test's figures; append them to ``$GMMLSH_RELIABILITY_LOG`` (JSON lines) if set."""
    print(f"\n{test}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    path = os.environ.get("GMMLSH_RELIABILITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def index_env(kind: str, tmp: Path, redis: str | None, **extra: str) -> tuple[dict[str, str], str, dict]:
    """(server GMMLSH_* env, location, Index.open kwargs) of a fresh small index. A Redis index's
    search mirror lives under ``tmp`` (GMMLSH_CACHE_DIR), for the server and this process alike."""
    env = {"GMMLSH_DIM": str(DIM), "GMMLSH_SAMPLES": str(SAMPLES), **extra}
    if kind == "lmdb":
        loc = str(tmp / f"idx-{uuid.uuid4().hex[:6]}")
        return {**env, "GMMLSH_INDEX": loc}, loc, {}
    assert redis is not None
    prefix = f"c{uuid.uuid4().hex[:12]}"
    cache = str(tmp / "cache")
    return ({**env, "GMMLSH_REDIS_URL": redis, "GMMLSH_PREFIX": prefix, "GMMLSH_CACHE_DIR": cache}, redis,
            {"prefix": prefix, "cache_dir": cache})


class ServerProc:
    """``python -m service.server`` (what ``gmmlsh serve`` runs) on a free loopback port.

    Started in its own session so :meth:`kill` SIGKILLs it and any worker
    processes at once, as a crash (or the OOM killer) would.
    """

    def __init__(self, tmp: Path, env: dict[str, str], workers: int = 1):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("GMMLSH_")},
            "GMMLSH_HOST": "127.0.0.1", "GMMLSH_PORT": str(self.port), "GMMLSH_WORKERS": str(workers),
            "GMMLSH_THREADS": "4", "GMMLSH_LOG_LEVEL": "warning", "GMMLSH_ACCESS_LOG": "false",
            **env,
        }
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = START_TIMEOUT) -> ServerProc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.server"], cwd=REPO, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"server not healthy after {timeout:g} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the whole process group: no shutdown handler, no flush."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (graceful), bounded; SIGKILL if it hangs. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=kw.pop("timeout", 30), **kw)


def random_vectors(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 rows with negative entries and zeros, never all-zero."""
    X = rng.uniform(-1, 1, size=(n, DIM)).astype(np.float32)
    X[rng.random((n, DIM)) < 0.3] = 0
    X[:, 0] = np.where(X[:, 0] == 0, np.float32(0.5), X[:, 0])
    return X


def odd_meta(rng: random.Random, version: int) -> dict:
    return {"v": version, "s": rng.choice(["", "é/☃ \"q\" \\", "x" * 50, "\u0000nul", "😀"]),
            "nested": {"a": [1, 2.5, None, True, {"b": "c"}]}}


@dataclass
class Op:
    """One request: an upsert batch (values float32, metadata) or a delete of one id."""

    kind: str
    items: list[tuple[str, np.ndarray | None, dict | None]]

    def ids(self) -> list[str]:
        return [i for i, _, _ in self.items]


@dataclass
class Model:
    """What the store must hold: the definite state (acknowledged writes), plus the
    unacknowledged requests since the last verification (each may or may not be applied)."""

    state: dict[str, tuple[bytes, dict | None]] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    uncertain: list[Op] = field(default_factory=list)
    acked: int = 0
    unacked: int = 0
    applied: int = 0
    not_applied: int = 0

    def busy(self) -> set[str]:
        return {i for op in self.uncertain for i in op.ids()}

    def ack(self, op: Op) -> None:
        self.acked += 1
        for ext, values, meta in op.items:
            if op.kind == "delete":
                self.state.pop(ext, None)
                self.gone.add(ext)
            else:
                self.state[ext] = (values.tobytes(), meta)
                self.gone.discard(ext)

    def lose(self, op: Op) -> None:
        self.unacked += 1
        self.uncertain.append(op)


def read(ix: Index, ext: str) -> tuple[bytes, dict | None] | None:
    try:
        sv = ix.get(ext)
    except UnknownIdError:
        return None
    return sv.values.astype(np.float32).tobytes(), sv.metadata


def assert_not_half_visible(ix: Index, ext: str) -> bool:
    """An id is visible through every read path or none: get, its record (vector and sketch),
    an exact scan of the search mirror."""
    iid = int(ix.store.lookup([ext])[0])
    got = read(ix, ext)
    if iid < 0:
        assert got is None, f"{ext}: readable without an id map entry"
        return False
    assert got is not None, f"{ext}: in the id map (iid {iid}) but its vector is not readable"
    rec = ix.store.read(np.array([iid]), ["vector", "sketch"])
    assert rec["vector"][0] is not None and rec["sketch"][0] is not None, f"{ext}: visible without its sketch"
    q = np.frombuffer(got[0], np.float32)
    res = ix.query(q, k=3, mode="exact")
    assert ext in [n.id for n in res.neighbors], f"{ext}: visible but an exact scan does not find it"
    return True


def verify(ix: Index, model: Model, *, atomic_batches: bool) -> None:
    """Check the store against the model after a crash; then make the model definite."""
    busy = model.busy()
    for ext, want in model.state.items():
        if ext not in busy:
            assert read(ix, ext) == want, f"acknowledged write of {ext!r} lost or changed"
    for ext in model.gone - busy:
        assert read(ix, ext) is None, f"acknowledged delete of {ext!r} undone"
    is_redis = type(ix.store).__name__ == "RedisStore"
    for op in model.uncertain:
        outcome = []
        for ext, values, meta in op.items:
            before = model.state.get(ext)
            after = None if op.kind == "delete" else (values.tobytes(), meta)
            got = read(ix, ext)
            assert got in (before, after), f"{ext!r}: neither its old nor its new state after a crash"
            if is_redis:
                assert_not_half_visible(ix, ext)
            if before != after:
                outcome.append(got == after)
            if got is None:
                model.state.pop(ext, None)
                model.gone.add(ext)
            else:
                model.state[ext] = got
                model.gone.discard(ext)
        if atomic_batches:
            assert len(set(outcome)) <= 1, f"a batch was half applied: {outcome}"
        if any(outcome):
            model.applied += 1
        else:
            model.not_applied += 1
    model.uncertain.clear()
    assert ix.count() == len(model.state), f"count {ix.count()} != {len(model.state)} live ids"
    rep = ix.check()
    assert rep.ok, rep.summary()


def post_stream(c: httpx.Client, model: Model, rng: np.random.Generator, prng: random.Random,
                tag: str, stop: threading.Event, max_ops: int = 10_000) -> int:
    """Send upsert batches (some replacing acknowledged ids) and a few deletes until a request
    fails at the transport level or ``stop`` is set. Returns requests answered 200."""
    served = 0
    for n in range(max_ops):
        if stop.is_set():
            break
        busy = model.busy()
        known = [i for i in model.state if i not in busy]
        if known and prng.random() < 0.08:
            op = Op("delete", [(prng.choice(known), None, None)])
        else:
            size = prng.randint(1, 12)
            replace = prng.randint(0, min(3, size, len(known)))  # some acknowledged ids get new versions
            ids = prng.sample(known, replace) + [f"{tag}-{n}-{j}" for j in range(size - replace)]
            X = random_vectors(rng, len(ids))
            op = Op("upsert", [(i, X[j], odd_meta(prng, n)) for j, i in enumerate(ids)])
        try:
            if op.kind == "delete":
                r = c.delete(f"/vectors/{op.items[0][0]}")
            else:
                r = c.post("/vectors", json={"vectors": [
                    {"id": i, "values": v.tolist(), "metadata": m} for i, v, m in op.items]})
        except httpx.TransportError:
            model.lose(op)
            break
        if r.status_code == 200:
            model.ack(op)
            served += 1
        elif r.status_code == 503:  # the store went away: the request may be partly done
            model.lose(op)
        else:
            raise AssertionError(f"{op.kind}: {r.status_code} {r.text[:300]}")
    return served


@pytest.fixture(params=["lmdb", "redis"])
def backend(request) -> str:
    return request.param


# --- 1. the API server SIGKILLed under a stream of writes --------------------------------------


def test_server_sigkilled_under_writes_loses_nothing(backend, tmp_path, request):
    redis = request.getfixturevalue("redis_url") if backend == "redis" else None
    env, loc, kw = index_env(backend, tmp_path, redis)
    rng = np.random.default_rng(7)
    prng = random.Random(7)
    model = Model()
    served = restarts = 0
    t0 = time.monotonic()
    srv = ServerProc(tmp_path, env)
    try:
        for cycle in range(KILLS):
            srv.start()
            restarts += 1
            stop = threading.Event()
            timer = threading.Timer(prng.uniform(0.05, 0.6), srv.kill)
            timer.start()
            with srv.client() as c:
                served += post_stream(c, model, rng, prng, f"k{cycle}", stop)
            timer.join()
            srv.kill()
            with Index.open(loc, None, create=False, **kw) as ix:
                verify(ix, model, atomic_batches=backend == "lmdb")
        # a clean restart serves exactly the model
        srv.start()
        with srv.client() as c:
            for ext in prng.sample(sorted(model.state), min(50, len(model.state))):
                r = c.get(f"/vectors/{ext}")
                assert r.status_code == 200
                values, meta = model.state[ext]
                assert np.asarray(r.json()["values"], np.float32).tobytes() == values
                assert r.json()["metadata"] == meta
        assert srv.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    finally:
        srv.kill()
    assert model.acked > KILLS and model.unacked >= 1
    record(f"crash-server-{backend}", kills=KILLS, restarts=restarts, requests_acked=served,
           unacked_requests=model.unacked, unacked_applied=model.applied, unacked_not_applied=model.not_applied,
           vectors=len(model.state), seconds=round(time.monotonic() - t0, 1))


# --- 2. a file build SIGKILLed at random points, then finished -----------------------------------


def _build_cmd(data: Path, loc_opts: list[str]) -> list[str]:
    return [sys.executable, "-m", "gmmlsh.service.cli", "build", str(data), "--chunk-rows", "500", "--no-progress",
            "--samples", str(SAMPLES), *loc_opts]


def test_build_sigkilled_then_rerun_loses_nothing(backend, tmp_path, request):
    redis = request.getfixturevalue("redis_url") if backend == "redis" else None
    _, loc, kw = index_env(backend, tmp_path, redis)
    loc_opts = ["--index", loc] if backend == "lmdb" else ["--redis", loc, "--prefix", kw["prefix"], "--cache-dir",
                                                           kw["cache_dir"]]
    rng = np.random.default_rng(11)
    n = 20_000
    X = random_vectors(rng, n)
    np.save(tmp_path / "x.npy", X)
    cmd = _build_cmd(tmp_path / "x.npy", loc_opts)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GMMLSH_")}
    prng = random.Random(11)
    kills = 0
    t0 = time.monotonic()
    ix = None
    try:
        while kills < BUILD_KILLS:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
            if ix is None:  # the first run creates the index
                deadline = time.monotonic() + 120
                while ix is None:
                    assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                    with contextlib.suppress(FileNotFoundError):
                        ix = Index.open(loc, None, create=False, **kw)
                    time.sleep(0.02)
            before = ix.count()
            # spread the kills so that each lands mid-build, with rows left for the next ones
            target = before + prng.randint(1, max(1, (n - before) // (BUILD_KILLS - kills + 1)))
            deadline = time.monotonic() + 120
            while ix.count() < target and proc.poll() is None:
                assert time.monotonic() < deadline, "the build stalled"
                time.sleep(0.005)
            if proc.poll() is not None:
                assert proc.returncode == 0, proc.stderr.read()
                break
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            proc.stderr.close()
            count = ix.count()
            assert count < n, "the kill landed after the last chunk: make the input larger"
            kills += 1
            if backend == "lmdb":
                assert count % 500 == 0, f"{count} rows: a chunk was half written"
            rep = ix.check()
            assert rep.ok, rep.summary()
            for name, values in stored_rows(ix):  # whatever is there is exactly the input row
                assert values.tobytes() == X[int(name)].tobytes(), name
        r = subprocess.run(cmd + ["--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert summary["count"] == n
        assert ix.count() == n
        rep = ix.check()
        assert rep.ok, rep.summary()
        for i in prng.sample(range(n), 300):
            assert ix.get(str(i)).values.tobytes() == X[i].tobytes()
    finally:
        if ix is not None:
            ix.close()
    assert kills == BUILD_KILLS, f"only {kills} kills landed mid-build"
    record(f"crash-build-{backend}", kills=kills, rows=n, resumed_skipped=summary["skipped"],
           rewritten=summary["vectors"], seconds=round(time.monotonic() - t0, 1))


def stored_rows(ix: Index):
    """(external id, dense float32 values) of every stored vector, straight from the store."""
    for ids, iids in ix.store.scan_ids():
        for name, blob in zip(ids, ix.store.read(iids, ["vector"])["vector"], strict=True):
            _, _, idx, val = decode_vector(blob)
            if idx is not None:
                dense = np.zeros(DIM, np.float32)
                dense[idx] = val
                val = dense
            yield name, val


# --- 3. redis-server SIGKILLed under load (AOF, appendfsync always) -------------------------------


def test_redis_server_sigkilled_under_load_keeps_acknowledged_writes(tmp_path):
    redis = RedisServer(tmp_path / "redis", appendfsync="always").start()
    env, loc, kw = index_env("redis", tmp_path, redis.url)
    srv = ServerProc(tmp_path, env)
    rng = np.random.default_rng(5)
    prng = random.Random(5)
    model = Model()
    served = 0
    t0 = time.monotonic()
    try:
        srv.start()
        with srv.client(timeout=20) as c:
            for cycle in range(REDIS_KILLS):
                stop = threading.Event()
                box: dict[str, int] = {}

                def writer(cycle: int = cycle, stop: threading.Event = stop, box: dict = box) -> None:
                    box["served"] = post_stream_until(c, model, rng, prng, f"r{cycle}", stop)

                th = threading.Thread(target=writer)
                th.start()
                time.sleep(prng.uniform(0.2, 0.8))
                redis.kill()
                time.sleep(0.3)  # requests meanwhile answer 503 (store down), never hang
                stop.set()
                th.join(60)
                assert not th.is_alive()
                served += box.get("served", 0)
                redis.start()  # replays the AOF
                with Index.open(loc, None, create=False, **kw) as ix:
                    verify(ix, model, atomic_batches=False)
            r = c.get("/health")
            assert r.status_code == 200, "the API server did not reconnect to the restarted Redis"
        with Index.open(loc, None, create=False, **kw) as ix:
            rep = ix.check()
            assert rep.ok, rep.summary()
    finally:
        srv.kill()
        redis.stop()
    assert model.acked > REDIS_KILLS
    record("crash-redis-server", kills=REDIS_KILLS, requests_acked=served, unacked_requests=model.unacked,
           unacked_applied=model.applied, unacked_not_applied=model.not_applied, vectors=len(model.state),
           seconds=round(time.monotonic() - t0, 1))


def post_stream_until(c: httpx.Client, model: Model, rng: np.random.Generator, prng: random.Random, tag: str,
                      stop: threading.Event) -> int:
    """Like :func:`post_stream`, but carries on through 503s and transport errors until ``stop``."""
    served = 0
    n = 0
    while not stop.is_set() and n < 10_000:
        served += post_stream(c, model, rng, prng, f"{tag}.{n}", stop, max_ops=1)
        n += 1
    return served
