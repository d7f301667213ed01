"""A guest flooding its serial console: host disk and memory stay bounded (smold/vmm/console.py), also on a full disk."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
from tmpfs_support import tiny_tmpfs

from smold.devices.irq import CountingIrq
from smold.devices.serial import Serial
from smold.vmm.console import TAIL_MAX, ConsoleLog, ConsoleLogError

THR = 0
CAP = 64 * 1024


def log_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name)}


def test_serial_flood_through_the_uart_is_capped_on_disk(tmp_path: Path) -> None:
    """1 MiB written byte by byte to THR, as a guest's `while true; do cat /dev/zero > /dev/ttyS0` would."""
    path = tmp_path / "console.log"
    sink = ConsoleLog(path, None, CAP)
    uart = Serial(CountingIrq(), sink)
    pattern = bytes(range(32, 127))
    total = 1 << 20
    written = 0
    peak = 0
    while written < total:
        for b in pattern:
            uart.write(THR, bytes([b]))
        written += len(pattern)
        peak = max(peak, sum(log_files(path).values()))
    sink.close()
    files = log_files(path)
    assert set(files) == {"console.log", "console.log.1"}
    assert peak <= 2 * CAP and files["console.log.1"] == CAP
    assert sink.rotations == written // CAP - (1 if written % CAP == 0 else 0)
    # The newest bytes are kept, in order, across the rotation boundary.
    stream = b"".join(pattern for _ in range(written // len(pattern)))
    kept = (path.parent / "console.log.1").read_bytes() + path.read_bytes()
    assert stream.endswith(kept) and len(kept) >= CAP
    assert len(sink.tail) <= TAIL_MAX and stream.endswith(bytes(sink.tail))


def test_large_flood_keeps_disk_and_memory_bounded(tmp_path: Path) -> None:
    """256 MiB of console output in 4 KiB writes: disk stays within two files, memory does not grow."""
    path = tmp_path / "console.log"
    sink = ConsoleLog(path, None, 1 << 20)
    chunk = os.urandom(4096)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range((256 << 20) // len(chunk)):
        sink(chunk)
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    sink.close()
    assert sum(log_files(path).values()) <= 2 << 20
    assert sink.rotations == 255 and sink.lost_bytes == 0
    assert rss_growth_kib < 16 * 1024   # nothing of the 256 MiB is held in memory


def test_existing_log_counts_towards_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    path.write_bytes(b"x" * (CAP - 10))        # a restored machine appends to its log
    sink = ConsoleLog(path, None, CAP)
    sink(b"y" * 20)
    sink.close()
    assert log_files(path) == {"console.log": 20, "console.log.1": CAP - 10}


def test_cap_must_be_sane(tmp_path: Path) -> None:
    with pytest.raises(ConsoleLogError):
        ConsoleLog(tmp_path / "c.log", None, 100)


def test_full_disk_never_reaches_the_guest() -> None:
    """The log's file system fills up: the UART keeps working, the bytes are counted as lost."""
    with tiny_tmpfs("256k") as d:
        path = d / "console.log"
        sink = ConsoleLog(path, None, 1 << 20)   # the cap is above what the disk holds
        uart = Serial(CountingIrq(), sink)
        chunk = b"z" * 4096
        for _ in range(128):                      # 512 KiB
            sink(chunk)
        for b in b"still alive\n":
            uart.write(THR, bytes([b]))
        assert sink.lost_bytes > 0
        assert bytes(sink.tail).endswith(b"still alive\n")
        assert path.stat().st_size <= 256 * 1024
        sink.close()


def test_rotation_fits_a_small_disk() -> None:
    """With a cap below half the disk, a flood of many times the disk's size is logged without loss."""
    with tiny_tmpfs("1m") as d:
        path = d / "console.log"
        sink = ConsoleLog(path, None, 256 * 1024)
        for _ in range(2048):                     # 8 MiB
            sink(b"q" * 4096)
        sink.close()
        assert sink.lost_bytes == 0 and sink.rotations == 31
        assert log_files(path) == {"console.log": 256 * 1024, "console.log.1": 256 * 1024}
