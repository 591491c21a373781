"""A mirror whose store went back on some id-shards: resync those, keep the rest.

A Redis master that fails over to a replica which had not received its last writes
(replication is asynchronous) comes back with some id-shards' counters *behind* what the
mirror already copied: acknowledged writes were lost, and the shard's next iids will be handed
out again for other records. Until now the whole mirror was thrown away (at 25M rows a
disaster); :func:`went_back` instead retires every mirror row of the shards that went back and
copies their records in again as they are now (new rows; the lists absorb them as any new
rows), leaving every other shard's rows and everything built on them as they are. A store
that cannot name its shards (LMDB) or whose token changed shape gets None: rebuild.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("gmmlsh.mirror")


def went_back(mirror, store, state: dict, now: tuple, lost: list[int] | None = None) -> dict | None:
    """Resync the id-shards whose counters in ``now`` are behind the mirror's token, and those
    at the positions ``lost`` (:func:`lost_tails`), under the mirror's ``sync`` lock; returns the
    state to go on from (its token: ``now`` for those shards, the mirror's for the others; its
    ``retiring``: their old rows), or None if only a rebuild will do."""
    mine = getattr(store, "mine", None)
    old = state.get("token")
    if mine is None or old is None or len(old) != len(now):
        return None
    shards = mine()
    if len(shards) * 2 != len(now):
        return None
    S = store.shards
    back = sorted({i for i in range(len(shards)) if now[2 * i] < old[2 * i] or now[2 * i + 1] < old[2 * i + 1]}
                  | set(lost or ()))
    if not back:
        return None
    names = [shards[i] for i in back]
    rows = state["rows"]
    iids = np.asarray(mirror._iid.rows(rows), dtype=np.int64)
    hit = np.flatnonzero(np.isin(iids % S, names) & (mirror._alive.rows(rows) == 1))
    retired = int(hit.shape[0])
    top = {shards[i]: now[2 * i] for i in back}
    found = [ids for _, ids in store.scan_ids(shards=names)]
    present = np.concatenate(found) if found else np.zeros(0, np.int64)
    present = present[present // S < np.array([top[int(s)] for s in present % S], dtype=np.int64)] \
        if present.shape[0] else present  # newer ones come through the feed from the new token
    added = mirror._append(store.read, np.sort(present), rows) - rows
    token = list(old)
    for i in back:
        token[2 * i], token[2 * i + 1] = now[2 * i], now[2 * i + 1]
    log.warning("the store went back on id-shard(s) %s (writes lost in a failover?): %d rows retired, %d copied "
                "again; the other %d shard(s) kept", names, retired, added, len(shards) - len(back))
    state.update(rows=rows + added, token=token, live=state["live"] - retired + added, retiring=hit.tolist())
    return state  # its rows retired once it is published (Mirror._settle), as a sync's are


def lost_tails(mirror, store, state: dict, now: tuple, retired: np.ndarray) -> list[int]:
    """Positions (in the token) of the id-shards whose counters moved on from the mirror's token
    but whose last record the mirror holds is gone without being retired, or is another record
    now: writes lost in a failover, and the shard's sequence has grown past where it went back
    to before the mirror looked (its counters alone do not show it). Lost writes are always the
    newest of a shard, so its last record tells. Search nodes only (a grouped store): one read
    of the shards that moved."""
    old = state.get("token")
    if getattr(store, "group", None) is None or old is None or len(old) != len(now):
        return []
    shards, S = store.mine(), store.shards
    moved = [i for i in range(len(shards)) if old[2 * i] > 0 and (now[2 * i], now[2 * i + 1]) !=
             (old[2 * i], old[2 * i + 1])]
    if not moved:
        return []
    last = np.array([(old[2 * i] - 1) * S + shards[i] for i in moved], dtype=np.int64)
    rowof = mirror._rowof.whole()
    rows = [int(rowof[x]) - 1 if x < rowof.shape[0] else -1 for x in last.tolist()]
    names = store.read(last, ["name"])["name"]
    gone = set(retired.tolist())
    alive = mirror._alive.rows(state["rows"])
    out = []
    for j, i in enumerate(moved):
        r = rows[j]
        if not 0 <= r < state["rows"]:
            continue  # never mirrored (retired before the mirror looked)
        if names[j] is None:
            if alive[r] and int(last[j]) not in gone:
                out.append(i)
        elif names[j] != mirror._names.get(state["rows"], r):
            out.append(i)
    return out
