"""Redis failures in the store's vocabulary (:mod:`gmmlsh.index.store.base`): which mean "not
now" (:class:`StoreUnavailable`, the service answers 503), which a full Redis
(:class:`DiskFull`), which a command refused (:class:`StoreError`, a script's own ``GMMLSH``
message as it is), each with the URL's password masked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError, ResponseError

from gmmlsh.index.store.base import DiskFull, StoreError, StoreUnavailable
from gmmlsh.index.store.location import mask_url, scrub

#: Replies that mean "not now" (the service answers 503).
TRANSIENT = ("BUSY", "LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS")
#: Failures of the connection or of a Cluster's nodes: Redis cannot be reached now.
UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
               redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
               redis.exceptions.RedisClusterException, OSError)


def out_of_memory(where: str, then: str) -> str:
    """The message of a Redis at ``where`` (its address, masked) that refused a write for want
    of memory, ``then`` saying what was written and what to do."""
    return f"Redis is out of memory at {where} (its maxmemory is reached): {then}"


def translate(e: BaseException, url: str) -> StoreError:
    """The store's exception for a failure ``e`` of the Redis at ``url`` (its password kept out
    of the message)."""
    text = scrub(str(e), url)
    if isinstance(e, OutOfMemoryError) or text.startswith("OOM"):
        return DiskFull(out_of_memory(mask_url(url), "nothing was written; free memory or raise maxmemory, "
                                      "then retry"))
    if isinstance(e, ResponseError) and not isinstance(e, UNAVAILABLE) and not text.startswith(TRANSIENT):
        if "GMMLSH" in text:
            return StoreError(text.split("GMMLSH", 1)[1].strip())
        return StoreError(f"Redis at {mask_url(url)} refused a command: {text}")
    return StoreUnavailable(f"Redis at {mask_url(url)} unavailable: {type(e).__name__}: {text}")


def guarded(fn: Callable) -> Callable:
    """A store method whose Redis failures come out as the store's exceptions, with the
    password masked; a lost connection first makes a Cluster store learn its slots again."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except StoreError:
            raise
        except (*UNAVAILABLE, redis.exceptions.RedisError) as e:
            if isinstance(e, UNAVAILABLE):
                self._relearn_slots()
            raise translate(e, self.url) from None

    return wrapper
