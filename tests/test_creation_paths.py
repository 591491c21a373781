"""The four ways to create an index agree: whichever made it, it stores the same parameters.

1. ``gmmlsh serve`` on an empty location with ``GMMLSH_DIM`` only (a real server process);
2. the environment docker-compose.yml gives its API containers (parsed from the file, with
   the defaults a bare ``docker compose up`` uses), read into the server's settings and
   opened the way each server worker opens its index;
3. ``gmmlsh build`` of a file, no parameters given;
4. ``Index.open(path, IndexConfig(dim=...))``.

Their stored configurations differ only in the random ``uid``. The defaults they share are
:class:`IndexConfig`'s: the settings' fields, the CLI's options and their help come from it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from test_crash import free_port

from gmmlsh.index.config import CREATION_FIELDS, IndexConfig, creation_defaults, describe
from gmmlsh.index.index import Index
from gmmlsh.service.cli import main
from gmmlsh.service.opening import open_index
from gmmlsh.service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"


def compose_environment() -> dict[str, str]:
    """The API containers' environment, ``${VAR:-default}`` replaced by its default."""
    compose = yaml.safe_load(COMPOSE.read_text())
    env = compose["services"]["api"]["environment"]
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


DIM = int(compose_environment()["GMMLSH_DIM"])


def stored(location: str) -> dict:
    """The parameters an index keeps, but its random name."""
    with Index.open(location, None, create=False, maintain=False) as ix:
        return {k: v for k, v in ix.config.to_dict().items() if k != "uid"}


@pytest.fixture
def clean_env(monkeypatch):
    """No GMMLSH_* of the caller's: each path sees only what it is given."""
    for name in [n for n in os.environ if n.startswith("GMMLSH_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def by_serve(tmp: Path) -> tuple[str, dict]:
    """``gmmlsh serve --index DIR`` with GMMLSH_DIM set: (location, the config /stats showed)."""
    loc = str(tmp / "served")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GMMLSH_")}
    env.update(GMMLSH_DIM=str(DIM), GMMLSH_LOG_LEVEL="warning")
    with open(tmp / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.cli", "serve", "--index", loc, "--port",
                                 str(port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp / "serve.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=2)
                if r.status_code == 200:
                    return loc, r.json()["config"]
            time.sleep(0.2)
        raise AssertionError(f"gmmlsh serve did not start:\n{(tmp / 'serve.log').read_text()}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def by_compose(tmp: Path, env) -> str:
    """The server's settings from compose's environment, opened as each worker opens its index."""
    loc = str(tmp / "compose")
    for name, value in compose_environment().items():
        env.setenv(name, value)
    env.setenv("GMMLSH_INDEX", loc)  # the LMDB profile's volume, here
    settings = Settings()
    assert settings.dim == DIM
    open_index(settings).close()
    return loc


def by_build(tmp: Path, capsys) -> str:
    loc = str(tmp / "built")
    X = np.random.default_rng(0).random((30, DIM)) + 0.01
    np.save(tmp / "x.npy", X)
    assert main(["build", str(tmp / "x.npy"), "--index", loc, "--no-progress"]) == 0, capsys.readouterr().err
    return loc


def by_library(tmp: Path) -> str:
    loc = str(tmp / "library")
    Index.open(loc, IndexConfig(dim=DIM), maintain=False).close()
    return loc


def test_four_creation_paths_store_the_same_parameters(tmp_path, clean_env, capsys):
    served, shown = by_serve(tmp_path)
    made = {"serve": stored(served), "compose": stored(by_compose(tmp_path, clean_env)),
            "build": stored(by_build(tmp_path, capsys)), "library": stored(by_library(tmp_path))}
    assert made["serve"] == made["compose"] == made["build"] == made["library"], made
    assert {k: v for k, v in shown.items() if k != "uid"} == made["serve"]  # what /stats shows is what is stored
    assert {k: made["library"][k] for k in creation_defaults()} == creation_defaults()
    assert made["library"]["dim"] == DIM


def test_compose_passes_every_creation_parameter_and_fixes_only_the_dimension():
    env = compose_environment()
    for name in CREATION_FIELDS:
        key = f"GMMLSH_{name.upper()}"
        assert key in env, f"docker-compose.yml cannot set {name}"
        assert name == "dim" or env[key] == "", f"{key} repeats a default that belongs to IndexConfig"


def test_settings_and_cli_take_their_creation_options_from_index_config(capsys):
    for name in CREATION_FIELDS:
        field = Settings.model_fields[name]
        assert field.default is None and field.description == describe(name)
    assert Settings(dim=3).creation_config().to_dict() | {"uid": None} == \
        IndexConfig(dim=3).to_dict() | {"uid": None}
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in CREATION_FIELDS:
        if name != "dim":
            assert f"--{name.replace('_', '-')}" in help_text and describe(name) in help_text, name
