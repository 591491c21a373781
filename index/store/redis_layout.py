"""Where an index lives in Redis, and how a write batch becomes Lua scripts: the rules both
:class:`~gmmlsh.index.store.redis.RedisStore` and the scripts in ``lua/`` follow
(``lua/shard.lua`` holds the same location rule; a test checks one against the other).

Key layout (``P`` = prefix), the same on a single server and on a Redis Cluster
--------------------------------------------------------------------------------
* ``{P}:config`` — the index configuration (JSON), with the store's shard count.
* Per id shard ``s = crc32(external id) mod S`` (default ``S = 16``), every key tagged
  ``{P:s}`` so that one Lua script can work on a shard atomically, in one Cluster slot:

  - ``{P:s}:ids`` hash: external id → iid (decimal);
  - ``{P:s}:seq`` iids handed out in the shard; an iid is ``seq·S + s``, so iids stay
    dense and are never reused: a record under an iid never changes;
  - ``{P:s}:live`` the shard's live vectors; ``{P:s}:dead`` the list of its retired
    iids (the feed) and ``{P:s}:ndead`` that list's length;
  - ``{P:s}:<f>:<c>`` hashes holding field ``f`` (``n`` name, ``v`` vector, ``k``
    sketch, ``f`` NRFF features, ``m`` metadata) of the shard's records ``seq`` with
    ``seq // C = c``, under the hash field ``seq mod C`` (``C`` = 1,024 for big
    fields, 128 for small ones, which stay in Redis' compact listpack encoding). A
    hash field costs far less memory than a key.

Writes
------
``write`` runs ``lua/write.lua`` once for the whole batch on a single server (so a batch is
all or nothing, a full Redis included), once per id shard the batch touches on a Cluster (one
pipelined round trip): for each record it retires the id's old iid (its fields are
deleted, it joins the feed), allocates the next iid, writes the fields and points the
id at it. ``delete`` runs ``lua/delete.lua`` likewise. A script runs atomically and is
replicated (and written to the AOF) as a ``MULTI/EXEC`` block, so a vector is all
there or absent, and every iid the feed reports as added holds its record unless it
has been retired since. Nothing is journaled: there is nothing half-done to clean up.

A batch goes in scripts of at most :data:`SCRIPT_BYTES` of records (:func:`scripts_of`): on a
single server one script holds records of every shard, so a batch up to that size is all or
nothing; on a Cluster a script's keys must share a slot, so each holds one shard's.
"""

from __future__ import annotations

import zlib
from importlib import resources

#: A record's fields and the one-letter family each is stored under.
FAMILY = {"name": "n", "vector": "v", "sketch": "k", "nrff": "f", "meta": "m"}
#: Records per hash: for big fields, and for small ones (which stay in Redis' listpack encoding).
CHUNK_BIG, CHUNK_SMALL = 1024, 128
SMALL = {"n", "m"}
#: Bytes of records per script: bounds how long one blocks Redis (~20 ms a MiB of 784-value rows
#: here); a batch up to this size is one script, so all or nothing.
SCRIPT_BYTES = 4 << 20
#: What a record costs a script beyond its bytes (its commands), counted as bytes.
RECORD_COST = 256


def tag(prefix: str, s: int) -> str:
    """The key prefix of id shard ``s`` (one hash tag: one Cluster slot)."""
    return f"{{{prefix}:{s}}}:"


def shard_keys(prefix: str, s: int) -> list[str]:
    """The keys a script of shard ``s`` works on, in the order the scripts take them."""
    t = tag(prefix, s)
    return [t + "ids", t + "seq", t + "live", t + "dead", t + "ndead"]


def chunk(fam: str) -> int:
    """Records per hash of field family ``fam``."""
    return CHUNK_SMALL if fam in SMALL else CHUNK_BIG


def loc(prefix: str, iid: int, fam: str, S: int) -> tuple[str, str]:
    """Where field ``fam`` of record ``iid`` lives: its hash key and the field in it (the rule
    ``loc`` of ``lua/shard.lua``)."""
    s, seq = iid % S, iid // S
    c = chunk(fam)
    return f"{tag(prefix, s)}{fam}:{seq // c}", str(seq % c)


def shard_of(ext_id: str, S: int) -> int:
    """The id shard of an external id."""
    return zlib.crc32(ext_id.encode("utf-8")) % S


def script(name: str) -> str:
    """The Lua script ``lua/<name>.lua`` after ``lua/shard.lua`` (the arguments every script starts
    with, the key-location rule of :func:`loc`, a record's retirement)."""
    lua = resources.files("gmmlsh.index.store").joinpath("lua")
    return lua.joinpath("shard.lua").read_text() + lua.joinpath(f"{name}.lua").read_text()


def scripts_of(by_shard: dict[int, list[int]], size: dict[int, int], one_slot: bool
               ) -> list[list[tuple[int, list[int]]]]:
    """A batch's rows (``by_shard``: shard → rows, ``size``: row → bytes) cut into scripts of at
    most :data:`SCRIPT_BYTES` each, as each script's sections ``(shard, rows)``; ``one_slot``
    (a Cluster): a script holds one shard's rows."""
    calls: list[list[tuple[int, list[int]]]] = [[]]
    used = 0
    for s, members in by_shard.items():
        for i in members:
            cost = RECORD_COST + size[i]
            if calls[-1] and (used + cost > SCRIPT_BYTES or (one_slot and calls[-1][-1][0] != s)):
                calls.append([])
                used = 0
            if not calls[-1] or calls[-1][-1][0] != s:
                calls[-1].append((s, []))
            calls[-1][-1][1].append(i)
            used += cost
    return calls
