"""``gmmlsh bench``: run a benchmark script of bench/, or write the benchmark report for a data file."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from gmmlsh.service.cli.common import EXIT_OK, EXIT_USAGE, Formatter, UsageError

HELP = """\
Run a benchmark script from bench/ (python -m bench.NAME ARGS...). A thin hook:
the scripts own their options (try NAME --help) and write their results. The
scripts live in the source checkout (they are not installed with the package).

With --data FILE (or --out/--quick/--no-peer and no NAME) it writes the benchmark
report (bench/report: markdown + PNG plots) for your own data; FILE is any
format `gmmlsh build` reads, labels (svmlight) give the k-NN comparison. Without
--data the report uses Fashion-MNIST. More report options go after `--`.
"""
EXAMPLE = """\
Examples:
  gmmlsh bench --list
  gmmlsh bench NAME --help
  gmmlsh bench --data train.svm --out ./report
  gmmlsh bench --data vectors.npy --out ./report --quick -- --n 20000
"""


def bench_dir() -> Path:
    """bench/ of the checkout this package runs from (an editable install), or of the working directory."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "bench").is_dir():
            return root / "bench"
    return Path.cwd() / "bench"


def names() -> list[str]:
    d = bench_dir()
    found = {p.stem for p in d.glob("*.py") if not p.name.startswith("_")} if d.is_dir() else set()
    found |= {p.name for p in d.iterdir() if (p / "__main__.py").exists()} if d.is_dir() else set()
    return sorted(found)


def add(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script from bench/", description=HELP, epilog=EXAMPLE,
                       formatter_class=Formatter)
    p.add_argument("--list", action="store_true", help="list the benchmark scripts")
    p.add_argument("--data", metavar="FILE", help="write the benchmark report for this file")
    p.add_argument("--out", metavar="DIR", help="the report's folder (default ./report)")
    p.add_argument("--quick", action="store_true", help="report: small sizes, about a minute")
    p.add_argument("--no-peer", action="store_true", help="report: skip pynndescent")
    p.add_argument("name", nargs="?", help="script name (bench/NAME.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=run)


def _report_args(args) -> list[str] | None:
    """``bench --data FILE [--out DIR] ...`` → the report's arguments (paths made absolute); None otherwise."""
    if args.list or not (args.data or args.out or args.quick or args.no_peer):
        return None
    argv = []
    if args.data:
        if not Path(args.data).exists():
            raise UsageError(f"--data: no such file: {args.data}")
        argv += ["--data", str(Path(args.data).resolve())]
    argv += ["--out", str(Path(args.out or "report").resolve())]
    argv += ["--quick"] * args.quick + ["--no-peer"] * args.no_peer
    return argv + ([args.name] if args.name else []) + list(args.args)  # anything after `--`


def run(args) -> int:
    found = names()
    report = _report_args(args)
    if report is not None:
        args.name, args.args = "report", report
    if args.list or not args.name:
        if not found:
            print(f"no benchmark scripts in {bench_dir()}: they live in the source checkout (git clone the "
                  "repository and run gmmlsh bench from it)", file=sys.stderr)
            return EXIT_USAGE
        for n in found:
            print(n)
        return EXIT_OK if args.list else EXIT_USAGE
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in found:
        raise UsageError(f"no benchmark {name!r}; available: {', '.join(found) or 'none'}")
    root = bench_dir().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call([sys.executable, "-m", f"bench.{name}", *args.args], cwd=root, env=env)
