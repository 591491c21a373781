"""The ``gmmlsh`` command line: build, serve, route, query, info, check, snapshot, collections, bench.

Every command names its index with ``--index DIR`` (LMDB) or ``--redis URL`` (plus
``--prefix NAME``); every option also reads a ``GMMLSH_*`` environment variable as its
default (the names the server's settings use). Exit codes: 0 ok, 1 runtime failure
(store down or full, I/O), 2 usage or input error, 130 interrupted. Errors are one
line; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys

import gmmlsh
from gmmlsh.service.cli import admin, bench, build, collections, query, route, serve
from gmmlsh.service.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    Formatter,
    UsageError,
    env_defaults,
    opt,
)

MAIN_HELP = """\
gmmlsh: near-neighbour search for the generalized min-max (GMM) similarity.
GCWS sketches searched through inverted lists and reranked by the exact GMM,
stored in LMDB or Redis, served over a REST API.
"""
MAIN_EXAMPLE = """\
Examples:
  gmmlsh build train.npy --index ./idx
  gmmlsh query --index ./idx --id 42
  gmmlsh serve --index ./idx --port 8000

Run 'gmmlsh COMMAND --help' for a command's options.
"""


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gmmlsh", description=MAIN_HELP, epilog=MAIN_EXAMPLE, formatter_class=Formatter)
    opt(p, "--debug", action="store_true", default=False, help="show tracebacks")
    p.add_argument("--version", action="version", version=f"gmmlsh {gmmlsh.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (build, serve, route, query, admin, collections, bench):
        module.add(sub)
    env_defaults([p, *sub.choices.values()])
    return p


def _error_code(exc: BaseException) -> int:
    """Usage/input problems → 2; everything else (store down or full, I/O, bugs) → 1."""
    from gmmlsh.core.validate import VectorError
    from gmmlsh.index.index import UnknownIdError
    from gmmlsh.index.ingest.readers import InputFormatError
    from gmmlsh.index.store.base import ConfigConflict

    if isinstance(exc, UsageError | InputFormatError | VectorError | ConfigConflict | UnknownIdError):
        return EXIT_USAGE
    return EXIT_RUNTIME


def _message(exc: BaseException) -> str:
    from gmmlsh.index.index import UnknownIdError

    if isinstance(exc, UnknownIdError):
        return str(exc)
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    if type(exc).__module__ != "builtins" and not isinstance(exc, UsageError | ValueError | KeyError):
        text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gmmlsh`` console script; returns the exit code."""
    args = make_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"gmmlsh {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        print(f"gmmlsh {args.command}: error: {_message(exc)}", file=sys.stderr)
        return _error_code(exc)
