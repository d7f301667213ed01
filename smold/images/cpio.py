"""Deterministic writer for "newc" (SVR4, magic 070701) cpio archives, the Linux initramfs format."""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import BinaryIO

from smold.images.errors import ImageBuildError

MAGIC = b"070701"
TRAILER = "TRAILER!!!"
HEADER_LEN = 110  # 6-byte magic + 13 fields of 8 hex digits (Documentation/driver-api/early-userspace/buffer-format.rst)


class CpioError(ImageBuildError):
    """An archive entry is invalid (bad path, duplicate, missing parent directory)."""


@dataclass(frozen=True)
class Entry:
    """One archive member; ``data`` is the file content or the symlink target."""

    path: str
    mode: int
    data: bytes = b""
    rdev_major: int = 0
    rdev_minor: int = 0


def _check_path(path: str) -> str:
    if path.startswith("/"):
        path = path[1:]
    parts = path.split("/")
    if not path or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise CpioError(f"invalid archive path {path!r}")
    return path


def _sort_key(path: str) -> tuple[str, ...]:
    # Component-wise order puts every directory before its contents.
    return tuple(path.split("/"))


class Archive:
    """Collect entries, then ``write`` them sorted with fixed uid/gid/mtime and sequential inodes."""

    def __init__(self, mtime: int = 0) -> None:
        self.mtime = mtime
        self._entries: dict[str, Entry] = {}

    def _add(self, entry: Entry) -> None:
        if entry.path in self._entries:
            raise CpioError(f"duplicate archive path {entry.path!r}")
        self._entries[entry.path] = entry

    def add_dir(self, path: str, mode: int = 0o755) -> None:
        self._add(Entry(_check_path(path), stat.S_IFDIR | (mode & 0o7777)))

    def add_dirs(self, path: str, mode: int = 0o755) -> None:
        """Add ``path`` and any missing ancestors (like ``mkdir -p``)."""
        parts = _check_path(path).split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in self._entries:
                self.add_dir(sub, mode)

    def add_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._add(Entry(_check_path(path), stat.S_IFREG | (mode & 0o7777), data))

    def add_symlink(self, path: str, target: str) -> None:
        if not target:
            raise CpioError(f"empty symlink target for {path!r}")
        self._add(Entry(_check_path(path), stat.S_IFLNK | 0o777, target.encode()))

    def add_chardev(self, path: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._add(Entry(_check_path(path), stat.S_IFCHR | (mode & 0o7777), b"", major, minor))

    def __contains__(self, path: str) -> bool:
        return _check_path(path) in self._entries

    def paths(self) -> list[str]:
        return sorted(self._entries, key=_sort_key)

    def write(self, out: BinaryIO) -> int:
        """Write the archive (plus trailer); return the number of bytes written."""
        written = 0
        for ino, path in enumerate(self.paths(), start=1):
            parent = path.rpartition("/")[0]
            if parent and (parent not in self._entries or not stat.S_ISDIR(self._entries[parent].mode)):
                raise CpioError(f"{path!r} has no parent directory entry {parent!r}")
            e = self._entries[path]
            nlink = 2 if stat.S_ISDIR(e.mode) else 1
            written += _write_member(out, ino, e.mode, nlink, self.mtime, path, e.data, e.rdev_major,
                                     e.rdev_minor)
        written += _write_member(out, 0, 0, 1, 0, TRAILER, b"", 0, 0)
        pad = -written % 512  # conventional block padding; the kernel skips trailing zeros
        out.write(b"\0" * pad)
        return written + pad

    def to_bytes(self) -> bytes:
        import io

        buf = io.BytesIO()
        self.write(buf)
        return buf.getvalue()


def _write_member(out: BinaryIO, ino: int, mode: int, nlink: int, mtime: int, name: str, data: bytes,
                  rmaj: int, rmin: int) -> int:
    name_b = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, nlink, mtime, len(data), 0, 0, rmaj, rmin, len(name_b), 0)
    header = MAGIC + b"".join(b"%08x" % f for f in fields)
    assert len(header) == HEADER_LEN
    blob = header + name_b
    blob += b"\0" * (-len(blob) % 4)
    blob += data
    blob += b"\0" * (-len(blob) % 4)
    out.write(blob)
    return len(blob)
