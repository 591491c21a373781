"""Append-only, memory-mapped array files: the storage of a search mirror.

A column is one file of fixed-width rows; it grows by a quarter at a time, with the
new space *allocated* (``posix_fallocate``) before it is mapped: a write through a
mapping into a hole the filesystem cannot fill kills the process with SIGBUS, so a
full disk must show up here, as :class:`DiskFull`, instead. Every process maps the
whole file shared, so its pages live once per machine in the page cache however
many workers read them. Rows are only ever appended past what readers use, so a
reader needs no lock: it reads the rows a published count covers. Appended rows are
written to the file (``pwritev``), not stored through the mapping: a store into a
mapped page the file has not written yet first faults it in, zero-filled, then copies
over it; a write copies once.

**Huge pages.** Queries read a few hundred random rows of files of gigabytes; with 4 KiB
pages nearly every row costs a TLB miss. Linux maps a file's pages 2 MiB at a time
(``FilePmdMapped``) where the page cache holds them as 2 MiB folios and the mapping asks
for it (``MADV_HUGEPAGE``): ext4 and xfs on recent kernels make such folios when a write
covers an aligned 2 MiB range whole, or when a mapping with the advice reads the file from
disk. So appends are written in pieces cut at 2 MiB boundaries, and a file written once
(a segment's arenas, a bulk load's columns) is dropped from the page cache and read back
through such a mapping (:func:`refold`), which speeds up queries (docs/tuning.md, "Memory
mappings"). Where the kernel cannot, nothing changes.

**Writing back.** Upkeep writes gigabytes through mappings (a new fit of 1.4M sparse rows:
3 GB of arenas), and the kernel keeps them dirty until a checkpoint's ``fsync`` (or its own
flusher) sends them all to the device at once; every small synchronous write of another
process — an LMDB commit — then waits behind that queue (commits of 300 random values took
156–292 ms at the median behind one fsync of 2 GiB, against 15 ms before it:
``bench/bench_write_back.py``). :func:`write_back` sends dirty pages a few MiB at a time,
each piece on the disk before the next is sent (``sync_file_range``, as RocksDB's
``bytes_per_sync`` does), so what waits ahead of another process's write is one piece at
most (the same commits: 21–26 ms).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np
from numba import njit

from gmmlsh.index.store.base import DiskFull

#: Rows a new column file is created with.
_MIN_ROWS = 1024


#: ``MADV_POPULATE_READ`` (Linux ≥ 5.14; Python's mmap module does not name it).
_POPULATE_READ = 22
#: Buffers one ``pwritev`` call takes at most (``IOV_MAX`` on Linux).
_IOV_MAX = 1024
#: The huge page size writes are cut at (x86-64 and arm64 with 4 KiB base pages).
HUGE_PAGE = 2 << 20
#: Bytes :func:`write_back` sends to the device at a time.
WRITE_BACK_PIECE = 8 << 20


def _sync_file_range():
    """Linux's ``sync_file_range`` (Python's os module does not offer it), or None elsewhere."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()
#: SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER: a piece
#: is written and on the device before the call returns.
_WRITE_AND_WAIT = 1 | 2 | 4


def write_back(fd: int, lo: int = 0, hi: int | None = None) -> None:
    """Send the dirty pages of bytes ``[lo, hi)`` of an open file (to its end by default) to the
    device, :data:`WRITE_BACK_PIECE` bytes at a time, each written before the next is sent (see
    the module docstring). Not a flush of the disk's cache nor of the file's metadata: ``fsync``
    after it for that (it then finds little left to write). Does nothing where the call is missing."""
    if _SYNC_FILE_RANGE is None:
        return
    hi = os.fstat(fd).st_size if hi is None else hi
    for at in range(lo - lo % WRITE_BACK_PIECE, hi, WRITE_BACK_PIECE):
        if _SYNC_FILE_RANGE(fd, at, WRITE_BACK_PIECE, _WRITE_AND_WAIT) != 0:
            return  # the fsync that follows, or the kernel's own flusher, writes the rest


