"""The README's command blocks run as written, in order, on a fresh copy of the repository.

A newcomer copies them one after another, so this test does too: the project's files (as
git sees them) are copied into a fresh directory beside a link to the shared data (the
README reads ``../shared/data``), and every fenced or indented command block runs there:
shell blocks with bash (``set -e``; ``curl`` fails on an HTTP error status), Python blocks
with the Python of the virtual environment the quick start made, whose ``bin`` is first
on ``PATH`` (the README says to activate it). A line that starts ``gmmlsh serve`` runs in
the background until the next one replaces it; the test waits for its ``/health`` before
going on. The Redis examples talk to ``localhost:6379``: the test starts a
``redis-server`` for them. The README's ports (the server's 8000, Redis' 6379) are replaced by
free ones in every command, so that a server the reader left running (the quick start's, a
Redis of their own) is no obstacle.

The test command runs as written but for its last step: the suite is collected, not run
(collecting imports every test module, so a broken install shows; running it is what runs
this test). The Docker blocks are not run here (``tests/test_docker.py`` runs them against a
real engine). Every file the commands leave in the copy must be one git ignores, so that a
clone where someone has tried the README copies clean into the next run.
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
from conftest import DATA

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHARED = DATA.parent  # ../shared beside the repository, or where GMMLSH_DATA says (conftest)
#: Blocks left to other tests: (section heading, text the block contains) → why.
NOT_HERE = {
    ("Deployment", "docker"): "tests/test_docker.py runs the Docker blocks against a real engine",
    ("Beyond one machine", "gmmlsh route"): "it needs a Redis Cluster: tests/test_router.py runs that layout "
    "with real processes",
}
#: Blocks run with one change: (section heading, text in the block) → (old, new).
CHANGED = {
    ("Quick start", 'pip install -e ".[test]"'): (".venv/bin/pytest -q", ".venv/bin/pytest -q --collect-only"),
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Session:
    """The newcomer's shell: a fresh copy of the repository, its venv on PATH, one server, and
    the README's ports (``port_map``: README port → this run's) replaced in every command."""

    def __init__(self, root: Path, port_map: dict[int, int]):
        self.root = root
        self.ports = port_map
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("GMMLSH_", "VIRTUAL_ENV", "NUMBA_"))}
        self.env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{self.env['PATH']}"
        self.env["XDG_CACHE_HOME"] = str(root.parent / "cache")  # compiled kernels: not in the tester's home
        self.server: subprocess.Popen | None = None
        self.log = root.parent / "server.log"

    def ported(self, text: str) -> str:
        """``text`` with the README's ports (after a colon or ``--port``) replaced by this run's."""
        for readme, mine in self.ports.items():
            text = re.sub(rf"(?<=:){readme}\b|(?<=--port ){readme}\b", str(mine), text)
        return text

    def run(self, block: Block) -> None:
        if block.lang == "python":
            code = self.ported(block.text)
            self._check(block, [str(self.root / ".venv" / "bin" / "python"), "-c", code], code)
            return
        for command in map(self.ported, commands(block.text)):
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
        if "--port" not in command:  # the server's default port, 8000: this run's in its place
            command = command.replace("gmmlsh serve", f"gmmlsh serve --port {self.ports[8000]}", 1)
        port = int(re.search(r"--port\s+(\d+)", command)[1])
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
def readme_redis(tmp_path) -> int:
    """A redis-server on a free port of localhost for the README's Redis examples; its port."""
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not on the PATH (the README's test command says to install it)")
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        if not _port_free(port):
            break
        time.sleep(0.05)
    yield port
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


def test_every_command_block_runs_as_written(tmp_path, readme_redis):
    if not SHARED.is_dir():
        pytest.fail(f"{SHARED} is missing: the README's commands read ../shared/data (GMMLSH_DATA: its data folder)")
    session = Session(_fresh_copy(tmp_path), {8000: _free_port(), 6379: readme_redis})
    copied = set(os.listdir(session.root))
    ran = 0
    try:
        for block in blocks(README.read_text()):
            reason = next((why for (heading, text), why in NOT_HERE.items()
                           if block.heading == heading and text in block.text), None)
            if reason:
                print(f"{block.where()}: not run here: {reason}", file=sys.stderr)
                continue
            for (heading, text), (old, new) in CHANGED.items():
                if block.heading == heading and text in block.text:
                    assert old in block.text, f"{block.where()}: {old!r} is gone; update CHANGED"
                    block = Block(block.heading, block.lang, block.text.replace(old, new), block.line)
            session.run(block)
            ran += 1
    finally:
        session.stop()
    assert ran >= 8
    left = sorted(set(os.listdir(session.root)) - copied)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO, capture_output=True,
                             text=True, input="".join(f"{n}/\n" if (session.root / n).is_dir() else f"{n}\n"
                                                      for n in left)).stdout.split()
    assert not set(left) - {n.rstrip("/") for n in ignored}, (
        f"the README's commands leave files git does not ignore (add them to .gitignore): "
        f"{sorted(set(left) - {n.rstrip('/') for n in ignored})}")
