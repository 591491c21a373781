"""The mirror's column files: appends cut at huge-page boundaries, gathers of variable-length rows."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from gmmlsh.index.columns import _IOV_MAX, HUGE_PAGE, Blobs, Column, _pieces, gather, refold


@pytest.mark.parametrize("offset", [0, 1, HUGE_PAGE - 3, HUGE_PAGE, 5 * HUGE_PAGE + 12345])
def test_writes_are_cut_at_every_huge_page_boundary_and_keep_every_byte(offset):
    rng = np.random.default_rng(offset % 97)
    buffers = [rng.integers(0, 255, size, dtype=np.uint8) for size in (10, HUGE_PAGE + 7, 3, 3 * HUGE_PAGE, 0, 999)]
    buffers.append(b"tail bytes")
    groups = _pieces(offset, buffers)
    at = offset
    for i, g in enumerate(groups):
        assert 0 < len(g) <= _IOV_MAX
        size = sum(len(v) for v in g)
        assert at // HUGE_PAGE == (at + size - 1) // HUGE_PAGE  # no write crosses a boundary
        if 0 < i < len(groups) - 1:  # only the first and the last may cover a huge page partly
            assert at % HUGE_PAGE == 0 and size == HUGE_PAGE
        at += size
    assert b"".join(b"".join(g) for g in groups) == b"".join(bytes(memoryview(b).cast("B")) for b in buffers)


def test_many_small_buffers_respect_the_iov_limit():
    groups = _pieces(0, [b"x"] * (3 * _IOV_MAX + 5))
    assert [len(g) for g in groups] == [_IOV_MAX] * 3 + [5]


def test_columns_and_blobs_read_back_what_was_appended_across_boundaries(tmp_path):
    col = Column(tmp_path / "c.u8", np.uint64, 3)
    rows = np.arange(3 * 200_000, dtype=np.uint64).reshape(-1, 3)  # 4.8 MB: crosses two boundaries
    col.write(0, rows[:1000])
    col.write(1000, rows[1000:])
    np.testing.assert_array_equal(col.rows(200_000), rows)
    blobs = Blobs(tmp_path, "b")
    parts = [bytes([i % 251]) * (i % 7) for i in range(5000)]
    blobs.append(0, parts[:2500])
    blobs.append(2500, parts[2500:])
    offs, data = blobs.views(5000)
    picked = [0, 4999, 17, 2500, 6, 6]
    assert gather(offs, data, picked) == [parts[i] for i in picked]
    assert gather(offs, data, []) == []
    other = Blobs(tmp_path, "o")
    more = [b"m%d" % i if i % 3 else b"" for i in range(5000)]
    other.append(0, more)
    assert gather(*other.views(5000), picked) == [more[i] for i in picked]


def test_refold_keeps_a_file_whole(tmp_path):
    path = tmp_path / "g.npy"
    a = np.random.default_rng(3).integers(0, 2**62, size=HUGE_PAGE // 8 * 3 + 11, dtype=np.int64)
    np.save(path, a)
    refold(path)
    np.testing.assert_array_equal(np.load(path, mmap_mode="r"), a)


def _dirty_bytes() -> int:
    """The machine's dirty page cache, once the kernel has folded its per-CPU counts into it
    (every ``vm.stat_interval`` seconds: read at once, a change may not show yet)."""
    time.sleep(float(Path("/proc/sys/vm/stat_interval").read_text()) + 0.2)
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Dirty:"))


@pytest.mark.skipif(not Path("/proc/sys/vm/stat_interval").exists(), reason="needs Linux's /proc")
def test_an_arena_region_is_written_back_once_filled_not_left_dirty_for_a_burst(tmp_path):
    """A fit writes gigabytes through mappings; left dirty, they went to the disk in one burst at
    the next checkpoint, and another process's LMDB commits waited behind it (156–292 ms at the
    median behind a 2 GiB fsync: bench/bench_write_back.py). A region handed out is written back
    once the one after the next is asked for, and a segment's end writes back the rest: the
    machine's dirty pages fall by what was written (512 MiB here, then 128 MiB a region; others'
    writes move the count by far less in that time)."""
    from types import SimpleNamespace

    from gmmlsh.index.segments import ArenaWriter, local_allocator

    size = 512 << 20
    col = Column(tmp_path / "a.arena", np.uint8)
    filled = col.reserve(size)
    filled[:] = 7
    before = _dirty_bytes()
    if before < size // 2:
        pytest.skip("this filesystem keeps no dirty pages (tmpfs?): nothing to write back")
    col.write_back(0, size)
    assert before - _dirty_bytes() > size // 2
    np.testing.assert_array_equal(np.fromfile(tmp_path / "a.arena", np.uint8, size), 7)

    values = size // 16  # 4-byte values: a quarter of ``size`` a region
    writer = ArenaWriter(tmp_path, SimpleNamespace(planes=1), words=8, allocate=local_allocator({}))
    rows, vals = writer.region("prows", 0, values), writer.region("pvals", 0, values)  # asked for together,
    rows[:], vals[:] = 1, 2.0  # then filled: the postings' rows and values
    before = _dirty_bytes()
    writer.region("drows", 0, 1024)[:] = 3  # the rows (a quarter of ``size``) go back now, not the values
    assert before - _dirty_bytes() > size // 8
    before = _dirty_bytes()
    writer.write_back()  # a segment's end: the rest
    assert before - _dirty_bytes() > size // 8
    np.testing.assert_array_equal(np.fromfile(tmp_path / "pvals.arena", np.float32, values), 2.0)
