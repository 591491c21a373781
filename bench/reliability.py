"""Reliability figures: run the crash, soak, fuzz, hostile-input and check/snapshot tests and
record what they did (kills survived, requests served, fuzz cases, time taken).

    python -m bench.reliability [--kills 30] [--soak-seconds 30] [--fuzz-examples 100] [--out FILE]

The tests are the CI's own (tests/test_crash.py, test_soak.py, test_fuzz.py,
test_hostile.py, test_check_snapshot.py); this script runs each file with pytest,
collects the figures the tests append to ``$GMMLSH_RELIABILITY_LOG``, and writes a
Markdown report (default ``bench/out/reliability.md``). Larger ``--kills`` /
``--soak-seconds`` / ``--fuzz-examples`` run the same tests longer than CI does.
Needs ``redis-server`` on the PATH (or ``GMMLSH_TEST_REDIS_URL``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ["test_check_snapshot.py", "test_crash.py", "test_soak.py", "test_fuzz.py", "test_hostile.py"]


def run(files: list[str], env: dict[str, str]) -> list[tuple[str, float, int, str]]:
    """(file, wall seconds, exit code, pytest's last line) per test file."""
    out = []
    for name in files:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{name}"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
        out.append((name, time.monotonic() - t0, p.returncode, last))
        print(f"{name}: {last} ({time.monotonic() - t0:.0f} s)", flush=True)
        if p.returncode:
            print(p.stdout[-4000:], p.stderr[-2000:], sep="\n", file=sys.stderr)
    return out


def render(figures: list[dict], runs: list[tuple[str, float, int, str]], args: argparse.Namespace) -> str:
    total = sum(t for _, t, _, _ in runs)
    lines = [
        "# Reliability: kill it, flood it, fuzz it",
        "",
        f"`python -m bench.reliability --kills {args.kills} --soak-seconds {args.soak_seconds:g} "
        f"--fuzz-examples {args.fuzz_examples}` on {os.cpu_count()} cores ({platform.machine()}, "
        f"Python {platform.python_version()}), {time.strftime('%Y-%m-%d')}. All tests passed: "
        f"{'yes' if all(rc == 0 for _, _, rc, _ in runs) else 'NO'}.",
        "",
        "| test file | wall time | result |",
        "|---|---|---|",
    ]
    lines += [f"| `tests/{n}` | {t:.0f} s | {last} |" for n, t, _, last in runs]
    lines += [f"| **all** | **{total:.0f} s** | |", "", "| test | figures |", "|---|---|"]
    for f in figures:
        name = f.pop("test")
        lines.append(f"| {name} | " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in f.items()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30, help="server SIGKILLs per backend (GMMLSH_CRASH_KILLS)")
    ap.add_argument("--build-kills", type=int, default=6, help="build SIGKILLs per backend")
    ap.add_argument("--redis-kills", type=int, default=10, help="redis-server SIGKILLs")
    ap.add_argument("--soak-seconds", type=float, default=30.0, help="soak duration per backend")
    ap.add_argument("--fuzz-examples", type=int, default=100, help="schemathesis cases per operation")
    ap.add_argument("--files", nargs="*", default=FILES, help="test files to run (default: all five)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "reliability.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "figures.jsonl"
        env = {**os.environ, "GMMLSH_RELIABILITY_LOG": str(log), "GMMLSH_CRASH_KILLS": str(args.kills),
               "GMMLSH_CRASH_BUILD_KILLS": str(args.build_kills), "GMMLSH_CRASH_REDIS_KILLS": str(args.redis_kills),
               "GMMLSH_SOAK_SECONDS": str(args.soak_seconds), "GMMLSH_FUZZ_EXAMPLES": str(args.fuzz_examples)}
        runs = run(args.files, env)
        figures = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(figures, runs, args))
    print(f"wrote {args.out}")
    sys.exit(max(rc for _, _, rc, _ in runs))


if __name__ == "__main__":
    main()
