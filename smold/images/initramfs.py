"""Build the uncompressed newc initramfs: static busybox, /init, and the guest agent package."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from smold.images import cache, cpio, proc
from smold.images.cache import content_key, iter_tree, tree_digest
from smold.images.cpio import Archive
from smold.images.errors import ImageBuildError
from smold.images.paths import GUEST_AGENT_DIR

FILENAME = "initramfs.cpio"
INIT_DIR = GUEST_AGENT_DIR / "init"
AGENT_DIR = GUEST_AGENT_DIR / "smol_agent"
BUSYBOX = Path("/bin/busybox")
PACKAGES = ("busybox-static",)
AGENT_DEST = "smol/smol_agent"
# Fixed archive mtime: 2024-01-01T00:00:00Z (also the default SOURCE_DATE_EPOCH of the rootfs).
MTIME = 1704067200
FORMAT_VERSION = "1"


class InitramfsError(ImageBuildError):
    """The initramfs inputs are unusable (missing init, dynamic busybox, ...)."""


@dataclass(frozen=True)
class InitramfsInputs:
    """Everything that determines the initramfs bytes."""

    init_dir: Path
    agent_dir: Path
    busybox: Path
    versions: Mapping[str, str] = field(default_factory=dict)

    def key_parts(self) -> dict[str, bytes | str]:
        return {
            "format": FORMAT_VERSION,
            "init": tree_digest(self.init_dir),
            "agent": tree_digest(self.agent_dir),
            "busybox": _file_digest(self.busybox),
            "versions": repr(sorted(self.versions.items())),
            "script:initramfs.py": Path(__file__).read_bytes(),
            "script:cpio.py": Path(cpio.__file__).read_bytes(),
        }

    def key(self) -> str:
        return content_key(self.key_parts())

    def manifest(self) -> dict[str, str]:
        return {"init_dir": str(self.init_dir), "agent_dir": str(self.agent_dir), "busybox": str(self.busybox),
                **{f"pkg:{k}": v for k, v in self.versions.items()}}


def _file_digest(path: Path) -> str:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "absent"


def default_inputs(agent_dir: Path | None = None) -> InitramfsInputs:
    return InitramfsInputs(INIT_DIR, agent_dir or AGENT_DIR, BUSYBOX, proc.package_versions(PACKAGES))


def _require_static_elf(path: Path) -> None:
    """Reject a dynamically linked busybox: the initramfs has no libc."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InitramfsError(f"cannot read busybox {path}: {exc} (apt-get install busybox-static)") from exc
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise InitramfsError(f"{path} is not a 64-bit ELF executable")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, = struct.unpack_from("<I", data, phoff + i * phentsize)
        if p_type == 3:  # PT_INTERP
            raise InitramfsError(f"{path} is dynamically linked; install busybox-static")


def busybox_applets(busybox: Path) -> list[str]:
    out = proc.run([busybox, "--list"])
    applets = sorted({a.strip() for a in out.splitlines() if a.strip() and "/" not in a})
    for needed in ("sh", "mount", "switch_root", "cp", "reboot"):
        if needed not in applets:
            raise InitramfsError(f"{busybox} lacks the {needed!r} applet")
    return applets


def _add_tree(archive: Archive, src: Path, dest: str) -> None:
    archive.add_dirs(dest)
    for path in iter_tree(src):
        rel = f"{dest}/{path.relative_to(src).as_posix()}"
        if path.is_symlink():
            archive.add_symlink(rel, os.readlink(path))
        elif path.is_dir():
            archive.add_dir(rel)
        else:
            archive.add_file(rel, path.read_bytes(), 0o755 if os.access(path, os.X_OK) else 0o644)


def make_archive(inputs: InitramfsInputs) -> Archive:
    """Assemble the archive in memory (pure apart from reading the inputs and ``busybox --list``)."""
    init = inputs.init_dir / "init"
    helper = inputs.init_dir / "poweroff"
    for f in (init, helper):
        if not f.is_file():
            raise InitramfsError(f"missing initramfs input {f}")
    if not (inputs.agent_dir / "__init__.py").is_file():
        raise InitramfsError(f"{inputs.agent_dir} is not a Python package (no __init__.py)")
    _require_static_elf(inputs.busybox)

    a = Archive(mtime=MTIME)
    for d in ("bin", "dev", "proc", "sys", "lower", "rw", "newroot", "smol"):
        a.add_dir(d)
    # The kernel opens /dev/console for init's stdio before anything is mounted.
    a.add_chardev("dev/console", 5, 1, 0o600)
    a.add_file("bin/busybox", inputs.busybox.read_bytes(), 0o755)
    for applet in busybox_applets(inputs.busybox):
        if applet != "busybox":
            a.add_symlink(f"bin/{applet}", "busybox")
    a.add_file("init", init.read_bytes(), 0o755)
    a.add_file("smol/poweroff", helper.read_bytes(), 0o755)
    _add_tree(a, inputs.agent_dir, AGENT_DEST)
    return a


def build_initramfs(inputs: InitramfsInputs, out_dir: Path, work_dir: Path, log: Path) -> None:
    """Cache builder: write ``out_dir/initramfs.cpio``."""
    archive = make_archive(inputs)
    with open(out_dir / FILENAME, "wb") as fh:
        archive.write(fh)


def publish(c: cache.ArtifactCache, inputs: InitramfsInputs, *, force: bool = False) -> Path:
    return c.publish("initramfs", inputs.key(), FILENAME,
                     lambda out, work, log: build_initramfs(inputs, out, work, log),
                     manifest=inputs.manifest(), force=force)
