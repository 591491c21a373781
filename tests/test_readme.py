"""The README's command blocks run as written, in order, on a fresh copy of the repository.

A newcomer copies them one after another, so this test does too: the project's files (as
git sees them) are copied into a fresh directory beside a link to the shared data (the
README reads ``../shared/data``), and every fenced or indented command block runs there:
shell blocks with bash (``set -e``; ``curl`` fails on an HTTP error status), Python blocks
with the Python of the virtual environment the quick start made, whose ``bin`` is first
on ``PATH`` (the README says to activate it). A line that starts ``gmmlsh serve`` runs in
the background until the next one replaces it; the test waits for its ``/health`` before
going on. The Redis examples talk to ``localhost:6379``: the test starts a
``redis-server`` there for them (and fails, saying so, if the port is taken).

Two blocks are not run here, for a reason each: the test command (it is what runs this
test) and the Docker blocks (``tests/test_docker.py`` runs those against a real engine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHARED = REPO.parent / "shared"
#: Blocks left to other tests: (section heading, text the block contains) → why.
NOT_HERE = {
    ("Quick start", "pytest"): "the test command: it is what runs this test",
    ("Deployment", "docker"): "tests/test_docker.py runs the Docker blocks against a real engine",
    ("Beyond one machine", "gmmlsh route"): "it needs a Redis Cluster: tests/test_router.py runs that layout "
    "with real processes",
}
#: A shell that stops at the first failing command, and a curl that fails on an HTTP error.
PRELUDE = 'set -euo pipefail\ncurl() { command curl -sS --fail-with-body "$@"; echo; }\n'
SERVE = re.compile(r"^(?P<before>.*?&&\s*)?(?P<serve>(?:\S+=\S+\s+)*\S*gmmlsh serve\b.*)$")


@dataclass(frozen=True)
class Block:
    heading: str
    lang: str  # "bash" or "python"
    text: str
    line: int  # where it starts in the README

    def where(self) -> str:
        return f"README.md:{self.line} ({self.heading})"


def blocks(markdown: str) -> list[Block]:
    """Fenced (```bash / ```python) and indented (shell) code blocks, with their section."""
    out: list[Block] = []
    lines = markdown.splitlines()
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("```"):
            lang, start = line[3:].strip(), i
            i += 1
            body = []
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if lang in ("bash", "sh", "python"):
                out.append(Block(heading, "python" if lang == "python" else "bash", "\n".join(body), start + 1))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            start, body = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            out.append(Block(heading, "bash", "\n".join(body).strip("\n"), start + 1))
            continue
        i += 1
    return out


def commands(text: str) -> list[str]:
    """A shell block's commands: lines joined until bash reads them as complete (across
    ``\\`` and across quotes that span lines)."""
    out, current = [], ""
    for line in text.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.endswith("\\") or subprocess.run(["bash", "-n", "-c", current], capture_output=True).returncode:
            continue
        if current.strip():
            out.append(current)
        current = ""
    assert not current, f"unterminated command: {current!r}"
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Session:
    """The newcomer's shell: a fresh copy of the repository, its venv on PATH, one server."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("GMMLSH_", "VIRTUAL_ENV", "NUMBA_"))}
        self.env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{self.env['PATH']}"
        self.server: subprocess.Popen | None = None
        self.log = root / "server.log"

    def run(self, block: Block) -> None:
        if block.lang == "python":
            self._check(block, [str(self.root / ".venv" / "bin" / "python"), "-c", block.text], block.text)
            return
        for command in commands(block.text):
            m = SERVE.match(command)
            if m and m["before"]:
                self._shell(block, m["before"].rstrip().removesuffix("&&"))
            if m:
                self.serve(block, m["serve"])
            else:
                self._shell(block, command)

    def _shell(self, block: Block, command: str) -> None:
        self._check(block, ["bash", "-c", PRELUDE + command], command)

    def _check(self, block: Block, argv: list[str], shown: str) -> None:
        proc = subprocess.run(argv, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (f"{block.where()}: exit {proc.returncode} from\n{shown}\n"
                                      f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}")

    def serve(self, block: Block, command: str) -> None:
        """Start ``command`` (a ``gmmlsh serve`` line) in place of the server before it."""
        self.stop()
        port = int(re.search(r"--port\s+(\d+)", command)[1]) if "--port" in command else 8000
        assert _port_free(port), f"{block.where()}: port {port} is taken; the README's server needs it"
        self.server = subprocess.Popen(["bash", "-c", command], cwd=self.root, env=self.env,
                                       stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.server.poll() is None, f"{block.where()}: {command!r} exited:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{block.where()}: {command!r} not healthy in 300 s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.server = None


def _fresh_copy(dest: Path) -> Path:
    """The repository's files as git sees them (tracked, and new ones not ignored), copied
    to ``dest/gmmlsh``, with ``dest/shared`` linking to the shared data."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    root = dest / "gmmlsh"
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
    (dest / "shared").symlink_to(SHARED)
    return root


@pytest.fixture
def redis_6379(tmp_path):
    """A redis-server on localhost:6379 for the README's Redis examples."""
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not on the PATH (the README's test command says to install it)")
    assert _port_free(6379), "port 6379 is taken: the README's Redis examples need a fresh redis-server there"
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", "6379", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        if not _port_free(6379):
            break
        time.sleep(0.05)
    yield
    proc.terminate()
    proc.wait(10)


def test_readme_parses_into_the_blocks_a_reader_sees():
    """The parser finds the blocks (so that the test below cannot pass by finding none)."""
    found = blocks(README.read_text())
    headings = {b.heading for b in found}
    assert {"Quick start", "Python API", "Command line", "Service", "Integrity check", "Backups"} <= headings
    assert sum(b.lang == "python" for b in found) >= 1
    multi = [c for b in found if b.lang == "bash" for c in commands(b.text) if "\n" in c]
    assert multi, "the Service section's multi-line curl commands are read as one command each"


def test_every_command_block_runs_as_written(tmp_path, redis_6379):
    if not SHARED.is_dir():
        pytest.fail(f"{SHARED} is missing: the README's commands read ../shared/data")
    session = Session(_fresh_copy(tmp_path))
    ran = 0
    try:
        for block in blocks(README.read_text()):
            reason = next((why for (heading, text), why in NOT_HERE.items()
                           if block.heading == heading and text in block.text), None)
            if reason:
                print(f"{block.where()}: not run here: {reason}", file=sys.stderr)
                continue
            session.run(block)
            ran += 1
    finally:
        session.stop()
    assert ran >= 8
