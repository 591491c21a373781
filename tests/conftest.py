"""Shared fixtures: the Fashion-MNIST data and numba thread settings.

Backend fixtures live beside the tests that need them (``redis_fixtures.py``).
"""

from __future__ import annotations

import os
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
