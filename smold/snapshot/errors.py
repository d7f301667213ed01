"""Typed errors of the snapshot package: every rejected snapshot raises a SnapshotError subclass."""

from __future__ import annotations


class SnapshotError(Exception):
    """A snapshot could not be written, read or restored."""


class SnapshotFormatError(SnapshotError):
    """The state file is not a well-formed snapshot (bad magic, header, JSON or field types)."""


class SnapshotVersionError(SnapshotFormatError):
    """The state file was written in a format version this VMM does not read."""


class SnapshotTruncatedError(SnapshotFormatError):
    """The state file (or memory file) is shorter than its header says."""


class SnapshotTooLargeError(SnapshotFormatError):
    """The state section is larger than the size cap: refused before it is read."""


class SnapshotChecksumError(SnapshotFormatError):
    """The sha256 over header and state does not match: the file was corrupted or tampered with."""


class SnapshotCompatError(SnapshotError):
    """A well-formed snapshot that does not fit this host or configuration (disk size, CPU, memory)."""


class SnapshotWriteError(SnapshotError):
    """A snapshot could not be written (I/O error; ``errno`` says which, e.g. ENOSPC on a full disk).
    Nothing that could be mistaken for a snapshot is left behind."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    @property
    def no_space(self) -> bool:
        """The file system is full or the quota is used up."""
        import errno as _errno
        return self.errno in (_errno.ENOSPC, _errno.EDQUOT)
