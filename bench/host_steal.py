"""The CPU time the host took from this virtual machine: ``steal`` of ``/proc/stat``, sampled.

On a virtual machine the hypervisor may run something else on a virtual CPU's physical core;
the guest's kernel counts that time as *steal*, per CPU, in ticks of ``1 / SC_CLK_TCK`` s
(10 ms here). A thread on that CPU is stopped meanwhile: a 2 ms query caught in a 100 ms
steal takes 100 ms. (Whether the guest also charges the time to the thread as its own CPU
depends on its kernel; here it does not: ``bench.machine_stalls`` saw stalls of 32 ms carry
0.2–3 ms of the thread's CPU.) Sampled by a process of its own (:func:`main`, a few tens of
µs each time, off the measured process's interpreter lock), so a benchmark can say which of
its slow moments were the host's.

    python -c "from bench.host_steal import main; main()" --out FILE [--interval 0.02]  # until killed
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: Seconds a tick of ``/proc/stat`` is.
TICK = 1.0 / os.sysconf("SC_CLK_TCK")


def steal_seconds() -> np.ndarray:
    """Seconds each CPU has been stolen since boot (0 where the kernel does not count it)."""
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                fields = line.split()
                out.append(int(fields[8]) * TICK if len(fields) > 8 else 0.0)
    return np.asarray(out)


class StealLog:
    """A sampler's record: ``t`` (``time.monotonic``) and each CPU's stolen seconds at ``t``."""

    def __init__(self, t: np.ndarray, stolen: np.ndarray):
        self.t, self.stolen = t, stolen

    @classmethod
    def read(cls, path: Path) -> StealLog:
        """The samples of a file :func:`main` wrote (a last line cut short by its end left out)."""
        text = path.read_text() if path.exists() else ""
        lines = [line.split() for line in text[:text.rfind("\n") + 1].splitlines()]
        width = len(lines[0]) if lines else 2
        rows = np.array([[float(v) for v in f] for f in lines], dtype=float).reshape(-1, width)
        return cls(rows[:, 0], rows[:, 1:])

    def during(self, lo: float, hi: float) -> float:
        """The most any one CPU was stolen between the last sample at or before ``lo`` and the
        first at or after ``hi`` (a thread runs on one CPU at a time: what it can have lost, at
        most); NaN where the record does not cover the span."""
        a = np.searchsorted(self.t, lo, side="right") - 1
        b = np.searchsorted(self.t, hi, side="left")
        if a < 0 or b >= self.t.shape[0]:
            return float("nan")
        return float((self.stolen[b] - self.stolen[a]).max())

    def accounts_for(self, lo: float, hi: float, bound: float) -> bool:
        """Whether the steal around ``[lo, hi)`` covers its time past ``bound`` seconds: without
        what the host took, it would have been under the bound."""
        return hi - lo - self.during(lo, hi) <= bound

    def total(self, lo: float, hi: float) -> float:
        """Seconds stolen from all CPUs together between the samples around ``[lo, hi)``."""
        a = max(np.searchsorted(self.t, lo, side="right") - 1, 0)
        b = min(np.searchsorted(self.t, hi, side="left"), self.t.shape[0] - 1)
        return float((self.stolen[b] - self.stolen[a]).sum()) if b > a else 0.0


class StealSampler:
    """:func:`main` in a child process for the length of a ``with`` block; :attr:`log` after it."""

    def __init__(self, path: Path, interval: float = 0.02):
        self.path, self.interval = path, interval
        self.log: StealLog | None = None

    def __enter__(self) -> StealSampler:
        self.proc = subprocess.Popen([sys.executable, "-c", "from bench.host_steal import main; main()",
                                      "--out", str(self.path), "--interval", str(self.interval)])
        deadline = time.monotonic() + 30.0
        while not (self.path.exists() and "\n" in self.path.read_text()):  # a first sample before the block
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the steal sampler did not start (exit {self.proc.poll()})")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.log = StealLog.read(self.path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="one line a sample: monotonic time, each CPU's steal (s)")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    a = p.parse_args(argv)
    with open(a.out, "w") as f:
        while True:
            f.write(" ".join([f"{time.monotonic():.6f}", *(f"{s:.2f}" for s in steal_seconds())]) + "\n")
            f.flush()
            time.sleep(a.interval)

