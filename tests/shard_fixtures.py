"""Real processes of a sharded deployment for the tests and benchmarks: search nodes
(``gmmlsh serve --group g/G``) and routers (``gmmlsh route``) on loopback ports, each a
subprocess in its own session, stopped (or SIGKILLed) by its own process id. Every wait is
bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from redis_fixtures import free_port

START_TIMEOUT = float(os.environ.get("GMMLSH_TEST_NODE_TIMEOUT", 240))


class Proc:
    """One gmmlsh server process of ours: start, wait until healthy, stop, SIGKILL, SIGSTOP."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, port: int | None = None):
        self.port = port or free_port()
        self.args = [sys.executable, "-m", "gmmlsh.service.cli", *args, "--port", str(self.port)]
        self.log = log
        self.env = {**os.environ, "NUMBA_NUM_THREADS": "1", "GMMLSH_LOG_LEVEL": "warning",
                    "GMMLSH_ACCESS_LOG": "false", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        out.close()
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT, want: dict | None = None) -> dict:
        """Until ``/health`` answers 200 (and its body holds ``want``), bounded."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[3:5]} exited with {self.proc.returncode}: {self.tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                last = r.text
                if r.status_code == 200 and all(r.json().get(k) == v for k, v in (want or {}).items()):
                    return r.json()
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"{self.url} not healthy after {timeout}s: {last}; log: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (and SIGCONT first, in case it is stopped): a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


def node(redis_url: str, prefix: str, group: str, cache_dir: Path, logs: Path, **env: str) -> Proc:
    """A search node serving ``group`` ("g/G") of the index, its mirror under ``cache_dir``."""
    tag = group.replace("/", "of")
    return Proc(["serve", "--redis", redis_url, "--prefix", prefix, "--group", group, "--cache-dir", str(cache_dir)],
                logs / f"node-{tag}-{cache_dir.name}.log", env=env)


def router(redis_url: str, prefix: str, logs: Path, groups: int | None = None, **env: str) -> Proc:
    args = ["route", "--redis", redis_url, "--prefix", prefix] + (["--groups", str(groups)] if groups else [])
    return Proc(args, logs / f"router-{groups or 'auto'}-{len(list(logs.glob('router-*')))}.log", env=env)
