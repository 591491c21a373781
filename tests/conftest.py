"""Shared fixtures: the Fashion-MNIST data and numba thread settings.

Backend fixtures live beside the tests that need them (``redis_fixtures.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

DATA = Path(os.environ.get("GMMLSH_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
FMNIST = DATA / "fashion-mnist.npz"


@pytest.fixture(scope="session")
def fmnist():
    """(train, train_labels, test, test_labels) as uint8 arrays; skips only if the file is absent."""
    if not FMNIST.exists():
        pytest.fail(f"Fashion-MNIST not found at {FMNIST}; set GMMLSH_DATA to the folder holding it")
    d = np.load(FMNIST)
    return d["train"], d["train_labels"], d["test"], d["test_labels"]


@pytest.fixture(params=["lmdb", "redis"])
def location(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict]:
    """Where a fresh index lives: an LMDB directory, or a fresh prefix on a real Redis
    (with its search mirror under this test's temporary directory; the test module imports
    ``redis_url`` from ``redis_fixtures``)."""
    if request.param == "lmdb":
        return str(tmp_path / "idx"), {}
    return request.getfixturevalue("redis_url"), {"prefix": f"t{uuid.uuid4().hex[:12]}",
                                                  "cache_dir": str(tmp_path / "cache")}


#: The unprivileged user a root test run becomes where a test needs one (``nobody``).
NOBODY = 65534


@pytest.fixture
def unprivileged() -> tuple[list[str], Path]:
    """``(argv prefix, directory)``: how to run a command as an unprivileged user, and a fresh
    directory that user owns. As root: ``nobody`` (through ``setpriv``), in a directory made
    outside pytest's temporary base, which is root's and 0700 (nobody cannot even enter it);
    otherwise the user running the tests, as they are. Removed afterwards."""
    root = os.geteuid() == 0
    if root and not shutil.which("setpriv"):
        pytest.skip("running as root and setpriv is missing: cannot drop to an unprivileged user")
    d = Path(tempfile.mkdtemp(prefix="gmmlsh-user-", dir="/tmp" if root else None))
    try:
        if root:
            os.chown(d, NOBODY, NOBODY)
        yield (["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if root else []), d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmpfs():
    """``mount(path, size)``: a fresh tmpfs of ``size`` (e.g. ``"24m"``) mounted at ``path``
    (made if need be), unmounted afterwards: a small disk to fill. Needs the right to mount;
    where there is none, the test says so and skips."""
    mounted: list[Path] = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here: {proc.stderr.strip() or proc.returncode}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last byte with a ballast file; returns it
    (delete it to free the space)."""
    ballast = directory / "ballast"
    chunk = b"\0" * (64 << 10)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        for size in (4096, 512, 1):  # the last partial blocks
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                continue
    return ballast


@contextlib.contextmanager
def replaced_over_and_over(ix, names: list[str], X: np.ndarray, hot: list[int]) -> Iterator[None]:
    """While the block runs, a thread replaces the rows ``hot`` of ``names``/``X`` (each by the
    same vector) one after another, at random; an error of the writer is raised at the end."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        pick = random.Random(1)
        try:
            while not stop.is_set():
                i = pick.choice(hot)
                ix.upsert([names[i]], X[[i]])
        except Exception as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
    if errors:
        raise errors[0]
