"""Content digests (OCI image spec, descriptor.md "Digests"): parse, stream-hash and verify."""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

from .errors import DigestError, FormatError

# descriptor.md: algorithm ":" encoded; only sha256 is required of implementations (and all we accept).
_SHA256_RE = re.compile(r"sha256:[a-f0-9]{64}")
CHUNK = 1 << 20


def check_digest(digest: object) -> str:
    """``digest`` if it is a well-formed ``sha256:<64 hex>`` string, else FormatError."""
    if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        raise FormatError(f"unsupported or malformed digest {digest!r} (want sha256:<64 lowercase hex>)")
    return digest


def hex_of(digest: str) -> str:
    return check_digest(digest).split(":", 1)[1]


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verify_bytes(data: bytes, digest: str, size: int | None = None, what: str = "blob") -> bytes:
    """Return ``data`` if it matches ``digest`` (and ``size``); DigestError otherwise."""
    check_digest(digest)
    if size is not None and len(data) != size:
        raise DigestError(f"{what} {digest}: size {len(data)} != descriptor size {size}")
    actual = sha256_bytes(data)
    if actual != digest:
        raise DigestError(f"{what} {digest}: content hashes to {actual}")
    return data


def iter_chunks(fh: BinaryIO, chunk: int = CHUNK) -> Iterator[bytes]:
    while data := fh.read(chunk):
        yield data


def file_digest(fh: BinaryIO) -> tuple[str, int]:
    """(sha256 digest, size) of the rest of ``fh``."""
    h = hashlib.sha256()
    n = 0
    for data in iter_chunks(fh):
        h.update(data)
        n += len(data)
    return "sha256:" + h.hexdigest(), n


class HashingReader(io.RawIOBase):
    """A read-only raw stream that hashes every byte read through it (blob and diff_id checks)."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self._h = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self._raw.read(len(buf))
        n = len(data)
        buf[:n] = data
        self._h.update(data)
        self.size += n
        return n

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self._h.hexdigest()
