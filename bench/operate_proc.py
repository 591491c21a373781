"""The processes of ``bench_operate``: started, made ready, let go at one moment, collected.

A child (the writer, the HTTP query client) loads what it needs, prints ``ready``, and
waits for one line ``go T0 T_END`` on its standard input: the moments (``time.monotonic``,
one clock for every process of the machine) at which its load starts and stops. It writes
its results to a JSON file named on its command line and exits. Starting every part at
the same T0 keeps their timelines comparable, and a child's own start-up (numba, data)
out of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO


def ready() -> tuple[float, float]:
    """In a child: say it is ready, then wait for (T0, T_END)."""
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if not line or line[0] != "go":
        raise SystemExit("no go: the harness went away")
    return float(line[1]), float(line[2])


def wait_until(moment: float) -> None:
    while (left := moment - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


class Child:
    """One child process of the benchmark: ``MODULE.main()`` with ``ARGS… --result FILE`` as its
    command line (helpers, not scripts: ``gmmlsh bench --list`` leaves them out)."""

    def __init__(self, module: str, args: list[str], result: Path, log: IO, env: dict | None = None):
        self.name, self.result = module, result
        self.proc = subprocess.Popen([sys.executable, "-c", f"from {module} import main; main()", *args,
                                      "--result", str(result)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()  # the child loads its data first: no timeout here, it says when it fails
        if line.strip() != "ready":
            self.proc.wait()
            raise RuntimeError(f"{self.name} did not start (exit {self.proc.returncode}): see its log")

    def go(self, t0: float, t_end: float) -> None:
        self.proc.stdin.write(f"go {t0} {t_end}\n")
        self.proc.stdin.flush()

    def collect(self, timeout: float) -> dict:
        """Wait for the child to finish; its result."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"{self.name} did not finish within {timeout:.0f} s") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see its log")
        return json.loads(self.result.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
