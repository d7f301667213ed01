"""Connecting to a Unix socket that a less trusted process made: never through a symlink, only to its own socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path


class UnsafeSocketError(OSError):
    """The path is not a socket of the expected owner (a symlink, another kind of file, someone else's)."""


@contextlib.contextmanager
def pinned(path: str | Path, owner: int) -> Iterator[str]:
    """A path that names exactly the socket inode at ``path`` while the block runs: ``/proc/self/fd/N`` of an
    ``O_PATH | O_NOFOLLOW`` descriptor, checked to be a socket owned by ``owner``. The process that owns the
    directory cannot turn the name into a symlink to another socket (a host service's) between the check and
    the connect: connect() goes to the inode that was checked. (Also frees callers from AF_UNIX's 108 bytes.)"""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UnsafeSocketError(e.errno, f"cannot open socket {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a socket"
            raise UnsafeSocketError(f"{path} is {kind}: refused (a VM process's sockets are never followed)")
        if st.st_uid != owner:
            raise UnsafeSocketError(f"{path} belongs to uid {st.st_uid}, not the VM process's uid {owner}: refused")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


async def open_pinned_connection(path: str | Path, owner: int, *,
                                 limit: int = 2 ** 16) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio.open_unix_connection to the socket at ``path``, through ``pinned``."""
    with pinned(path, owner) as p:
        return await asyncio.open_unix_connection(p, limit=limit)
