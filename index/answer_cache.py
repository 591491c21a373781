"""Names and metadata of the iids a process has answered with, valid while the store's epoch stands.

A record under an iid never changes, and the store's epoch (see
``Store.news_and_epoch``) grows whenever a live iid is retired. So a name read at
epoch E is still live for as long as the epoch is still E, and a query whose
neighbours are all cached needs one counter read instead of reading their
records: on Redis a two-key ``MGET`` instead of a script over chunk hashes, on
LMDB one ``get`` instead of two ``getmulti``.

The state is one ``(epoch, dict)`` pair swapped whole, so threads need no lock:
a reader takes the pair once, and an entry is only ever added to the dict of the
epoch it was read at.
"""

from __future__ import annotations

#: Entries kept before the cache starts afresh (about 150 bytes each).
DEFAULT_MAX_ENTRIES = 1 << 20


class AnswerCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.max_entries = max_entries
        self._state: tuple[int | None, dict[int, tuple[str, bytes | None]]] = (None, {})

    def snapshot(self) -> tuple[int | None, dict[int, tuple[str, bytes | None]]]:
        """(epoch, iid → (name, metadata blob)): every entry was live at that epoch."""
        return self._state

    def add(self, epoch: int | None, iids: list[int], names: list[str | None],
            metas: list[bytes | None]) -> None:
        """Remember the live ones among records read at ``epoch`` (None: the store has no epoch)."""
        if epoch is None:
            return
        current, entries = self._state
        if current is not None and epoch < current:
            return  # read before a retirement this cache already knows of
        if current is None or epoch > current or len(entries) >= self.max_entries:
            entries = {}
            self._state = (epoch, entries)
        for iid, name, meta in zip(iids, names, metas, strict=True):
            if name is not None:
                entries[iid] = (name, meta)

    def forget(self, iid: int) -> None:
        self._state[1].pop(iid, None)
