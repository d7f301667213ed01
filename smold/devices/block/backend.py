"""Host I/O for virtio-blk: a disk image file accessed with pread/pwrite on one fd."""

from __future__ import annotations

import errno
import os
from typing import Protocol


class BackendError(Exception):
    """The disk image could not be opened or has an unusable size."""


class BlockBackend(Protocol):
    """What the block device needs from storage. I/O errors surface as OSError."""

    @property
    def size(self) -> int: ...

    @property
    def read_only(self) -> bool: ...

    def read_into(self, offset: int, buf: memoryview) -> None: ...

    def write(self, offset: int, data: memoryview) -> None: ...

    def flush(self) -> None: ...


class FileBackend:
    """A raw image file. Reads past end-of-file (a sparse or short image) return zeros."""

    def __init__(self, path: str | os.PathLike[str], read_only: bool = False, *,
                 size: int | None = None) -> None:
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags)
        except OSError as e:
            raise BackendError(f"cannot open disk image {os.fspath(path)!r}: {e}") from e
        self._read_only = read_only
        try:
            actual = os.fstat(self._fd).st_size
        except OSError as e:
            os.close(self._fd)
            raise BackendError(f"cannot stat disk image: {e}") from e
        self._size = actual if size is None else size
        if self._size < 0:
            os.close(self._fd)
            raise BackendError(f"disk size {self._size} is negative")

    @property
    def size(self) -> int:
        return self._size

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def fd(self) -> int:
        return self._fd

    def read_into(self, offset: int, buf: memoryview) -> None:
        done = 0
        total = len(buf)
        while done < total:
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n == 0:  # end of file: the rest of the image is a hole
                buf[done:] = bytes(total - done)
                return
            done += n

    def write(self, offset: int, data: memoryview) -> None:
        if self._read_only:
            raise OSError(errno.EBADF, "disk image is read-only")
        done = 0
        while done < len(data):
            n = os.pwrite(self._fd, data[done:], offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, "short write to disk image")
            done += n

    def flush(self) -> None:
        if not self._read_only:
            os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
