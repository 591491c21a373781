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

from importlib import import_module
from typing import TYPE_CHECKING, Any

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
