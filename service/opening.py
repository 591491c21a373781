"""Opening the served index: the existing one, or a new one from the creation settings.

Kept apart from the app so that ``gmmlsh serve`` can open the index once before its
workers start without importing the web framework (that import is a third of a worker's
start-up time, and the supervising process never serves a request).
"""

from __future__ import annotations

from gmmlsh.index.collections import DEFAULT_COLLECTION, Collections
from gmmlsh.index.index import Index
from gmmlsh.service.settings import Settings


class IndexNotFound(RuntimeError):
    """No index at the location and no ``dim`` to create one."""


class IndexOpenError(RuntimeError):
    """Opening the index failed (message scrubbed of credentials)."""


#: Options of :func:`index_options` that are the index's, not its store's.
INDEX_ONLY = ("search", "monitor_budget", "monitor_share")


def index_options(settings: Settings) -> dict:
    """Options for ``Index.open`` beyond the location: search overrides, the mirror's place,
    and the backend's own (LMDB reader slots for every worker thread)."""
    opts: dict = {**settings.store_options, "search": settings.search_overrides,
                  "monitor_budget": settings.monitor_budget, "monitor_share": settings.monitor_share}
    if settings.backend == "lmdb":
        opts["max_readers"] = settings.max_readers
    if settings.group_pair is not None:
        opts["group"] = settings.group_pair
    return opts


def open_index(settings: Settings) -> Index:
    """Open the existing index; create it from the creation settings only if there is none.

    An existing index keeps its stored parameters even when ``dim`` etc. are set
    (so restarting a compose stack with GMMLSH_DIM in its environment is harmless).
    """
    index = _open_default(settings)
    if settings.collection != DEFAULT_COLLECTION:  # the unprefixed routes' collection must exist
        try:
            with Collections(settings.location, **{k: v for k, v in index_options(settings).items()
                                                   if k not in INDEX_ONLY}) as cols:
                cols.get(settings.collection)
        except BaseException:
            index.close()
            raise
    return index


def _open_default(settings: Settings) -> Index:
    opts = index_options(settings)
    try:
        index = Index.open(settings.location, None, create=False, **opts)
        if settings.snapshots and settings.redis_url and _restored(index, settings):
            index.close()  # open again on the restored mirror
            index = Index.open(settings.location, None, create=False, **opts)
        return index
    except Exception as exc:  # noqa: BLE001 - narrowed below
        if not _is_missing(exc):
            raise
    if settings.dim is None:
        raise IndexNotFound(
            f"no gmmlsh index at {settings.safe_location}: build one with `gmmlsh build`, or set GMMLSH_DIM "
            "(and optionally GMMLSH_SAMPLES, GMMLSH_BITS, ...) to create an empty one"
        )
    return Index.open(settings.location, settings.creation_config(), create=True, **opts)


def _restored(index: Index, settings: Settings) -> bool:
    """Fill an empty search mirror from its group's latest snapshot (see
    :mod:`gmmlsh.index.snapshots`): whether it was."""
    from gmmlsh.index.snapshots import open_snapshots, restore

    if index.mirror.view.rows:
        return False
    snaps = open_snapshots(settings.snapshots, settings.prefix, index.config.uid)
    with index.mirror.locked():
        return restore(index.mirror.dir, snaps, settings.group_pair, index.config.uid) is not None


def _is_missing(exc: Exception) -> bool:
    """Whether ``Index.open(create=False)`` failed because there is no index yet."""
    from gmmlsh.index.store.base import ConfigConflict, StoreUnavailable

    if isinstance(exc, (ConfigConflict, StoreUnavailable)):
        return False
    return isinstance(exc, (FileNotFoundError, LookupError, ValueError))
