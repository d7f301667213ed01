"""VM snapshots: a checked state file of frozen dataclasses plus a mappable guest-memory file (docs/snapshot.md)."""

from smold.snapshot.errors import (
    SnapshotChecksumError,
    SnapshotCompatError,
    SnapshotError,
    SnapshotFormatError,
    SnapshotTooLargeError,
    SnapshotTruncatedError,
    SnapshotVersionError,
)

__all__ = ["SnapshotChecksumError", "SnapshotCompatError", "SnapshotError", "SnapshotFormatError",
           "SnapshotTooLargeError", "SnapshotTruncatedError", "SnapshotVersionError"]
