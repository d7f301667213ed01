"""The daemon's small JSON records where a jailed VMM can write: written without following links, read back only
when this daemon's key authenticates them (#19 finding 6; docs/security.md)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

KEY_FILE = "record.key"      # in the daemon's state directory, which no VMM sees
MAC_FIELD = "mac"
MAX_RECORD_BYTES = 4 << 20


class RecordAuthError(ValueError):
    """A record that is unreadable, not a plain file, too large, or not authenticated by this daemon's key."""


class RecordKey:
    """An HMAC-SHA256 key. A record's MAC covers its purpose (which file of which machine) and its canonical
    JSON, so a VMM that owns the directory can neither forge a record nor move one between machines."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("a record key has at least 32 bytes")
        self._key = key

    @classmethod
    def generate(cls) -> RecordKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def load_or_create(cls, path: Path) -> RecordKey:
        """The key at ``path`` (0600, a plain file), made on first use: written whole under a temp name and
        linked into place, so two daemons starting together agree on one key and never read a partial one."""
        if not os.path.lexists(path):
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(32))
                    f.flush()
                    os.fsync(f.fileno())
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)
            finally:
                os.unlink(tmp)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or st.st_uid != os.geteuid():
                raise RecordAuthError(f"{path}: a key must be a plain file of this process's uid that only its "
                                      "owner can read (mode 0600)")
            return cls(f.read(64))

    def mac(self, purpose: str, data: dict[str, Any]) -> str:
        body = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hmac.new(self._key, purpose.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()

    def write(self, path: Path, data: dict[str, Any], purpose: str, *, indent: int | None = None) -> None:
        """Write ``data`` with its MAC atomically: a fresh temp file (never through a link planted in its place),
        then a rename over ``path`` (which replaces a link rather than following it)."""
        if MAC_FIELD in data:
            raise ValueError(f"a record may not have a {MAC_FIELD!r} field of its own")
        tmp = path.with_name(f".{path.name}.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({**data, MAC_FIELD: self.mac(purpose, data)}, sort_keys=True, indent=indent) + "\n")
        os.replace(tmp, path)

    def read(self, path: Path, purpose: str) -> dict[str, Any]:
        """The record at ``path`` without its MAC; RecordAuthError unless this key wrote it for ``purpose``."""
        data = read_unverified(path)
        if not isinstance(data.get(MAC_FIELD), str):
            raise RecordAuthError(f"{path}: not a record of this daemon (no MAC)")
        mac = data.pop(MAC_FIELD)
        if not hmac.compare_digest(mac, self.mac(purpose, data)):
            raise RecordAuthError(f"{path}: its MAC does not verify (not written by this daemon for {purpose})")
        return data


def read_unverified(path: Path) -> dict[str, Any]:
    """A JSON object from a plain file of at most MAX_RECORD_BYTES, opened without following a link (and
    without blocking on a FIFO). Its content is whatever the directory's owner wrote: hostile input."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RecordAuthError(f"{path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise RecordAuthError(f"{path}: not a plain file")
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordAuthError(f"{path}: larger than {MAX_RECORD_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise RecordAuthError(f"{path}: not JSON ({e})") from None
    except RecursionError:   # 4 MiB of '[' nests deeper than the parser's stack
        raise RecordAuthError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise RecordAuthError(f"{path}: not a JSON object")
    return data
