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

import os
import sys
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

#: This machine's cache for gmmlsh (``$XDG_CACHE_HOME/gmmlsh``, else ``~/.cache/gmmlsh``): the
#: compiled kernels (``numba/``) and the search mirrors of Redis indexes.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gmmlsh"


def _cache_kernels_outside_the_package() -> None:
    """Point numba's on-disk kernel cache at ``CACHE_DIR/numba`` unless ``NUMBA_CACHE_DIR`` says
    where. numba's default is a ``__pycache__`` beside each module, i.e. inside the installed
    package: pip's uninstall leaves those folders behind (a later editable install is then
    shadowed by them: ``No module named 'gmmlsh.index.index'``), and a read-only site-packages
    cannot take them. Runs before gmmlsh imports numba (numba reads the variable when it is
    imported; if something imported it first, its config is set too); processes started from
    this one (server workers) inherit the variable."""
    path = os.environ.get("NUMBA_CACHE_DIR") or str(CACHE_DIR / "numba")
    os.environ["NUMBA_CACHE_DIR"] = path
    numba = sys.modules.get("numba")
    config = getattr(numba, "config", None)
    if config is not None and not getattr(config, "CACHE_DIR", ""):
        config.CACHE_DIR = path


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
