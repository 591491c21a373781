"""Snapshots of a search mirror: built once, published, downloaded instead of replayed.

A group's lists and tuning are built by one search node, the group's *builder* (it holds the
group's lease in Redis, :class:`Lease`), which publishes its mirror now and then as an
immutable snapshot: every file the mirror's state names, copied as they were when the state
was read, and a manifest holding that state — its feed token says where in the store's feed
the snapshot stands. A node whose mirror is empty (new, or its disk wiped) downloads the
latest snapshot of its group (:func:`restore`) and catches up from the feed from that token,
reading only what came after it: never every record of the group out of Redis.

A snapshot is consistent without stopping the mirror: rows are only appended and segments
never change, so every byte the state names is final when the state is read (a live flag may
be cleared later, by a retirement the feed lists after the token anyway; bytes past what the
state names are ignored, and overwritten by the next sync).

Where snapshots live (:func:`open_snapshots`): a directory (a volume shared by the nodes), laid
out ``ROOT/<prefix>/<uid>/g<g>of<G>/<snapshot>/`` with a ``LATEST`` file naming the newest.
Publishing copies into ``<snapshot>.partial`` and renames it, then replaces ``LATEST``: a
reader never sees half a snapshot. Object storage (S3) takes the same layout: not built yet.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gmmlsh.index import segments

log = logging.getLogger("gmmlsh.snapshots")

#: Snapshots kept per group (older ones are removed once a newer one is published).
KEEP = 2
#: What a restored mirror keeps of where it came from (which snapshot, when).
RESTORED = "restored.json"
#: Files of a mirror directory that belong to this machine's processes, not to a snapshot.
_LOCAL = (".lock", ".tmp", "upkeep.log", "upkeep-fast.json", "upkeep-slow.json", "state.json", "durable.json",
          "served.npz", "served.json", RESTORED)


@dataclass(frozen=True)
class Manifest:
    name: str
    state: dict
    files: dict[str, int]
    created: float
    group: tuple[int, int] | None

    @property
    def rows(self) -> int:
        return int(self.state["rows"])


class DirectorySnapshots:
    """Snapshots of one index's groups under a directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, prefix: str, uid: str):
        self.root = Path(root) / prefix / uid

    def _group_dir(self, group: tuple[int, int] | None) -> Path:
        g, G = group or (0, 1)
        return self.root / f"g{g}of{G}"

    def latest(self, group: tuple[int, int] | None) -> Manifest | None:
        """The newest published snapshot of a group, or None."""
        d = self._group_dir(group)
        try:
            name = (d / "LATEST").read_text().strip()
            meta = json.loads((d / name / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return Manifest(name, meta["state"], meta["files"], meta["created"],
                        tuple(meta["group"]) if meta.get("group") else None)

    def publish(self, mirror_dir: Path, state: dict, group: tuple[int, int] | None) -> Manifest:
        """Copy the files ``state`` names out of ``mirror_dir`` as a new snapshot; make it the latest."""
        d = self._group_dir(group)
        d.mkdir(parents=True, exist_ok=True)
        name = f"snap-{int(state['rows']):012d}-{int(time.time() * 1000)}-{uuid.uuid4().hex[:6]}"
        tmp = d / f"{name}.partial"
        files: dict[str, int] = {}
        fit = (state.get("lists") or {}).get("fit")
        try:
            for path in sorted(mirror_dir.rglob("*")):
                rel = path.relative_to(mirror_dir)
                if path.is_dir() or rel.name.endswith(_LOCAL) or ".tmp" in rel.name:
                    continue
                if segments.is_fit_dir(rel.parts[0]) and rel.parts[0] != fit:
                    continue
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                _copy(path, target)
                files[str(rel)] = target.stat().st_size
            (tmp / "manifest.json").write_text(json.dumps({"state": state, "files": files, "created": time.time(),
                                                           "group": list(group) if group else None}))
            os.replace(tmp, d / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        latest = d / f"LATEST.{os.getpid()}.tmp"
        latest.write_text(name)
        os.replace(latest, d / "LATEST")
        self._prune(d, name)
        out = self.latest(group)
        assert out is not None
        return out

    def _prune(self, d: Path, newest: str) -> None:
        snaps = sorted(p for p in d.glob("snap-*") if p.is_dir() and not p.name.endswith(".partial"))
        for old in snaps[:-KEEP]:
            if old.name != newest:
                shutil.rmtree(old, ignore_errors=True)

    def fetch(self, manifest: Manifest, group: tuple[int, int] | None, dest: Path) -> None:
        """Copy a snapshot's files into ``dest`` (made; it must not hold a mirror)."""
        src = self._group_dir(group) / manifest.name
        for rel in manifest.files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _copy(src / rel, target)


def _copy(src: Path, dst: Path) -> None:
    """A file copied, its holes kept holes (the mirror's columns are grown ahead, sparse)."""
    try:
        subprocess.run(["cp", "--sparse=always", str(src), str(dst)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        shutil.copyfile(src, dst)


def open_snapshots(where: str, prefix: str, uid: str) -> DirectorySnapshots:
    """The snapshots of an index at ``where`` (a directory; ``file://`` accepted)."""
    if where.startswith("s3://"):
        raise ValueError("snapshots: object storage (s3://) is not supported yet; give a directory shared by the "
                         "nodes (a volume)")
    return DirectorySnapshots(where.removeprefix("file://"), prefix, uid)


def publish(mirror, snapshots: DirectorySnapshots, group: tuple[int, int] | None) -> Manifest | None:
    """Publish the mirror's current state (None if it has no rows, or nothing new since the
    latest snapshot: the same rows, fit, segments and tuning)."""
    with mirror.locked():
        state = dict(mirror._read_state())
    if not state.get("rows"):
        return None
    last = snapshots.latest(group)
    if last is not None and _same(last.state, state):
        return None
    try:
        return snapshots.publish(mirror.dir, state, group)
    except FileNotFoundError as exc:  # a fit replaced while it was copied: the next round publishes
        log.info("snapshot skipped: %s moved while it was copied", exc.filename)
        return None


def _same(a: dict, b: dict) -> bool:
    keys = ("rows", "token", "lists", "search", "tuned_rows")
    return all(a.get(k) == b.get(k) for k in keys)


def restore(mirror_dir: Path, snapshots: DirectorySnapshots, group: tuple[int, int] | None, uid: str
            ) -> Manifest | None:
    """Fill an empty mirror directory from the group's latest snapshot (None: the mirror has
    rows already, or there is no snapshot). The state is written last, as this machine's, with
    a checkpoint of it: a crash midway leaves a directory with no state, restored again."""
    from gmmlsh.index.mirror import BOOT

    state_path = mirror_dir / "state.json"
    try:
        if json.loads(state_path.read_text()).get("rows"):
            return None
    except (OSError, ValueError):
        pass
    manifest = snapshots.latest(group)
    if manifest is None or manifest.state.get("uid") != uid:
        return None
    mirror_dir.mkdir(parents=True, exist_ok=True)
    for path in mirror_dir.iterdir():  # what an empty mirror made: replaced by the snapshot's
        if path.name.endswith(".lock"):
            continue
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    snapshots.fetch(manifest, group, mirror_dir)
    for path in mirror_dir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    state = {**manifest.state, "boot": BOOT}
    for name in ("durable.json", "state.json"):
        tmp = mirror_dir / f"{name}.restore.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, mirror_dir / name)
    (mirror_dir / RESTORED).write_text(json.dumps({"snapshot": manifest.name, "rows": manifest.rows,
                                                   "at": time.time()}))
    log.info("mirror restored from snapshot %s: %d rows, catching up from its token", manifest.name, manifest.rows)
    return manifest


_HOLD = """
local v = redis.call('GET', KEYS[1])
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""


class Lease:
    """A group's builder duty, held in Redis by one node at a time (``{P}:lease:g<g>of<G>``,
    expiring unless renewed): the holder builds and publishes; a node that dies lets it go
    within ``ttl_ms``. Two holders at once (a paused one) only publish two snapshots."""

    def __init__(self, store, group: tuple[int, int] | None, holder: str, ttl_ms: int = 15000):
        g, G = group or (0, 1)
        self.store, self.holder, self.ttl_ms = store, holder, ttl_ms
        self.key = f"{{{store.prefix}}}:lease:g{g}of{G}"

    def hold(self) -> bool:
        """Take the lease, or renew it if ours; whether we hold it now."""
        return bool(self.store.guarded(lambda r: r.eval(_HOLD, 1, self.key, self.holder, self.ttl_ms)))

    def holder_now(self) -> str | None:
        raw = self.store.guarded(lambda r: r.get(self.key))
        return raw.decode() if raw is not None else None
