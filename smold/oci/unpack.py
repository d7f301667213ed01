"""Apply OCI layers (image spec layer.md) to a staging directory: whiteouts, opaque dirs, links, owners.

Every path is resolved inside the staging root without trusting the filesystem: parent components
that are symlinks (``/lib -> usr/lib`` in merged-/usr images) are followed *within* the root, and a
name or symlink that would leave the root is rejected (UnsafePathError), as are absolute names and
``..`` components. Only this process writes the staging directory while it is unpacked.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from .digest import HashingReader
from .errors import DigestError, FormatError, UnsafePathError, UnsupportedError

WHITEOUT_PREFIX = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINKS = 40  # like the kernel's MAXSYMLINKS
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
UNPACK_VERSION = 1  # bump when unpacking changes the bytes of the produced tree


def _decompressor(raw: BinaryIO) -> BinaryIO:
    """Wrap a layer blob stream by its magic bytes: gzip, zstd or plain tar (layer.md media types)."""
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type,type-var]
    head = buffered.peek(4)[:4]
    if head[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            raise UnsupportedError("layer is zstd-compressed and the 'zstandard' module is not installed "
                                   "(pip install zstandard)") from None
        return zstandard.ZstdDecompressor().stream_reader(buffered)
    return buffered  # type: ignore[return-value]


# An image's layers together may unpack to at most this much and this many entries: a layer blob is small on
# the wire and in the cache, its unpacked tree is not (a gzip or zstd bomb fills the daemon's disk otherwise;
# issue #19, finding 8). Real task images are a few GiB; the biggest common ones (CUDA) stay under this.
MAX_IMAGE_UNPACKED_BYTES = 16 << 30
MAX_IMAGE_ENTRIES = 4_000_000


class UnpackBudget:
    """What an image's remaining layers may still unpack to (shared across apply_layer calls)."""

    def __init__(self, max_bytes: int = MAX_IMAGE_UNPACKED_BYTES, max_entries: int = MAX_IMAGE_ENTRIES) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.bytes = 0
        self.entries = 0

    def take_bytes(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.max_bytes:
            raise FormatError(f"the image's layers unpack to more than {self.max_bytes} bytes (smold's cap; a "
                              "decompression bomb, or an image too big for a task)")

    def take_entry(self) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise FormatError(f"the image's layers hold more than {self.max_entries} entries (smold's cap)")


class _Budgeted(io.RawIOBase):
    """The decompressed stream, charged to a budget as it is read: reading past the cap fails at once."""

    def __init__(self, raw: BinaryIO, budget: UnpackBudget) -> None:
        super().__init__()
        self._raw, self._budget = raw, budget

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self._raw.read(len(buf))
        self._budget.take_bytes(len(data))
        buf[:len(data)] = data
        return len(data)


def clean_name(name: str) -> tuple[str, ...]:
    """Archive member name -> path components; rejects absolute names and '..'."""
    if name.startswith("/"):
        raise UnsafePathError(f"layer entry {name!r} is an absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafePathError(f"layer entry {name!r} contains '..'")
    if any("\0" in p for p in parts):
        raise UnsafePathError(f"layer entry {name!r} contains a NUL byte")
    return parts


class Tree:
    """A staging root, with in-root path resolution."""

    def __init__(self, root: Path, created: set[tuple[str, ...]] | None = None) -> None:
        self.root = root
        self.root_str = os.fspath(root)
        self.created = created if created is not None else set()  # paths made since the layer began

    def real(self, parts: Iterable[str]) -> str:
        return os.path.join(self.root_str, *parts)

    def resolve(self, parts: tuple[str, ...], *, follow_last: bool, create: bool, what: str) -> tuple[str, ...]:
        """Components of ``parts`` with every symlink resolved inside the root.

        The last component is followed only with ``follow_last``. Missing parent directories are
        created (mode 0755, root-owned) with ``create``; otherwise a missing parent raises FileNotFoundError.
        """
        todo = list(parts)
        done: list[str] = []
        hops = 0
        while todo:
            comp = todo.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if not done:
                    raise UnsafePathError(f"{what}: a symlink leads above the image root")
                done.pop()
                continue
            is_last = not todo
            path = self.real([*done, comp])
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if is_last:
                    done.append(comp)
                    break
                if not create:
                    raise
                os.mkdir(path, 0o755)
                done.append(comp)
                self.created.add(tuple(done))
                continue
            if stat.S_ISLNK(st.st_mode) and (not is_last or follow_last):
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise UnsafePathError(f"{what}: too many levels of symbolic links")
                target = os.readlink(path)
                if target.startswith("/"):
                    done = []
                todo = [p for p in target.split("/") if p] + todo
                continue
            if not is_last and not stat.S_ISDIR(st.st_mode):
                raise FormatError(f"{what}: /{'/'.join([*done, comp])} is not a directory")
            done.append(comp)
        return tuple(done)


def _remove(path: str) -> None:
    """Remove a file, symlink or directory tree without following symlinks."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _set_meta(path: str, m: tarfile.TarInfo, *, is_link: bool) -> None:
    """Owner, mode (after chown, which clears set-id bits), xattrs and mtime, never following a symlink."""
    os.chown(path, m.uid, m.gid, follow_symlinks=False)
    if not is_link:
        os.chmod(path, stat.S_IMODE(m.mode))
    for key, value in (m.pax_headers or {}).items():
        if key.startswith("SCHILY.xattr."):
            try:
                os.setxattr(path, key[len("SCHILY.xattr."):], value.encode("utf-8", "surrogateescape"),
                            follow_symlinks=False)
            except OSError as e:
                if e.errno not in (errno.ENOTSUP, errno.EPERM):
                    raise
    os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)


class LayerStats:
    def __init__(self) -> None:
        self.files = 0
        self.whiteouts = 0
        self.skipped_devices = 0


def apply_layer(root: Path, stream: BinaryIO, *, diff_id: str | None = None,
                budget: UnpackBudget | None = None) -> LayerStats:
    """Apply one layer blob (gzip, zstd or plain tar) on top of ``root``.

    With ``diff_id`` the uncompressed tar stream must hash to it (config.md rootfs.diff_ids). What it unpacks
    is charged to ``budget`` (the image's; a fresh default one if None): past its cap it fails while reading.
    """
    budget = budget if budget is not None else UnpackBudget()
    created: set[tuple[str, ...]] = set()  # resolved paths this layer wrote; opaque dirs keep these
    tree = Tree(root, created)
    stats = LayerStats()
    hashed = HashingReader(io.BufferedReader(_Budgeted(_decompressor(stream), budget)))  # type: ignore[arg-type]
    dir_times: list[tuple[str, float]] = []
    try:
        tf = tarfile.open(fileobj=hashed, mode="r|")  # type: ignore[call-overload]
    except tarfile.ReadError as e:
        raise FormatError(f"layer is not a tar archive: {e}") from None
    with tf:
        try:
            for m in tf:
                budget.take_entry()
                if m.issparse():   # its holes come out as zeros the stream never carried: charge them too
                    budget.take_bytes(m.size)
                _apply_member(tree, tf, m, created, stats, dir_times)
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib_error()) as e:
            raise FormatError(f"layer archive is corrupt: {e}") from None
    hashed.drain()
    if diff_id is not None and hashed.digest != diff_id:
        raise DigestError(f"layer uncompressed content hashes to {hashed.digest}, config says {diff_id}")
    for path, mtime in reversed(dir_times):
        if os.path.isdir(path) and not os.path.islink(path):
            os.utime(path, (mtime, mtime), follow_symlinks=False)
    return stats


def zlib_error() -> type[Exception]:
    import zlib

    return zlib.error


def _apply_member(tree: Tree, tf: tarfile.TarFile, m: tarfile.TarInfo, created: set[tuple[str, ...]],
                  stats: LayerStats, dir_times: list[tuple[str, float]]) -> None:
    parts = clean_name(m.name)
    if not parts:
        return  # "./" itself: the root directory keeps root:root 0755
    name = parts[-1]
    if name.startswith(WHITEOUT_PREFIX):
        try:
            parent = tree.resolve(parts[:-1], follow_last=True, create=False, what=m.name) if parts[:-1] else ()
        except FileNotFoundError:
            return  # hides something no lower layer has
        stats.whiteouts += 1
        if name == OPAQUE:
            # layer.md "Opaque Whiteout": hide every lower-layer child of the directory.
            d = tree.real(parent)
            if os.path.isdir(d) and not os.path.islink(d):
                for child in os.listdir(d):
                    if (*parent, child) not in created:
                        _remove(os.path.join(d, child))
            return
        if name.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            return  # other AUFS metadata (.wh..wh.plnk etc.): not part of the image
        target = name[len(WHITEOUT_PREFIX):]
        if target in ("", ".", ".."):
            raise UnsafePathError(f"layer entry {m.name!r} is a whiteout of {target!r}")
        _remove(tree.real((*parent, target)))
        return
    try:
        rel = tree.resolve(parts, follow_last=False, create=True, what=m.name)
    except FileNotFoundError:
        raise FormatError(f"layer entry {m.name!r}: parent directory vanished") from None
    if not rel:
        return
    path = tree.real(rel)
    try:
        existing: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        existing = None
    if m.ischr() or m.isblk():
        stats.skipped_devices += 1
        return
    if m.isdir():
        if existing is not None and not stat.S_ISDIR(existing.st_mode):
            _remove(path)
            existing = None
        if existing is None:
            os.mkdir(path, 0o700)
        _set_meta(path, m, is_link=False)
        dir_times.append((path, m.mtime))
        created.add(rel)
        return
    if existing is not None:
        _remove(path)
    if m.isreg():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            src = tf.extractfile(m)
            if src is None:
                raise FormatError(f"layer entry {m.name!r}: no data")
            shutil.copyfileobj(src, out, 1 << 20)
        _set_meta(path, m, is_link=False)
        stats.files += 1
    elif m.issym():
        os.symlink(m.linkname, path)
        _set_meta(path, m, is_link=True)
    elif m.islnk():
        lparts = clean_name(m.linkname)
        if not lparts:
            raise UnsafePathError(f"layer entry {m.name!r}: hard link to the root")
        try:
            lrel = tree.resolve(lparts, follow_last=False, create=False, what=m.linkname)
        except FileNotFoundError:
            raise FormatError(f"layer entry {m.name!r}: hard link target {m.linkname!r} does not exist") from None
        src_path = tree.real(lrel)
        try:
            lst = os.lstat(src_path)
        except FileNotFoundError:
            raise FormatError(f"layer entry {m.name!r}: hard link target {m.linkname!r} does not exist") from None
        if stat.S_ISDIR(lst.st_mode):
            raise FormatError(f"layer entry {m.name!r}: hard link to a directory")
        os.link(src_path, path, follow_symlinks=False)
    elif m.isfifo():
        os.mkfifo(path, 0o600)
        _set_meta(path, m, is_link=False)
    else:
        raise FormatError(f"layer entry {m.name!r} has unsupported tar type {m.type!r}")
    created.add(rel)


def unpack_layers(root: Path, layers: Iterable[tuple[BinaryIO, str | None]]) -> list[LayerStats]:
    """Apply ``(stream, diff_id)`` layers in order (lowest first) into the existing directory ``root``."""
    budget = UnpackBudget()   # the image's, across its layers
    return [apply_layer(root, stream, diff_id=diff_id, budget=budget) for stream, diff_id in layers]
