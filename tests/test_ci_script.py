"""``.ci/run`` works for a developer without root, where the system packages are present.

It once ran ``apt-get install`` unconditionally and so failed for anyone but root (issue #23,
finding 9). Here its system part (``--system-only``: packages, Docker engine, redis-server)
runs as an unprivileged user on this machine, which has what the tests need.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ci_system_setup_needs_no_root_when_packages_are_there(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed here: the script would have to install it, as root")
    argv = ["bash", str(REPO / ".ci" / "run"), "--system-only"]
    if os.geteuid() == 0:  # become nobody
        if not shutil.which("setpriv"):
            pytest.skip("running as root and setpriv is missing: cannot drop to an unprivileged user")
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    os.chmod(tmp_path, 0o777)
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PONG" in proc.stdout and "apt-get" not in proc.stderr, proc.stdout + proc.stderr
