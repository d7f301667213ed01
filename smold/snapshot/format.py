"""The snapshot state file: magic, format version, sizes, sha256, then a JSON state section (docs/snapshot.md).

Layout (little-endian), 64-byte header then the state section:

    0   8  magic            b"SMOLSNAP"
    8   4  format version   FORMAT_VERSION
    12  4  header size      64
    16  8  state length     bytes of the state section, at most MAX_STATE_BYTES
    24  32 sha256           over the header (this field zeroed) followed by the state section
    56  8  reserved         zero

The state section is UTF-8 JSON produced by ``codec.encode`` from frozen dataclasses. Guest memory is
not in this file: it lives in a raw memory file beside it (``smold.snapshot.memory``) so it can be mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, TypeVar

from smold.snapshot import codec
from smold.snapshot.errors import (
    SnapshotChecksumError,
    SnapshotError,
    SnapshotFormatError,
    SnapshotTooLargeError,
    SnapshotTruncatedError,
    SnapshotVersionError,
    SnapshotWriteError,
)

T = TypeVar("T")

MAGIC = b"SMOLSNAP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s8s")
HEADER_SIZE = _HEADER.size
MAX_STATE_BYTES = 16 * 1024 * 1024   # a VM's state is a few hundred KiB; anything bigger is refused
_DIGEST_OFFSET = 24
# Readable by a jailed VMM's unprivileged uid (smold/jail); the daemon keeps snapshots under 0700 directories.
SNAPSHOT_FILE_MODE = 0o644

assert HEADER_SIZE == 64


def _digest(header_without_digest: bytes, state: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(header_without_digest)
    h.update(state)
    return h.digest()


def pack_state(state: Any, *, version: int = FORMAT_VERSION) -> bytes:
    """Header + JSON state section for the frozen dataclass ``state``."""
    body = json.dumps(codec.encode(state), separators=(",", ":"), sort_keys=True,
                      allow_nan=False).encode("utf-8")
    if len(body) > MAX_STATE_BYTES:
        raise SnapshotTooLargeError(f"state section of {len(body)} bytes exceeds the cap of {MAX_STATE_BYTES}")
    blank = _HEADER.pack(MAGIC, version, HEADER_SIZE, len(body), bytes(32), bytes(8))
    header = _HEADER.pack(MAGIC, version, HEADER_SIZE, len(body), _digest(blank, body), bytes(8))
    return header + body


def _reject_constant(name: str) -> Any:
    raise SnapshotFormatError(f"state section contains the non-JSON constant {name}")


def unpack_state(cls: type[T], data: bytes, *, source: str = "snapshot state") -> T:
    """Check and decode bytes produced by ``pack_state``; a typed SnapshotFormatError on any defect."""
    if len(data) < HEADER_SIZE:
        if not MAGIC.startswith(data[:len(MAGIC)]) or not data:
            raise SnapshotFormatError(f"{source}: not a smol snapshot state file (bad magic)")
        raise SnapshotTruncatedError(f"{source}: truncated header ({len(data)} of {HEADER_SIZE} bytes)")
    magic, version, header_size, length, digest, reserved = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotFormatError(f"{source}: not a smol snapshot state file (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        raise SnapshotVersionError(f"{source}: format version {version}, this VMM reads version {FORMAT_VERSION}")
    if header_size != HEADER_SIZE or reserved != bytes(8):
        raise SnapshotFormatError(f"{source}: malformed header (size {header_size}, reserved {reserved.hex()})")
    if length > MAX_STATE_BYTES:
        raise SnapshotTooLargeError(f"{source}: state section of {length} bytes exceeds the cap of "
                                    f"{MAX_STATE_BYTES}")
    have = len(data) - HEADER_SIZE
    if have < length:
        raise SnapshotTruncatedError(f"{source}: truncated: header promises {length} state bytes, "
                                     f"file has {have}")
    if have > length:
        raise SnapshotFormatError(f"{source}: {have - length} bytes of trailing data after the state section")
    body = data[HEADER_SIZE:]
    blank = data[:_DIGEST_OFFSET] + bytes(32) + data[_DIGEST_OFFSET + 32:HEADER_SIZE]
    if _digest(blank, body) != digest:
        raise SnapshotChecksumError(f"{source}: sha256 mismatch: the state file is corrupted or was modified")
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotFormatError(f"{source}: state section is not valid JSON: {e}") from None
    except RecursionError:   # found by tests/fuzz: '[' * 100000 exhausts the decoder's stack
        raise SnapshotFormatError(f"{source}: state section is nested too deeply") from None
    return codec.decode(cls, obj)


def write_state_file(path: Path, state: Any) -> int:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename); returns the file size."""
    data = pack_state(state)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, SNAPSHOT_FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SnapshotWriteError(f"cannot write snapshot state {path}: {e.strerror or e}", e.errno) from e
    return len(data)


def read_state_file(path: Path, cls: type[T]) -> T:
    """Read and check a state file; at most header + cap bytes are read whatever the file's size."""
    try:
        with open(path, "rb") as f:
            data = f.read(HEADER_SIZE + MAX_STATE_BYTES + 1)
    except OSError as e:
        raise SnapshotError(f"cannot read snapshot state {path}: {e.strerror or e}") from e
    return unpack_state(cls, data, source=str(path))
