"""What the machine did to a benchmark's threads from outside them, sampled: the CPU time the
host took from this virtual machine (``steal``), and the guest kernel's own memory stalls
(direct compaction and direct reclaim).

On a virtual machine the hypervisor may run something else on a virtual CPU's physical core;
the guest's kernel counts that time as *steal*, per CPU, in ticks of ``1 / SC_CLK_TCK`` s
(10 ms here). A thread on that CPU is stopped meanwhile: a 2 ms query caught in a 100 ms
steal takes 100 ms. (Whether the guest also charges the time to the thread as its own CPU
depends on its kernel; here it does not: ``bench.machine_stalls`` saw stalls of 32 ms carry
0.2–3 ms of the thread's CPU.)

The guest's kernel stalls a thread itself when the thread needs memory it has not got free:
a page fault in a mapping that asks for huge pages (``MADV_HUGEPAGE``, as the mirror's do)
may *compact* memory to make a 2 MiB page, and any allocation may *reclaim* page cache first
when free memory runs low. Both run on the faulting thread's time, as its own CPU (and
compaction moves pages other threads are reading, which then wait for them). Page cache dropped
under memory pressure (by the kernel's reclaim or, on this machine, by DAMON's proactive
``pageout`` of pages idle for a minute) is read back from the disk when next touched: a
*refault*, a major fault for the thread that touches it. ``/proc/vmstat`` counts them
machine-wide: ``compact_stall`` (direct compactions), ``allocstall_*`` (direct reclaims) and
``workingset_refault_file`` (file pages read back after being dropped).

Sampled by a process of its own (:func:`main`, a few tens of µs each time, off the measured
process's interpreter lock), so a benchmark can say which of its slow moments were the host's
or the kernel's.

    python -c "from bench.machine_watch import main; main()" --out FILE [--interval 0.02]  # until killed
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
#: The memory stalls counted: a column of the record each (``/proc/vmstat`` names, summed by prefix).
STALLS = ("compact_stall", "allocstall", "workingset_refault_file")


def steal_seconds() -> np.ndarray:
    """Seconds each CPU has been stolen since boot (0 where the kernel does not count it)."""
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                fields = line.split()
                out.append(int(fields[8]) * TICK if len(fields) > 8 else 0.0)
    return np.asarray(out)


def memory_stalls() -> list[int]:
    """Direct compactions, direct reclaims and file refaults since boot (:data:`STALLS`; 0 where
    not counted)."""
    counts = [0] * len(STALLS)
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                for j, prefix in enumerate(STALLS):
                    if name.startswith(prefix):
                        counts[j] += int(value)
    except OSError:
        pass
    return counts


class MachineLog:
    """A sampler's record: ``t`` (``time.monotonic``), each CPU's stolen seconds at ``t``, and the
    machine's memory stalls (:data:`STALLS`) counted by ``t``."""

    def __init__(self, t: np.ndarray, stolen: np.ndarray, stalls: np.ndarray):
        self.t, self.stolen, self.stalls = t, stolen, stalls

    @classmethod
    def read(cls, path: Path) -> MachineLog:
        """The samples of a file :func:`main` wrote (a last line cut short by its end left out)."""
        text = path.read_text() if path.exists() else ""
        lines = [line.split() for line in text[:text.rfind("\n") + 1].splitlines()]
        width = len(lines[0]) if lines else 1 + len(STALLS)
        rows = np.array([[float(v) for v in f] for f in lines], dtype=float).reshape(-1, width)
        return cls(rows[:, 0], rows[:, 1:width - len(STALLS)], rows[:, width - len(STALLS):])

    def _around(self, lo: float, hi: float) -> tuple[int, int]:
        """The last sample at or before ``lo`` and the first at or after ``hi`` (−1 where none)."""
        a = int(np.searchsorted(self.t, lo, side="right")) - 1
        b = int(np.searchsorted(self.t, hi, side="left"))
        return a, (b if b < self.t.shape[0] else -1)

    def during(self, lo: float, hi: float) -> float:
        """The most any one CPU was stolen between the samples around ``[lo, hi)`` (a thread runs
        on one CPU at a time: what it can have lost, at most); NaN where the record does not
        cover the span."""
        a, b = self._around(lo, hi)
        if a < 0 or b < 0:
            return float("nan")
        return float((self.stolen[b] - self.stolen[a]).max())

    def accounts_for(self, lo: float, hi: float, bound: float) -> bool:
        """Whether the steal around ``[lo, hi)`` covers its time past ``bound`` seconds: without
        what the host took, it would have been under the bound."""
        return hi - lo - self.during(lo, hi) <= bound

    def _within(self, lo: float, hi: float) -> tuple[int, int]:
        """:meth:`_around`, cut to the samples there are."""
        a, b = self._around(lo, hi)
        return max(a, 0), (b if b >= 0 else self.t.shape[0] - 1)

    def total(self, lo: float, hi: float) -> float:
        """Seconds stolen from all CPUs together between the samples around ``[lo, hi)``."""
        a, b = self._within(lo, hi)
        return float((self.stolen[b] - self.stolen[a]).sum()) if b > a else 0.0

    def stalls_between(self, lo: float, hi: float) -> np.ndarray:
        """The machine's memory stalls (:data:`STALLS`, each) between the samples around
        ``[lo, hi)``: the kernel's own stalls, of any thread, while it ran (0 where not covered)."""
        a, b = self._within(lo, hi)
        return (self.stalls[b] - self.stalls[a]).astype(np.int64) if b > a else np.zeros(len(STALLS), np.int64)


class MachineSampler:
    """:func:`main` in a child process for the length of a ``with`` block; :attr:`log` after it."""

    def __init__(self, path: Path, interval: float = 0.02):
        self.path, self.interval = path, interval
        self.log: MachineLog | None = None

    def __enter__(self) -> MachineSampler:
        self.proc = subprocess.Popen([sys.executable, "-c", "from bench.machine_watch import main; main()",
                                      "--out", str(self.path), "--interval", str(self.interval)])
        deadline = time.monotonic() + 30.0
        while not (self.path.exists() and "\n" in self.path.read_text()):  # a first sample before the block
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the machine sampler did not start (exit {self.proc.poll()})")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.log = MachineLog.read(self.path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True,
                   help="one line a sample: monotonic time, each CPU's steal (s), the memory stalls counted")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    a = p.parse_args(argv)
    with open(a.out, "w") as f:
        while True:
            f.write(" ".join([f"{time.monotonic():.6f}", *(f"{s:.2f}" for s in steal_seconds()),
                              *(str(c) for c in memory_stalls())]) + "\n")
            f.flush()
            time.sleep(a.interval)
