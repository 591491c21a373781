"""The code base stays ruff-clean: a lint failure fails the suite like any other test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "core", "index", "service", "tests", "bench"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_layering():
    """core imports nothing from gmmlsh.index or service; index nothing from gmmlsh.service."""
    for pkg, banned in (("core", ("index", "service")), ("index", ("service",))):
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            for b in banned:
                assert f"from gmmlsh.{b}" not in text and f"import gmmlsh.{b}" not in text, f"{f.name} imports {b}"
