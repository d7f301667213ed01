"""A snapshot directory: the checked state file plus the raw guest-memory file it names.

    DIR/snapshot.state   header + sha256 + JSON state (smold.snapshot.format)
    DIR/memory.raw       guest RAM, region table in the state; sparse (zero chunks are holes)

Files are written under temporary names and renamed into place, memory first and state last, so a
directory with a state file always has the memory it describes; an old memory file that a running VM
still maps is replaced by rename, never truncated under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from smold.memory import GuestMemory
from smold.snapshot.errors import (
    SnapshotChecksumError,
    SnapshotCompatError,
    SnapshotError,
    SnapshotFormatError,
    SnapshotTruncatedError,
    SnapshotWriteError,
)
from smold.snapshot.format import SNAPSHOT_FILE_MODE, read_state_file, write_state_file
from smold.snapshot.state import STATE_KIND, MemoryRegionState, MemoryState, VmSnapshot

STATE_FILE = "snapshot.state"
MEMORY_FILE = "memory.raw"
_HASH_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class MemoryWrite:
    """What writing guest memory produced."""

    state: MemoryState
    bytes_written: int     # non-zero chunks actually written (the rest are holes)


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_memory(directory: Path, mem: GuestMemory, *, digest: bool = False, durable: bool = False) -> MemoryWrite:
    """Write ``mem`` to ``directory/memory.raw`` (temporary name, then rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / MEMORY_FILE
    tmp = _tmp(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, SNAPSHOT_FILE_MODE)
        try:
            written = mem.dump(fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        sha = file_sha256(tmp) if digest else None
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SnapshotWriteError(f"cannot write guest memory to {final}: {e.strerror or e}", e.errno) from e
    regions = tuple(MemoryRegionState(r.guest_addr, r.size, r.file_offset) for r in mem.regions)
    return MemoryWrite(MemoryState(file=MEMORY_FILE, size=mem.size, regions=regions, sha256=sha), written)


def write_state(directory: Path, snapshot: VmSnapshot) -> int:
    """Write the state file (last: it marks the directory complete); returns its size."""
    return write_state_file(directory / STATE_FILE, snapshot)


def write_snapshot(directory: Path, mem: GuestMemory, state: VmSnapshot, *, digest: bool = False,
                   durable: bool = False, timings: dict[str, float] | None = None) -> tuple[int, MemoryWrite]:
    """Write memory, then the state naming it, into ``directory``; returns (state file size, memory write).

    On failure (SnapshotWriteError; ENOSPC on a full disk) nothing that looks like a snapshot is left
    half-written: a directory this call created is removed; in an existing one, a failed memory write
    leaves the previous snapshot as it was (the new memory was never renamed into place), and a failed
    state write after the memory was replaced removes the old state file, which no longer matches.
    Temporary files are always removed. ``timings`` (if given) gets the seconds for "memory" and "state".
    """
    created = not directory.exists()
    memory_replaced = False
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SnapshotWriteError(f"cannot create snapshot directory {directory}: {e.strerror or e}",
                                     e.errno) from e
        t0 = time.monotonic()
        mem_write = write_memory(directory, mem, digest=digest, durable=durable)
        memory_replaced = True
        t1 = time.monotonic()
        size = write_state(directory, dataclasses.replace(state, memory=mem_write.state))
        if timings is not None:
            timings.update(memory=t1 - t0, state=time.monotonic() - t1)
    except SnapshotError:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        elif memory_replaced:
            with contextlib.suppress(OSError):
                (directory / STATE_FILE).unlink(missing_ok=True)
        raise
    return size, mem_write


def read_snapshot(directory: Path) -> VmSnapshot:
    """Read and check ``directory``'s state file and that its memory file is there and big enough."""
    directory = Path(directory)
    path = directory / STATE_FILE
    if not path.is_file():
        raise SnapshotError(f"{directory} is not a snapshot directory (no {STATE_FILE})")
    snap = read_state_file(path, VmSnapshot)
    if snap.kind != STATE_KIND:
        raise SnapshotFormatError(f"{path}: state of kind {snap.kind!r}, expected {STATE_KIND!r}")
    check_memory_layout(snap.memory)
    mem_path = memory_path(directory, snap)
    try:
        size = mem_path.stat().st_size
    except OSError as e:
        raise SnapshotError(f"snapshot memory file {mem_path}: {e.strerror}") from e
    if size < snap.memory.size:
        raise SnapshotTruncatedError(f"snapshot memory file {mem_path} has {size} bytes, the state "
                                     f"describes {snap.memory.size}")
    if len(snap.vcpus) != snap.spec.cpus or not snap.vcpus:
        raise SnapshotFormatError(f"{path}: {len(snap.vcpus)} vCPU states for {snap.spec.cpus} vCPUs")
    return snap


def memory_path(directory: Path, snap: VmSnapshot) -> Path:
    name = snap.memory.file
    if not name or "/" in name or name in (".", ".."):
        raise SnapshotFormatError(f"memory file name {name!r} must be a plain file name")
    return Path(directory) / name


def check_memory_layout(memory: MemoryState) -> None:
    """Regions sorted, page aligned, non-overlapping, packed in the file as GuestMemory lays them out."""
    offset = 0
    prev_end = -1
    for r in memory.regions:
        if r.size <= 0 or r.guest_addr % 4096 or r.size % 4096 or r.guest_addr < prev_end:
            raise SnapshotFormatError(f"bad memory region {r.guest_addr:#x}+{r.size:#x}")
        if r.file_offset != offset:
            raise SnapshotFormatError(f"memory region {r.guest_addr:#x} at file offset {r.file_offset:#x}, "
                                      f"expected {offset:#x}")
        offset += r.size
        prev_end = r.guest_addr + r.size
    if not memory.regions or offset != memory.size:
        raise SnapshotFormatError(f"memory regions cover {offset} bytes, state says {memory.size}")


def verify_memory(directory: Path, snap: VmSnapshot) -> None:
    """Compare the memory file with the sha256 recorded at snapshot time (reads the whole file)."""
    if snap.memory.sha256 is None:
        raise SnapshotCompatError("this snapshot recorded no memory digest")
    actual = file_sha256(memory_path(directory, snap))
    if actual != snap.memory.sha256:
        raise SnapshotChecksumError(f"memory file sha256 {actual} does not match the recorded "
                                  f"{snap.memory.sha256}")
