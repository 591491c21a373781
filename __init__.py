"""gmmlsh: near-neighbour search for the generalized min-max (GMM) similarity.

The public API: :class:`Index` (open or create an index in LMDB or Redis, upsert,
query, delete), :class:`IndexConfig` (its parameters), and the math underneath —
:func:`sketch` (GCWS samples), :func:`gmm` / :func:`gmm_many` (exact GMM) and
:func:`nrff_features` (normalized random Fourier features). :class:`Client` talks to a
running server (``gmmlsh serve``) over HTTP and raises :class:`ApiError` for its refusals.

The names are imported on first use (PEP 562), so ``import gmmlsh`` — and the HTTP client,
``gmmlsh.client`` — load without numba and the index; ``gmmlsh.Index`` etc. work as before.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

#: This machine's cache for gmmlsh (``$XDG_CACHE_HOME/gmmlsh``, else ``~/.cache/gmmlsh``): the
#: compiled kernels (``numba/``) and the search mirrors of Redis indexes.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gmmlsh"


#: The package's folders that hold numba kernels: their sources name the kernel cache.
_KERNEL_SOURCES = ("core", "index", "bench")
#: Kernel caches of other sources older than this are removed when a new one is made (seconds).
_OLD_KERNELS_SECONDS = 86400.0


def _kernel_fingerprint() -> str:
    """A digest of the kernels' source files (path, size, modification time), as numba's own
    check of a single file: numba recompiles a cached kernel when its own file changes, but not
    when a kernel it calls from another module does, and would run the old callee's code."""
    root = Path(__file__).parent
    digest = hashlib.blake2b(digest_size=8)
    for folder in _KERNEL_SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            st = path.stat()
            digest.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()


def _cache_kernels_outside_the_package() -> None:
    """Point numba's on-disk kernel cache at ``CACHE_DIR/numba/<sources>`` unless
    ``NUMBA_CACHE_DIR`` says where. numba's default is a ``__pycache__`` beside each module,
    i.e. inside the installed package: pip's uninstall leaves those folders behind (a later
    editable install is then shadowed by them: ``No module named 'gmmlsh.index.index'``), and a
    read-only site-packages cannot take them. ``<sources>`` is :func:`_kernel_fingerprint`, so an
    edited or upgraded package compiles afresh (caches of other sources a day old are removed
    then). Runs before gmmlsh imports numba (numba reads the variable when it is imported; if
    something imported it first, its config is set too); processes started from this one
    (server workers) inherit the variable."""
    path = os.environ.get("NUMBA_CACHE_DIR")
    if not path:
        kernels = CACHE_DIR / "numba"
        path = str(kernels / _kernel_fingerprint())
        if not os.path.isdir(path):
            _remove_old_kernels(kernels)
    os.environ["NUMBA_CACHE_DIR"] = path
    numba = sys.modules.get("numba")
    config = getattr(numba, "config", None)
    if config is not None and not getattr(config, "CACHE_DIR", ""):
        config.CACHE_DIR = path


def _remove_old_kernels(kernels: Path) -> None:
    """Remove the kernel caches in ``kernels`` untouched for :data:`_OLD_KERNELS_SECONDS` (a
    process of other sources running still may use a younger one)."""
    try:
        olds = [p for p in kernels.iterdir() if time.time() - p.stat().st_mtime > _OLD_KERNELS_SECONDS]
    except OSError:  # no cache yet
        return
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)


_cache_kernels_outside_the_package()

if TYPE_CHECKING:
    from gmmlsh.client import ApiError, Client
    from gmmlsh.core.codes import bbit_codes
    from gmmlsh.core.gcws import sketch
    from gmmlsh.core.gmm import gmm, gmm_many
    from gmmlsh.core.nrff import features as nrff_features
    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.index import Index, UnknownIdError
    from gmmlsh.results import Neighbor, QueryResult, StoredVector

# name → (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "Index": ("gmmlsh.index.index", "Index"),
    "IndexConfig": ("gmmlsh.index.config", "IndexConfig"),
    "Neighbor": ("gmmlsh.results", "Neighbor"),
    "QueryResult": ("gmmlsh.results", "QueryResult"),
    "StoredVector": ("gmmlsh.results", "StoredVector"),
    "UnknownIdError": ("gmmlsh.index.index", "UnknownIdError"),
    "sketch": ("gmmlsh.core.gcws", "sketch"),
    "bbit_codes": ("gmmlsh.core.codes", "bbit_codes"),
    "gmm": ("gmmlsh.core.gmm", "gmm"),
    "gmm_many": ("gmmlsh.core.gmm", "gmm_many"),
    "nrff_features": ("gmmlsh.core.nrff", "features"),
    "Client": ("gmmlsh.client", "Client"),
    "ApiError": ("gmmlsh.client", "ApiError"),
}

__all__ = [
    "__version__", "Index", "IndexConfig", "Neighbor", "QueryResult", "StoredVector", "UnknownIdError",
    "sketch", "bbit_codes", "gmm", "gmm_many", "nrff_features",
    "Client", "ApiError",
]


def _version() -> str:
    """The installed distribution's version (the one in pyproject.toml), or "unknown" when the
    package runs from a tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gmmlsh")
    except PackageNotFoundError:
        return "unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