def make_durable(path: Path) -> None:
    """Put a file's data on disk: written back a piece at a time (:func:`write_back`), then
    ``fsync``. A file that is gone is skipped (a retired fit removed meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        write_back(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _nbytes(buffer) -> int:
    return buffer.nbytes if isinstance(buffer, np.ndarray) else len(buffer)


def _pieces(offset: int, buffers: list) -> list[list]:
    """``buffers`` regrouped into the writes of :func:`_pwrite`: cut wherever the file offset
    crosses a multiple of :data:`HUGE_PAGE` (and at most :data:`_IOV_MAX` buffers a write), so
    that an aligned 2 MiB range covered by the data is written whole by one call."""
    groups: list[list] = [[]]
    room = HUGE_PAGE - offset % HUGE_PAGE
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while view.nbytes:
            if room == 0 or len(groups[-1]) == _IOV_MAX:
                groups.append([])
                room = room or HUGE_PAGE
            take = min(room, view.nbytes)
            groups[-1].append(view[:take])
            view, room = view[take:], room - take
    return [g for g in groups if g]


def _pwrite(path: Path, offset: int, buffers: list) -> None:
    """Write ``buffers`` (bytes, or C-contiguous arrays) one after another at byte ``offset`` of
    a file, in :func:`_pieces`."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for group in _pieces(offset, buffers):
            size = sum(map(_nbytes, group))
            done = os.pwritev(fd, group, offset)
            if done < size:  # a short write (a signal, a full disk): the rest in one piece
                rest = b"".join(group)[done:]
                while rest:
                    n = os.pwrite(fd, rest, offset + done)
                    if n == 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                    done, rest = done + n, rest[n:]
            offset += size
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"no space left for the search mirror at {path.parent}") from None
        raise
    finally:
        os.close(fd)


def _raw_map(array) -> mmap.mmap | None:
    """The mmap under a memory-mapped array (through its chain of bases), or None."""
    while array is not None and not isinstance(array, mmap.mmap):
        array = getattr(array, "_mmap", None) or getattr(array, "base", None)
    return array


def _advise(array, advice: int | None) -> bool:
    raw = _raw_map(array)
    if advice is None or raw is None:
        return False
    try:
        raw.madvise(advice)
    except (OSError, ValueError):
        return False
    return True


def huge_pages(mm: np.memmap) -> np.ndarray:
    """Ask for huge pages on a shared file mapping (``MADV_HUGEPAGE``); returns it as an array.

    Queries read a few hundred random rows of columns of gigabytes: with 4 KiB pages
    nearly every row is a TLB miss. Where the kernel keeps a file's page cache in
    2 MiB folios (ext4 and xfs on recent Linux), the advice lets it map them whole, and the
    rank and rerank passes run faster (docs/tuning.md).
    Elsewhere the advice is ignored.
    """
    _advise(mm, getattr(mmap, "MADV_HUGEPAGE", None))
    return mm.view(np.ndarray)


