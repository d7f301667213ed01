"""Unpack a tar archive a guest made (CopyOut's tar format) into a host directory without trusting it.

Python's ``tarfile`` ``filter="data"`` checks names and link targets against ``os.path.realpath`` before it
writes, and has had bypasses on the Python versions this project allows (issue #19, finding 3: a file written
outside the destination on 3.11.7). This unpacker never resolves a path and never follows a link: every
directory on the way to a member is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before it,
starting at the destination, and every file is created with ``O_EXCL | O_NOFOLLOW``. A symlink is recreated as
a symlink (its target verbatim: it is never followed here); a hard link becomes a copy of a member already
unpacked; device nodes and FIFOs are skipped; set-id, sticky and group/other write bits are dropped; nothing is
chowned. A member whose name is absolute or has ``..``, whose way passes through a symlink, a symlink whose
target is absolute or leaves the destination, or a sparse file fails the whole unpack with
:class:`UnsafeArchiveError` naming it. Only plain tar is read (CopyOut's archives are ``tar -c``): nothing inflates.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tarfile
from pathlib import Path
from typing import IO, BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


class UnsafeArchiveError(ValueError):
    """The archive tried to write outside its destination (or through a link)."""


def _parts(name: str) -> list[str]:
    if name.startswith("/"):
        raise UnsafeArchiveError(f"{name!r}: an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchiveError(f"{name!r}: a '..' component")
    return parts


def _open_dir(dest_fd: int, parts: list[str], name: str, *, create: bool) -> int:
    """An fd of dest/parts..., each component a real directory (made if missing and ``create``)."""
    fd = os.dup(dest_fd)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeArchiveError(f"{name!r}: {part!r} on its way is not a directory (a link?)") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_link_target(name: str, parts: list[str], target: str) -> None:
    """A symlink is never followed here, but whoever reads the unpacked tree later may follow it: its target
    must be relative and stay inside the destination (as tarfile's data filter demands)."""
    if target.startswith("/"):
        raise UnsafeArchiveError(f"{name!r}: a symlink to the absolute path {target!r}")
    depth = len(parts) - 1
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise UnsafeArchiveError(f"{name!r}: a symlink to {target!r}, outside the destination")
        elif part not in ("", "."):
            depth += 1


def _remove_entry(parent_fd: int, name: str) -> None:
    """Make room for a new entry: a file or link is unlinked (never followed); a directory stays."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)


def _write_file(parent_fd: int, name: str, src: IO[bytes], mode: int, mtime: float) -> None:
    _remove_entry(parent_fd, name)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent_fd)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
        os.fchmod(fd, mode)
        os.utime(fd, (mtime, mtime))
    finally:
        os.close(fd)


def _file_mode(mode: int) -> int:
    return (mode & 0o755) | 0o600      # no set-id or sticky bits, no group/other write; the owner can read/write


def extract(archive: bytes | BinaryIO, dest: str | os.PathLike[str]) -> int:
    """Unpack ``archive`` (plain or compressed tar) into the existing directory ``dest``; returns how many
    members were written. Raises UnsafeArchiveError for a member that would land outside ``dest``, and
    tarfile.TarError for a corrupt archive."""
    fileobj = io.BytesIO(archive) if isinstance(archive, bytes | bytearray) else archive
    dest_fd = os.open(Path(dest), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # the caller's choice: may be a link
    written = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:   # plain tar (`tar -c`): nothing to inflate
            for m in tar:
                parts = _parts(m.name)
                if not parts:
                    continue              # the root itself
                if m.issparse():
                    raise UnsafeArchiveError(f"{m.name!r}: a sparse file (its holes would unpack to zeros the "
                                             "archive does not carry)")
                parent_fd = _open_dir(dest_fd, parts[:-1], m.name, create=True)
                try:
                    leaf = parts[-1]
                    if m.isdir():
                        try:
                            os.mkdir(leaf, 0o755, dir_fd=parent_fd)
                        except FileExistsError:
                            pass
                        fd = _open_dir(parent_fd, [leaf], m.name, create=False)
                        try:
                            os.fchmod(fd, (m.mode & 0o755) | 0o700)
                        finally:
                            os.close(fd)
                    elif m.isreg():
                        src = tar.extractfile(m)
                        assert src is not None
                        _write_file(parent_fd, leaf, src, _file_mode(m.mode), m.mtime)
                    elif m.issym():
                        _check_link_target(m.name, parts, m.linkname)
                        _remove_entry(parent_fd, leaf)
                        os.symlink(m.linkname, leaf, dir_fd=parent_fd)
                    elif m.islnk():
                        # a copy of a member already unpacked, reached the same way (no link followed)
                        target = _parts(m.linkname)
                        if not target:
                            raise UnsafeArchiveError(f"{m.name!r}: a hard link to the root")
                        tdir = _open_dir(dest_fd, target[:-1], m.name, create=False)
                        try:
                            sfd = os.open(target[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tdir)
                        except OSError as e:
                            raise UnsafeArchiveError(f"{m.name!r}: hard link to {m.linkname!r}, which is not a "
                                                     f"file unpacked before it ({e.strerror})") from None
                        finally:
                            os.close(tdir)
                        try:
                            if not stat.S_ISREG(os.fstat(sfd).st_mode):
                                raise UnsafeArchiveError(f"{m.name!r}: hard link to {m.linkname!r}, not a file")
                            with os.fdopen(sfd, "rb", closefd=False) as src_file:
                                _write_file(parent_fd, leaf, src_file, _file_mode(m.mode), m.mtime)
                        finally:
                            os.close(sfd)
                    else:
                        continue          # devices, FIFOs: nothing a copy needs
                    written += 1
                finally:
                    os.close(parent_fd)
    finally:
        os.close(dest_fd)
    return written
