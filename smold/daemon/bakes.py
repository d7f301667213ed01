"""Pre-baked images: snapshots of a freshly created machine, keyed by image + the Smolfile's boot state.

A bake is a snapshot directory ``STATE_DIR/bakes/<hex>/`` (``snapshot.state``, ``memory.raw``, docs/snapshot.md)
plus ``bake.json`` describing it. ``<hex>`` is the key: ``boot_state_digest`` (smold/smolfile/digest.py) of the
Smolfile's image, cpus, memory, network, mounts, env and setup, together with the image's content digest and
a digest of the mount sources' contents. Two Smolfiles that differ only in timeouts, task or verifier share a
bake; any change to what the machine holds once created gives another key. docs/daemon.md, "Pre-baked images".

A base bake is the bake of ``base_smolfile``: the machine as booted, before mounts, env and setup. A create
with no bake of its own restores its base bake and then copies its mounts and runs its setup; a create that
had to boot bakes itself as that base first (``--no-auto-bake`` turns that off). Several daemons on one host
may share a store (``--bakes-dir``): temporary directories carry the writer's pid, and a bake already in
place when an automatic one finishes is kept.

bake.json carries a MAC (HMAC-SHA256, smold/authrecord.py) under the store's key (``--bakes-key``; by default
the daemon's own key for its own store, ``.bake.key`` in a shared one) over its fields, the bake's key and the
sha256 of the state file: a bake that another writer of a shared store put there without the key is refused.
Before a bake is restored it is checked (``BakeStore.verify``): bake.json is authenticated and names the same
key, the state file is the one it authenticates
passes its checks (magic, version, sha256), the snapshot is of the Smolfile's size and the image's root disk,
and the memory file matches the sha256 recorded in the state when it was baked. Hashing the memory file
reads all of it, so that check runs once per file identity (device, inode, size, mtime, ctime) and is
remembered. A refused bake raises BakeCorruptError and is never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from smold.authrecord import RecordAuthError, RecordKey
from smold.smolfile import Smolfile, boot_state_digest, boot_state_mapping, digest
from smold.snapshot.errors import SnapshotError
from smold.snapshot.state import VmSnapshot
from smold.snapshot.store import MEMORY_FILE, STATE_FILE, memory_path, read_snapshot, verify_memory

from .errors import DaemonError, InvalidRequestError, Status
from .images import Image

BAKE_META = "bake.json"
TEMP_PREFIX = ".tmp-"   # + "<pid>-...": half-written or half-deleted; removed once that process is gone
BAKE_META_VERSION = 1
KEY_RE = re.compile(r"(?:sha256:)?([0-9a-f]{6,64})")
_HASH_CHUNK = 1 << 20
STATE_DIGEST = "state_sha256"   # bake.json: the sha256 of snapshot.state, under the MAC


class BakeError(DaemonError):
    """Base class of bake store errors."""


class BakeNotFoundError(BakeError):
    """No bake has that key."""

    status = Status.NOT_FOUND


class BakeExistsError(BakeError):
    """A bake with that key exists (and replacing it was not asked for) or is being baked."""

    status = Status.ALREADY_EXISTS


class BakeBusyError(BakeError):
    """The bake is being written or restored from right now."""

    status = Status.FAILED_PRECONDITION


class BakeCorruptError(BakeError):
    """The bake failed its checks (corrupted, truncated, tampered with, or stale): it is not used."""

    status = Status.FAILED_PRECONDITION


def mounts_digest(smolfile: Smolfile) -> str:
    """"sha256:<hex>" over the contents of every mount source, in Smolfile order: each file's path relative
    to the mount, type, permission bits and bytes (a symlink: its target). Modification times are not
    included. The sources must exist (check_mount_sources ran)."""
    h = hashlib.sha256()
    for mount in smolfile.mounts:
        src = smolfile.host_path(mount)
        h.update(b"M\0" + mount.guest.encode() + b"\0")
        _hash_tree(h, src, "")
    return "sha256:" + h.hexdigest()


def _hash_tree(h: Any, path: Path, rel: str) -> None:
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        h.update(f"L\0{rel}\0{mode:o}\0".encode() + os.fsencode(os.readlink(path)) + b"\0")
    elif stat.S_ISDIR(st.st_mode):
        h.update(f"D\0{rel}\0{mode:o}\0".encode())
        for name in sorted(os.listdir(path)):
            _hash_tree(h, path / name, f"{rel}/{name}")
    elif stat.S_ISREG(st.st_mode):
        h.update(f"F\0{rel}\0{mode:o}\0{st.st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    else:  # sockets, fifos, devices: not copied into the guest either; their presence still counts
        h.update(f"O\0{rel}\0{stat.S_IFMT(st.st_mode):o}\0".encode())


def base_smolfile(smolfile: Smolfile) -> Smolfile:
    """The Smolfile's machine as it is once booted: the same image, size and network, without mounts, env,
    setup, task or checks. Equal to ``smolfile`` when it has none of those."""
    return dataclasses.replace(smolfile, mounts=(), env=(), setup=(), task=None, checks=())


def bake_key(smolfile: Smolfile, image_digest: str, mounts: str) -> str:
    """The bake key of a Smolfile booted from an image with that digest and mounts with that content digest."""
    return boot_state_digest(smolfile, image_digest, mounts)


def key_hex(key: str) -> str:
    return key.removeprefix("sha256:")


@dataclass(frozen=True)
class BakeMeta:
    """bake.json: what was baked, from what, and how long it took."""

    key: str
    image: str
    image_digest: str
    mounts_digest: str
    smolfile_digest: str          # of the Smolfile it was baked from
    boot_state: dict[str, Any]    # boot_state_mapping() of that Smolfile
    cpus: int
    memory_mib: int
    created_at: str               # ISO 8601, UTC
    bake_seconds: float           # create (boot, mounts, setup) + snapshot
    version: int = BAKE_META_VERSION

    @classmethod
    def for_smolfile(cls, key: str, smolfile: Smolfile, image: Image, mounts: str, seconds: float) -> BakeMeta:
        return cls(key=key, image=image.name, image_digest=image.digest, mounts_digest=mounts,
                   smolfile_digest=digest(smolfile), boot_state=boot_state_mapping(smolfile), cpus=smolfile.cpus,
                   memory_mib=smolfile.memory_mib, created_at=datetime.now(UTC).isoformat(),
                   bake_seconds=round(seconds, 3))

    def write(self, directory: Path, key: RecordKey) -> None:
        """bake.json into ``directory`` (the bake's final name is its key's hex) with the store key's MAC over
        this description and the sha256 of the snapshot's state file, which records the memory file's."""
        data = {**self.__dict__, STATE_DIGEST: _file_sha256(directory / STATE_FILE)}
        key.write(directory / BAKE_META, data, f"{BAKE_META} {key_hex(self.key)}", indent=1)

    @classmethod
    def load(cls, directory: Path, key: RecordKey) -> BakeMeta:
        """BakeCorruptError if bake.json is missing, unreadable, not of this version, not authenticated by the
        store's key for this bake, or if the state file is not the one it authenticates."""
        path = directory / BAKE_META
        try:
            data: Any = key.read(path, f"{BAKE_META} {directory.name}")
        except RecordAuthError as e:
            raise BakeCorruptError(f"bake {directory.name[:12]}: {e}") from None
        state_digest = data.pop(STATE_DIGEST, None)
        if not isinstance(data, dict) or data.get("version") != BAKE_META_VERSION:
            raise BakeCorruptError(f"bake {directory.name[:12]}: {path} is not a version {BAKE_META_VERSION} "
                                   "bake description")
        try:
            meta = cls(**data)
        except TypeError as e:
            raise BakeCorruptError(f"bake {directory.name[:12]}: {path}: {e}") from None
        for name in ("key", "image", "image_digest", "created_at"):
            if not isinstance(getattr(meta, name), str):
                raise BakeCorruptError(f"bake {directory.name[:12]}: {path}: {name} is not a string")
        try:
            actual = _file_sha256(directory / STATE_FILE)
        except OSError as e:
            raise BakeCorruptError(f"bake {directory.name[:12]}: {STATE_FILE}: {e.strerror or e}") from None
        if state_digest != actual:
            raise BakeCorruptError(f"bake {directory.name[:12]}: its {STATE_FILE} is not the one bake.json "
                                   f"authenticates (sha256 {actual[:16]}, not {str(state_digest)[:16]})")
        return meta

    @property
    def created(self) -> datetime:
        try:
            t = datetime.fromisoformat(self.created_at)
        except ValueError:
            return datetime.fromtimestamp(0, UTC)
        return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _identity(path: Path) -> tuple[int, int, int, int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class BakeStore:
    """The bakes under one directory. Blocking methods: call them through asyncio.to_thread. ``key``
    authenticates them (DaemonConfig.bakes_key_file; the controller sets it at start)."""

    def __init__(self, directory: Path, key: RecordKey | None = None) -> None:
        self.directory = directory
        self.key = key or RecordKey.generate()
        self._verified: dict[str, tuple[tuple[int, ...], str]] = {}  # hex -> (file identities, error or "")

    def path(self, key: str) -> Path:
        return self.directory / key_hex(key)

    def keys(self) -> list[str]:
        """Complete bakes (a bake.json beside a state file), sorted; half-written ``.tmp-*`` ones are not."""
        if not self.directory.is_dir():
            return []
        out = []
        for d in sorted(self.directory.iterdir()):
            if d.name.startswith(".") or not d.is_dir() or d.is_symlink():
                continue
            if (d / BAKE_META).is_file() or (d / STATE_FILE).is_file():
                out.append(f"sha256:{d.name}")
        return out

    def resolve(self, ref: str) -> str:
        """A full key from "sha256:<hex>", "<hex>" or a unique prefix of at least 6 hex digits."""
        m = KEY_RE.fullmatch(ref.strip())
        if m is None:
            raise InvalidRequestError(f"key: {ref!r} is not a bake key (sha256:<hex>, or at least 6 of its "
                                      "leading hex digits)")
        prefix = m.group(1)
        found = [k for k in self.keys() if key_hex(k).startswith(prefix)]
        if not found:
            raise BakeNotFoundError(f"no bake {ref!r}")
        if len(found) > 1:
            raise InvalidRequestError(f"key: {ref!r} matches {len(found)} bakes; give more digits")
        return found[0]

    def size_bytes(self, key: str) -> int:
        d = self.path(key)
        total = 0
        for p in d.iterdir():
            try:
                st = p.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
        return total

    def verify(self, key: str, *, smolfile: Smolfile | None = None, image: Image | None = None,
               hash_memory: bool = True) -> VmSnapshot:
        """Check the bake before it is restored (module docstring); BakeCorruptError naming the defect.

        With ``smolfile`` and ``image``, also that the snapshot is of that size and root disk. Without
        ``hash_memory`` the memory file is only judged by an earlier hash of the same file (listing)."""
        hexkey = key_hex(key)
        directory = self.path(key)
        if not directory.is_dir():
            raise BakeNotFoundError(f"no bake {key}")
        short = hexkey[:12]
        meta = BakeMeta.load(directory, self.key)
        if key_hex(meta.key) != hexkey:
            raise BakeCorruptError(f"bake {short}: bake.json names key {meta.key}, not {key}")
        try:
            snap = read_snapshot(directory)
        except SnapshotError as e:
            raise BakeCorruptError(f"bake {short}: {e}") from None
        if (snap.spec.cpus, snap.spec.memory_mib) != (meta.cpus, meta.memory_mib):
            raise BakeCorruptError(f"bake {short}: its snapshot is of a {snap.spec.cpus}-vCPU "
                                   f"{snap.spec.memory_mib} MiB machine, bake.json says {meta.cpus} vCPUs and "
                                   f"{meta.memory_mib} MiB")
        if smolfile is not None and (snap.spec.cpus, snap.spec.memory_mib) != (smolfile.cpus, smolfile.memory_mib):
            raise BakeCorruptError(f"bake {short}: its snapshot is of a {snap.spec.cpus}-vCPU "
                                   f"{snap.spec.memory_mib} MiB machine, the Smolfile asks for {smolfile.cpus} "
                                   f"vCPUs and {smolfile.memory_mib} MiB")
        if image is not None and snap.spec.rootfs is not None:
            want = str(Path(image.rootfs).resolve())
            if snap.spec.rootfs.path != want:
                raise BakeCorruptError(f"bake {short}: it was made with root disk {snap.spec.rootfs.path}, the "
                                       f"image's is {want}")
        if snap.memory.sha256 is None:
            raise BakeCorruptError(f"bake {short}: its snapshot recorded no memory digest")
        try:
            ident = (*_identity(directory / STATE_FILE), *_identity(memory_path(directory, snap)))
        except OSError as e:
            raise BakeCorruptError(f"bake {short}: {e}") from None
        cached = self._verified.get(hexkey)
        if cached is not None and cached[0] == ident:
            if cached[1]:
                raise BakeCorruptError(cached[1])
            return snap
        if not hash_memory:
            return snap
        try:
            verify_memory(directory, snap)
        except (SnapshotError, OSError) as e:
            error = f"bake {short}: {MEMORY_FILE}: {e}"
            self._verified[hexkey] = (ident, error)
            raise BakeCorruptError(error) from None
        self._verified[hexkey] = (ident, "")
        return snap

    def forget(self, key: str) -> None:
        self._verified.pop(key_hex(key), None)

    def temp_path(self) -> Path:
        """A fresh name for a bake being written (or deleted): never listed, removed by ``clean`` once the
        process that chose it is gone."""
        return self.directory / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"

    def remove(self, key: str) -> None:
        """Rename the bake aside (a temp_path: never seen as a bake again), then delete it."""
        directory = self.path(key)
        aside = self.temp_path()
        try:
            os.rename(directory, aside)
        except FileNotFoundError:
            raise BakeNotFoundError(f"no bake {key}") from None
        self.forget(key)
        shutil.rmtree(aside, ignore_errors=True)

    def clean(self) -> None:
        """Remove half-written or half-deleted bakes (``.tmp-*``) left by a daemon that is gone; those of a live
        process (another daemon sharing the store) are left alone."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in self.directory.iterdir():
            if d.name.startswith(TEMP_PREFIX) and not _pid_alive(d.name[len(TEMP_PREFIX):].partition("-")[0]):
                shutil.rmtree(d, ignore_errors=True)


def _pid_alive(text: str) -> bool:
    """Whether ``text`` is the pid of a live process other than this one."""
    if not text.isdigit() or int(text) == os.getpid():
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
