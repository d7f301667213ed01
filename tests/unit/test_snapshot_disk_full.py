"""Writing a snapshot onto a full disk: a typed error naming ENOSPC, and no partial snapshot left behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_snapshot_format import sample_snapshot
from tmpfs_support import tiny_tmpfs

from smold.memory import GuestMemory
from smold.snapshot import format as snapformat
from smold.snapshot.errors import SnapshotError, SnapshotWriteError
from smold.snapshot.store import MEMORY_FILE, STATE_FILE, read_snapshot, write_snapshot

MEM = 4 << 20


def random_memory() -> GuestMemory:
    mem = GuestMemory([(0, MEM)])
    mem.write(0, os.urandom(MEM))   # nothing sparse: every byte must reach the disk
    return mem


def test_disk_full_while_writing_memory_leaves_no_directory(tmp_path: Path) -> None:
    with tiny_tmpfs("1m") as disk, random_memory() as mem:
        target = disk / "checkpoints" / "snap"
        with pytest.raises(SnapshotWriteError) as info:
            write_snapshot(target, mem, sample_snapshot(tmp_path))
        assert info.value.errno == errno.ENOSPC and info.value.no_space
        assert "No space left on device" in str(info.value) and MEMORY_FILE in str(info.value)
        assert not target.exists()
        assert [p.name for p in disk.rglob("*")] == ["checkpoints"]   # no temporary file either
        # The space is free again: a smaller machine's snapshot fits.
        with GuestMemory([(0, 256 << 10)]) as small:
            small.write(0, os.urandom(256 << 10))
            write_snapshot(target, small, sample_snapshot(tmp_path))
        assert read_snapshot(target).memory.size == 256 << 10


def test_disk_full_over_an_existing_snapshot_keeps_it(tmp_path: Path) -> None:
    """A failed memory write never renamed anything into place: the previous snapshot still reads."""
    with tiny_tmpfs("1m") as disk:
        target = disk / "snap"
        with GuestMemory([(0, 128 << 10)]) as small:
            small.write(0, os.urandom(128 << 10))
            write_snapshot(target, small, sample_snapshot(tmp_path))
        with random_memory() as mem, pytest.raises(SnapshotWriteError, match="No space left"):
            write_snapshot(target, mem, sample_snapshot(tmp_path))
        assert sorted(p.name for p in target.iterdir()) == [MEMORY_FILE, STATE_FILE]
        assert read_snapshot(target).memory.size == 128 << 10


def test_state_write_failing_after_memory_removes_the_stale_state(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory replaced, then the state write hits ENOSPC: the old state file (which described the old
    memory) goes too, so the directory is no snapshot rather than a wrong one."""
    target = tmp_path / "snap"
    with GuestMemory([(0, 64 << 10)]) as mem:
        write_snapshot(target, mem, sample_snapshot(tmp_path))

        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(snapformat.os, "fsync", full)
        mem.write(0, b"new contents")
        with pytest.raises(SnapshotWriteError, match="No space left") as info:
            write_snapshot(target, mem, sample_snapshot(tmp_path))
        assert info.value.no_space
    assert sorted(p.name for p in target.iterdir()) == [MEMORY_FILE]
    with pytest.raises(SnapshotError):
        read_snapshot(target)


def test_other_write_errors_are_typed_too(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with GuestMemory([(0, 64 << 10)]) as mem, pytest.raises(SnapshotWriteError) as info:
        write_snapshot(blocker / "snap", mem, sample_snapshot(tmp_path))
    assert info.value.errno == errno.ENOTDIR and not info.value.no_space