def refold(path: Path) -> None:
    """Drop a finished file (one no process maps) from the page cache and read it back through
    a mapping that asks for huge pages, so that it is cached as 2 MiB folios and every later
    mapping of it takes 2 MiB pages (see the module docstring)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        if size < HUGE_PAGE:
            return
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            for advice in (getattr(mmap, "MADV_HUGEPAGE", None), _POPULATE_READ):
                if advice is not None:
                    with contextlib.suppress(OSError):
                        mm.madvise(advice)
    finally:
        os.close(fd)


def refold_tree(directory: Path) -> None:
    """:func:`refold` every file of at least :data:`HUGE_PAGE` under ``directory`` (a mirror a
    bulk load has just written: its appends seldom cover a 2 MiB range whole). Pages another
    process maps stay as they are."""
    for path in Path(directory).rglob("*"):
        if path.is_file() and path.stat().st_size >= HUGE_PAGE:
            refold(path)


def populate(array) -> bool:
    """Map every page of a memory-mapped array into this process now (reading the file into
    the page cache where it is not there), so that queries take no page faults."""
    return _advise(array, _POPULATE_READ)


class Column:
    """Rows of ``width`` values of ``dtype`` in one file (``width`` 0: scalars)."""

    def __init__(self, path: Path, dtype, width: int = 0):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.width = width
        self._row_bytes = self.dtype.itemsize * max(1, width)
        self._map: np.ndarray | None = None
        self._cap = 0

    def _remap(self) -> None:
        if not self.path.exists() or self.path.stat().st_size < _MIN_ROWS * self._row_bytes:
            self._grow_file(_MIN_ROWS)  # new, or created by a process killed before it sized it
        cap = self.path.stat().st_size // self._row_bytes
        shape = (cap, self.width) if self.width else (cap,)
        self._map = huge_pages(np.memmap(self.path, dtype=self.dtype, mode="r+", shape=shape))
        self._cap = cap

    def _grow_file(self, rows: int) -> None:
        with open(self.path, "ab") as f:
            size = f.tell()
            if size < rows * self._row_bytes:
                try:
                    os.posix_fallocate(f.fileno(), size, rows * self._row_bytes - size)
                except OSError as exc:
                    os.ftruncate(f.fileno(), size)  # give back what was allocated
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise DiskFull(f"no space left for the search mirror at {self.path.parent}") from None
                    raise

    def rows(self, n: int) -> np.ndarray:
        """The first ``n`` rows (a view of the mapping)."""
        if self._map is None or n > self._cap:
            self._remap()
            if n > self._cap:
                raise ValueError(f"{self.path.name}: {n} rows asked, the file holds {self._cap}")
        return self._map[:n]

    def whole(self) -> np.ndarray:
        """Every row the file holds (remapped if it grew)."""
        if self._map is None or self.path.stat().st_size // self._row_bytes != self._cap:
            self._remap()
        return self._map

    def reserve(self, n: int) -> np.ndarray:
        """Make room for ``n`` rows (the writer's side) and return the mapping's first ``n`` rows."""
        if self._map is None:
            self._remap()
        if n > self._cap:
            self._grow_file(max(n, self._cap + self._cap // 4, _MIN_ROWS))
            self._remap()
        return self._map[:n]

    def write(self, start: int, values: np.ndarray) -> None:
        """Put ``values`` at rows ``start, start + 1, …`` (the writer's side; room is made as by
        :meth:`reserve`)."""
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.reserve(start + values.shape[0])
        _pwrite(self.path, start * self._row_bytes, [values])

    def write_back(self, lo: int, hi: int) -> None:
        """:func:`write_back` of rows ``[lo, hi)``."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            write_back(fd, lo * self._row_bytes, hi * self._row_bytes)
        finally:
            os.close(fd)

    def paths(self) -> list[Path]:
        return [self.path]

    def nbytes(self) -> int:
        """Bytes of disk the file takes (its allocated blocks, not its apparent size)."""
        try:
            return os.stat(self.path).st_blocks * 512
        except OSError:
            return 0


class Blobs:
    """Variable-length rows: an offsets column (``n + 1`` int64) and a data column of ``dtype``."""

    def __init__(self, directory: Path, name: str, dtype=np.uint8):
        self.offsets = Column(directory / f"{name}.off", np.int64)
        self.data = Column(directory / f"{name}.dat", dtype)

    def append(self, start: int, parts: list) -> None:
        """Write rows ``start, start + 1, …`` from ``parts`` (bytes, or arrays of ``dtype``), joined
        first into one buffer (one copy in C: the batch's Python work stays per batch, not per row)."""
        if not parts:
            return
        if isinstance(parts[0], bytes | bytearray | memoryview):
            flat = np.frombuffer(b"".join(parts), dtype=self.data.dtype)
            lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)) // self.data.dtype.itemsize
        else:
            flat = np.concatenate(parts).astype(self.data.dtype, copy=False)
            lengths = np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts))
        self.append_flat(start, flat, lengths)

    def append_flat(self, start: int, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Write rows ``start, start + 1, …``, one after another in ``flat`` (values of ``dtype``),
        of ``lengths`` values each."""
        if not lengths.shape[0]:
            return
        base = 0 if start == 0 else int(self.offsets.reserve(start + 1)[start])
        ends = base + np.cumsum(lengths)
        self.data.reserve(int(ends[-1]))
        _pwrite(self.data.path, base * self.data.dtype.itemsize, [np.ascontiguousarray(flat)])
        self.offsets.write(start, np.concatenate([[base], ends]))

    def views(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets of rows ``< n`` plus the end, data they cover)."""
        offs = self.offsets.rows(n + 1)
        return offs, self.data.rows(int(offs[n]))

    def paths(self) -> list[Path]:
        return [self.offsets.path, self.data.path]

    def get(self, n: int, row: int) -> bytes:
        offs, data = self.views(n)
        return data[offs[row]:offs[row + 1]].tobytes()


@njit(nogil=True, cache=True)
def _gather(offs, data, rows):
    """Rows ``rows`` of an ``(offsets, data)`` column, one after another in one buffer, and where
    each ends. Copied a byte at a time: rows here are names and metadata, tens of bytes, and a
    slice assignment took four times as long to compile."""
    n = rows.shape[0]
    ends = np.empty(n, dtype=np.int64)
    total = 0
    for i in range(n):
        total += offs[rows[i] + 1] - offs[rows[i]]
        ends[i] = total
    out = np.empty(total, dtype=np.uint8)
    at = 0
    for i in range(n):
        for b in range(offs[rows[i]], offs[rows[i] + 1]):
            out[at] = data[b]
            at += 1
    return out, ends


def _split(raw: bytes, ends: list[int]) -> list[bytes]:
    parts, at = [], 0
    for end in ends:
        parts.append(raw[at:end])
        at = end
    return parts


def gather(offs: np.ndarray, data: np.ndarray, rows: list[int]) -> list[bytes]:
    """The rows ``rows`` of an offsets/data column pair (uint8 data), as bytes: one compiled
    gather and one copy to Python, not a slice and a copy per row."""
    if not rows:
        return []
    out, ends = _gather(offs, data, np.asarray(rows, dtype=np.int64))
    return _split(out.tobytes(), ends.tolist())
