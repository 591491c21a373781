"""``gmmlsh bench``: run a benchmark script of bench/ (``python -m bench.NAME ARGS...``).

A thin hook, generic on purpose: the scripts own their options and their output,
and change without this command changing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from gmmlsh.service.cli.common import EXIT_OK, EXIT_USAGE, Formatter, UsageError

HELP = """\
Run a benchmark script from bench/ as `python -m bench.NAME ARGS...`, in the
current directory (relative paths in ARGS mean what they say). The scripts own
their options (try NAME --help) and write their results. They live in the
source checkout: they are not installed with the package.
"""
EXAMPLE = """\
Examples:
  gmmlsh bench --list
  gmmlsh bench NAME --help
  gmmlsh bench NAME -- --some-option value     # '--' ends gmmlsh's own options
"""


def bench_dir() -> Path:
    """bench/ of the checkout this package runs from (an editable install), or of the working directory."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "bench").is_dir():
            return root / "bench"
    return Path.cwd() / "bench"


def names() -> list[str]:
    """Runnable scripts (``bench/NAME.py`` with a ``__main__`` block) and packages
    (``bench/NAME/__main__.py``) of bench/; helper modules are not listed."""
    d = bench_dir()
    if not d.is_dir():
        return []
    found = {p.stem for p in d.glob("*.py") if not p.name.startswith("_") and "__main__" in p.read_text()}
    found |= {p.name for p in d.iterdir() if (p / "__main__.py").exists()}
    return sorted(found)


def add(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script from bench/", description=HELP, epilog=EXAMPLE,
                       formatter_class=Formatter)
    p.add_argument("--list", action="store_true", help="list the benchmark scripts")
    p.add_argument("name", nargs="?", help="script name (bench/NAME.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=run)


def run(args) -> int:
    found = names()
    if args.list or not args.name:
        if not found:
            print(f"no benchmark scripts in {bench_dir()}: they live in the source checkout (git clone the "
                  "repository and run gmmlsh bench from it)", file=sys.stderr)
            return EXIT_USAGE
        for n in found:
            print(n)
        return EXIT_OK if args.list else EXIT_USAGE
    name = args.name.removesuffix(".py")
    if name not in found:
        raise UsageError(f"no benchmark {name!r}; available: {', '.join(found) or 'none'}")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(bench_dir().parent), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call([sys.executable, "-P", "-m", f"bench.{name}", *script_args], env=env)
