"""``.ci/run`` works for a developer without root, where the system packages are present.

It once ran ``apt-get install`` unconditionally and so failed for anyone but root (issue #23,
finding 9). Here its system part (``--system-only``: packages, Docker engine, redis-server)
runs as an unprivileged user on this machine, which has what the tests need: when the suite
runs as root, as ``nobody``, in a directory of its own (pytest's temporary base is root's and
0700: issue #35, item 3), with a redis-server of its own on a free port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ci_system_setup_needs_no_root_when_packages_are_there(unprivileged):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed here: the script would have to install it, as root")
    as_user, home = unprivileged
    argv = [*as_user, "bash", str(REPO / ".ci" / "run"), "--system-only"]
    with socket.socket() as s:  # a port of its own, so that the script starts (and stops) its own redis-server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home), "GMMLSH_CI_REDIS_PORT": str(port)}
    proc = subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PONG" in proc.stdout and "apt-get" not in proc.stderr, proc.stdout + proc.stderr
