"""How long the machine itself stalls a thread that computes or reads memory: the floor under any latency.

A thread runs fixed units of work for ``--seconds`` and times each: with ``--unit sort`` (the
default) pure CPU work (a sort of 3,000 floats, tens of µs, in the CPU's caches); with
``--unit memory`` reads of 2,000 rows at random from ``--gib`` of memory (as a query reads the
mirror: each read a cache and TLB miss, ~0.2 ms a unit), which a host that pages or remaps its
guest's memory stalls where a sort does not. Every unit over ``--over`` ms is listed with what
the kernel counted for it (``getrusage`` of the thread: CPU time, involuntary switches, minor
faults), the host's ``steal`` around it and the guest kernel's direct compactions and reclaims of
memory and file refaults (:mod:`bench.machine_watch`): a stall with no switch, no fault and no
compaction is time the virtual CPU lost to its host, seen as steal, or (here, for memory units)
charged to the thread as its own CPU with no steal. ``--busy N`` runs N processes spinning
beside it (N = cores − 1: the other cores busy, as under the operation benchmark's load).

    python -m bench.machine_stalls [--seconds 600] [--busy 0] [--unit sort|memory] [--gib 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.common import emit
from bench.machine_watch import MachineSampler


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _units(kind: str, gib: float) -> Callable[[], object]:
    """One unit of work of ``kind``, ready to call (its memory allocated and touched)."""
    rng = np.random.default_rng(0)
    if kind == "sort":
        x = rng.random(3000)
        return lambda: np.sort(x)
    rows = np.ones((int(gib * (1 << 30)) // 256, 64), np.float32)  # 256-byte rows, every page touched
    picks = itertools.cycle([rng.integers(0, rows.shape[0], 2000) for _ in range(64)])
    out = np.empty((2000, 64), np.float32)
    return lambda: np.take(rows, next(picks), axis=0, out=out)


def stalls(seconds: float, over_ms: float, unit: Callable[[], object]
           ) -> tuple[int, float, list[tuple[float, float, int, int, float]]]:
    """(units run, the longest unit's ms, [(ms, CPU ms, involuntary switches, minor faults, start
    on ``time.monotonic``) of each unit over ``over_ms``])."""
    unit()
    units, longest, slow = 0, 0.0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = resource.getrusage(resource.RUSAGE_THREAD)
        t = time.monotonic()
        unit()
        took = time.monotonic() - t
        units += 1
        longest = max(longest, took * 1e3)
        if took * 1e3 > over_ms:
            after = resource.getrusage(resource.RUSAGE_THREAD)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            slow.append((took * 1e3, cpu * 1e3, after.ru_nivcsw - before.ru_nivcsw, after.ru_minflt - before.ru_minflt,
                         t))
    return units, longest, slow


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--over", type=float, default=5.0, help="list units over this many ms")
    p.add_argument("--busy", type=int, default=0, help="processes spinning beside the timed thread")
    p.add_argument("--unit", choices=("sort", "memory"), default="sort", help="the work timed (above)")
    p.add_argument("--gib", type=float, default=4.0, help="memory the memory unit reads from")
    p.add_argument("--out", type=Path, help="write the report here too")
    a = p.parse_args(argv)
    unit = _units(a.unit, a.gib)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.busy)]
    for s in spinners:
        s.start()
    try:
        with tempfile.TemporaryDirectory() as tmp, MachineSampler(Path(tmp) / "machine.txt") as machine:
            units, longest, slow = stalls(a.seconds, a.over, unit)
    finally:
        stop.set()
        for s in spinners:
            s.join()
    quiet = sum(1 for _, cpu, sw, flt, _ in slow if sw == 0 and flt == 0)
    log = machine.log
    stolen = [log.during(t, t + ms / 1e3) * 1e3 for ms, _, _, _, t in slow]
    kernel = [log.stalls_between(t, t + ms / 1e3) for ms, _, _, _, t in slow]
    hosts = sum(log.accounts_for(t, t + ms / 1e3, a.over / 1e3) for ms, _, _, _, t in slow)
    lines = [f"    python -m bench.machine_stalls --seconds {a.seconds:g} --busy {a.busy} --unit {a.unit}"
             + (f" --gib {a.gib:g}" if a.unit == "memory" else ""), "",
             f"{units:,} {a.unit} units ({a.seconds / units * 1e6:.0f} µs each on average) in {a.seconds:g} s, "
             f"{a.busy} spinning process(es) beside: "
             f"{len(slow)} over {a.over:g} ms, the longest {longest:.1f} ms; "
             f"{quiet} of them with no context switch and no fault; in {hosts} the host took a CPU (`steal`) "
             f"for at least the time past {a.over:g} ms; {log.total(-np.inf, np.inf):.2f} CPU s stolen in all; "
             f"{sum(k.any() for k in kernel)} of them with a direct compaction or reclaim of memory, or a file "
             "refault, around them.",
             "", "| ms | CPU ms (the thread's) | involuntary switches | minor faults | host steal around it, ms | "
             "direct compactions, reclaims, file refaults around it |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {ms:.1f} | {cpu:.1f} | {sw} | {flt} | {took:.0f} | {k[0]}, {k[1]}, {k[2]} |"
              for (ms, cpu, sw, flt, _), took, k in sorted(zip(slow, stolen, kernel, strict=True),
                                                         key=lambda row: row[0], reverse=True)]
    emit(lines, a.out)


if __name__ == "__main__":
    main()
