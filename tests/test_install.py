"""The README's two installs, one after the other in one virtual environment (issue #35, item 1).

The quick start installs the package (``pip install .``) and runs it, which compiles numba's
kernels and caches them on disk; the test command then installs it editable
(``pip install -e ".[test]"``) into the same environment. numba used to cache the kernels
beside their modules, inside ``site-packages/gmmlsh``: pip's uninstall left those folders
behind, and they shadowed the editable install (``No module named 'gmmlsh.index.index'``).
Kernels are now cached in a user cache directory (``NUMBA_CACHE_DIR`` overrides it), so the
installed package's folder holds only what pip put there.

Here both installs run in a fresh virtual environment, on a copy of the repository, with
``--no-deps``: the dependencies come from the environment running the tests (a path line in
the new environment's ``.pth``), so the test takes seconds, not the minutes a full download
and install of numba, scipy and pyarrow take; ``tests/test_readme.py`` runs the README's own
commands in full.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import NOBODY
from test_readme import _fresh_copy

#: Compiles and caches a few kernels, then uses them.
KERNEL = "import numpy as np; from gmmlsh.core.gmm import gmm; print(gmm(np.ones(3), np.arange(3.0)))"


def _run(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{' '.join(argv)}: exit {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def test_an_editable_install_after_a_package_install_imports(unprivileged):
    """As a user without root (``nobody`` when the suite runs as root: root could write where a
    user cannot), in a fresh clone and virtual environment of that user's."""
    as_user, home = unprivileged
    src = _fresh_copy(home / "clone")
    if as_user:
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(home)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "GMMLSH_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(HOME=str(home), TMPDIR=str(home), XDG_CACHE_HOME=str(home / "cache"))
    venv = home / "venv"
    # The user's python3, as the README says (root's pyenv may be out of a user's reach); the
    # dependencies come from this run's environment, so it must be the same minor version.
    _run([*as_user, "bash", "-c", f"python3 -m venv --without-pip {venv}"], home, env)
    py = str(venv / "bin" / "python")
    version = _run([*as_user, py, "-c", "import sys; print(sys.version_info[:2])"], home, env).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"the user's python3 is {version}, the tests run on {sys.version_info[:2]}")
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home, env).stdout.strip())
    _run([*as_user, py, "-c", f"open({str(site / 'deps.pth')!r}, 'w').write({sysconfig.get_paths()['purelib']!r})"],
         home, env)  # numpy, numba, pip, ...: the test runner's
    pip = [*as_user, py, "-m", "pip", "install", "--no-deps", "-q"]

    _run([*pip, "."], src, env)  # the quick start's install, then a kernel runs (and is cached)
    assert _run([*as_user, py, "-c", KERNEL], home, env).stdout.strip() == "0.5"
    cached = list((home / "cache" / "gmmlsh" / "numba").rglob("*.nbi"))
    assert cached, "the kernels are cached in the user cache directory"
    assert not list((site / "gmmlsh").rglob("*.nb[ic]")), "no kernel cached inside the installed package"

    _run([*pip, "-e", "."], src, env)  # the test command's install
    assert not (site / "gmmlsh").exists(), f"left behind: {sorted(map(str, (site / 'gmmlsh').rglob('*')))[:5]}"
    out = _run([*as_user, py, "-c", "import gmmlsh.index.index as m, gmmlsh.service.cli; print(m.__file__)"],
               home, env)
    assert out.stdout.strip() == str(src / "index" / "index.py")
    assert _run([*as_user, py, "-c", KERNEL], home, env).stdout.strip() == "0.5"

    # NUMBA_CACHE_DIR says where, when set.
    mine = home / "mine"
    _run([*as_user, py, "-c", KERNEL], home, {**env, "NUMBA_CACHE_DIR": str(mine)})
    assert list(mine.rglob("*.nbi"))


def test_the_kernel_cache_is_named_by_every_kernel_source(tmp_path, monkeypatch):
    """numba checks only a cached kernel's own file: after an edit of a kernel it calls from
    another module it would run the old code. The cache folder's name covers every source."""
    import gmmlsh

    for name in ("core/gcws.py", "core/gcws_walk.py", "index/columns.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(gmmlsh, "__file__", str(tmp_path / "__init__.py"))
    before = gmmlsh._kernel_fingerprint()
    assert gmmlsh._kernel_fingerprint() == before
    os.utime(tmp_path / "core/gcws_walk.py", ns=(1, 1))
    edited = gmmlsh._kernel_fingerprint()
    assert edited != before
    (tmp_path / "core/gcws_walk.py").write_text("x = 22\n")
    assert gmmlsh._kernel_fingerprint() not in (before, edited)


def test_kernel_caches_of_other_sources_go_once_a_day_old(tmp_path):
    import gmmlsh

    old, young = tmp_path / "0123456789abcdef", tmp_path / "fedcba9876543210"
    for d in (old, young):
        (d / "core_1").mkdir(parents=True)
        (d / "core_1" / "k.nbi").write_bytes(b"")
    os.utime(old, (0, 0))
    gmmlsh._remove_old_kernels(tmp_path)
    assert not old.exists() and young.exists()
    gmmlsh._remove_old_kernels(tmp_path / "missing")  # no cache yet: nothing to do
