"""Where an index lives: an LMDB directory, or a Redis URL and a key prefix.

The one place that says which locations are Redis, the prefix a Redis index takes unless told,
how long a write to Redis waits for its replicas unless told, and how a Redis URL's password is
kept out of logs, messages and answers; and which store opens a location (:func:`open_store`, which
loads its backend only then). It imports nothing else but the standard library, so the command line
and the settings use it without loading Redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from gmmlsh.index.store.base import Store

#: URL schemes that name a Redis server (anything else is an LMDB directory).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: The key prefix naming an index inside Redis when none is given.
DEFAULT_PREFIX = "gmmlsh"
#: Seconds a write waits for the replicas it must reach (Redis' ``WAIT``) unless told.
WAIT_TIMEOUT = 1.0


def is_redis(location: object) -> bool:
    """Whether a location names a Redis server rather than an LMDB directory."""
    return str(location).startswith(REDIS_SCHEMES)


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (safe for logs, errors and /stats)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:
        return "<unparseable redis url>"


def scrub(text: str, url: str | None) -> str:
    """``text`` with the password of the Redis ``url`` (as given, and URL-decoded) replaced by
    ``***``; an unparseable URL is replaced whole. No URL: ``text`` as it is."""
    if not url:
        return text
    try:
        pw = urlsplit(url).password
    except ValueError:
        return text.replace(url, "<redis url>")
    for secret in sorted({pw, unquote(pw)} if pw else (), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def describe(location: str, prefix: str = DEFAULT_PREFIX) -> str:
    """A location fit for logs and messages: ``DIR (LMDB)`` or ``URL prefix 'P' (Redis)``, the
    password masked."""
    if not is_redis(location):
        return f"{location} (LMDB)"
    return f"{mask_url(location)} prefix {prefix!r} (Redis)"


def open_store(location, *, prefix: str = DEFAULT_PREFIX, **options) -> Store:
    """A directory → LMDB; a ``redis://`` / ``rediss://`` / ``unix://`` URL → Redis."""
    if is_redis(location):
        from gmmlsh.index.store.redis import RedisStore

        return RedisStore(str(location), prefix=prefix, **options)
    from gmmlsh.index.store.lmdb import LmdbStore

    return LmdbStore(location, **options)
