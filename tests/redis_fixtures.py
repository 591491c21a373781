"""Real Redis servers for the tests: a throwaway ``redis-server`` and a local 3-master Cluster.

No mocks: each fixture starts real ``redis-server`` processes on free loopback
ports in a temporary directory and stops them afterwards, also when a test
fails. Every wait is bounded. Use them by importing into a test module::

    from redis_fixtures import redis_url, redis_cluster_url  # noqa: F401

``GMMLSH_TEST_REDIS_URL`` (e.g. set by CI, which starts one server on
loopback) makes :func:`redis_url` use that server instead of starting one;
tests that must kill and restart a server use :func:`redis_server` /
:class:`RedisServer`, which always start their own.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


def _require_binaries(*names: str) -> None:
    missing = [n for n in names if not Path(n).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install redis (7.x) to run the Redis tests"
                    " (or set GMMLSH_TEST_REDIS_URL for the single-server ones)")


_port_lock = threading.Lock()
_ports_handed_out: set[int] = set()


def free_port(bus: bool = False) -> int:
    """A free loopback TCP port (and port + 10000 free too when ``bus``: the Cluster bus)."""
    with _port_lock:
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port in _ports_handed_out or (bus and port + 10000 > 65535):
                continue
            if bus:
                try:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            _ports_handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port found")


def _ping(port: int, timeout: float = 0.5) -> bytes | None:
    """Raw RESP PING (no client library involved): the reply, or None if nothing answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64)
    except OSError:
        return None


class RedisServer:
    """One ``redis-server`` process we own: start, SIGKILL, restart on the same port and data.

    ``appendfsync`` is ``always`` by default (an acknowledged write is on disk):
    the crash tests rely on it.
    """

    def __init__(self, workdir: Path, *, port: int | None = None, appendfsync: str = "always",
                 extra: list[str] | None = None, cluster: bool = False) -> None:
        _require_binaries(REDIS_SERVER)
        self.port = port or free_port(bus=cluster)
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--daemonize", "no", "--save", "",
            "--appendonly", "yes", "--appendfsync", appendfsync,
            "--logfile", str(self.dir / "redis.log"), "--protected-mode", "no",
        ]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file",
                          str(self.dir / "nodes.conf"), "--cluster-node-timeout", "5000"]
        self.args += extra or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = START_TIMEOUT) -> RedisServer:
        """Start and wait (bounded) until it answers PING (not LOADING)."""
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            reply = _ping(self.port)
            if reply and not reply.startswith(b"-LOADING"):  # +PONG, or -NOAUTH: it is up
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not come up in {timeout}s: "
                           f"{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync — a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, bounded wait, then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_TIMEOUT)
        self.proc = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster3:
    """Three cluster-enabled masters with ``replicas`` replicas each, joined with ``redis-cli
    --cluster create`` (the masters are ``nodes[:3]``)."""

    def __init__(self, workdir: Path, replicas: int = 0) -> None:
        _require_binaries(REDIS_SERVER, REDIS_CLI)
        self.replicas = replicas
        self.nodes = [RedisServer(Path(workdir) / f"node{i}", cluster=True,
                                  appendfsync="everysec") for i in range(3 * (1 + replicas))]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> RedisCluster3:
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, capture_output=True, timeout=timeout)
            self._wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout: float) -> None:
        """Until every node says cluster_state:ok and knows every node, and every replica has
        synced (bounded)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            good = 0
            for node in self.nodes:
                out = subprocess.run([REDIS_CLI, "-p", str(node.port), "cluster", "info"],
                                     capture_output=True, text=True, timeout=5).stdout
                last = out
                if "cluster_state:ok" in out and f"cluster_known_nodes:{len(self.nodes)}" in out:
                    good += 1
            if good == len(self.nodes) and all(self._link_up(n.port) for n in self.nodes[3:]):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok after {timeout}s: {last}")

    @staticmethod
    def _link_up(port: int) -> bool:
        """Whether the replica at ``port`` has synced with its master."""
        out = subprocess.run([REDIS_CLI, "-p", str(port), "info", "replication"], capture_output=True, text=True,
                             timeout=5).stdout
        return "master_link_status:up" in out

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


# --- shared servers (one per test process, however many modules import the fixtures) ------

_shared: dict[str, object] = {}
_shared_lock = threading.Lock()
_shared_dirs: list[tempfile.TemporaryDirectory] = []


def _shared_instance(kind: str) -> object:
    with _shared_lock:
        inst = _shared.get(kind)
        if inst is None:
            tmp = tempfile.TemporaryDirectory(prefix=f"gmmlsh-{kind}-")
            _shared_dirs.append(tmp)
            # The shared server is for tests that do not crash it: everysec keeps it fast.
            inst = (RedisServer(Path(tmp.name), appendfsync="everysec") if kind == "server"
                    else RedisCluster3(Path(tmp.name))).start()
            _shared[kind] = inst
        return inst


def _stop_shared() -> None:
    with _shared_lock:
        for inst in _shared.values():
            inst.stop()  # type: ignore[attr-defined]
        _shared.clear()
        for tmp in _shared_dirs:
            tmp.cleanup()
        _shared_dirs.clear()


atexit.register(_stop_shared)  # also when the session dies before its finalizers run


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a Redis server for the whole session (``GMMLSH_TEST_REDIS_URL`` or our own)."""
    env = os.environ.get("GMMLSH_TEST_REDIS_URL")
    if env:
        yield env
        return
    server = _shared_instance("server")
    request.addfinalizer(_stop_shared)
    yield server.url  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def redis_cluster_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of one node of a local 3-master Redis Cluster, for the whole session."""
    cluster = _shared_instance("cluster")
    request.addfinalizer(_stop_shared)
    yield cluster.url  # type: ignore[attr-defined]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of our own for one test (``appendfsync always``), to SIGKILL and restart."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


_counter = [0]


@pytest.fixture
def redis_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix no other test uses, so tests can share one server without flushing it."""
    _counter[0] += 1
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    return f"t{os.getpid()}_{_counter[0]}_{name}"
