"""Build the read-only root disk: debootstrap minbase bookworm + python3, then ``mkfs.ext4 -d``."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from smold.images import cache, proc
from smold.images.cache import content_key
from smold.images.errors import ImageBuildError

FILENAME = "rootfs.ext4"
SUITE = "bookworm"
MIRROR_ENV = "SMOL_DEBIAN_MIRROR"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# minbase already has coreutils, bash, dash, util-linux, findutils, grep, sed, tar, gzip.
# The rest are the common tools an agent's task expects (issue: "python3, git, common tools").
PACKAGES = ("python3", "bash", "coreutils", "procps", "iproute2", "ca-certificates", "git", "adduser", "curl",
            "xz-utils", "unzip", "patch", "less", "make")
BUILD_DEPS = ("debootstrap", "e2fsprogs")
SOURCE_DATE_EPOCH = 1704067200  # 2024-01-01T00:00:00Z
FS_UUID = "5a6f6c00-0000-4000-8000-000000000001"
HASH_SEED = "5a6f6c00-0000-4000-8000-000000000002"
LABEL = "smol-root"
FORMAT_VERSION = "1"
# Dropped after debootstrap (paths relative to the root, globbed); they only cost disk and boot I/O.
PRUNE = (
    "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb", "var/cache/apt/archives/partial/*",
    "var/lib/apt/lists/*_*", "var/log/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
    "var/cache/ldconfig/aux-cache", "etc/*-", "usr/share/man/*", "usr/share/info/*",
    "usr/share/lintian/*", "usr/share/locale/*", "debootstrap",
)
DPKG_NODOC = """\
# smol: keep the guest small if packages are installed later
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""


class RootfsBuildError(ImageBuildError):
    """debootstrap or mkfs.ext4 failed, or the tree lacks what the init needs."""


@dataclass(frozen=True)
class RootfsInputs:
    """Everything that determines the root filesystem (the mirror's contents aside)."""

    suite: str = SUITE
    mirror: str = DEFAULT_MIRROR
    packages: tuple[str, ...] = PACKAGES
    versions: Mapping[str, str] = field(default_factory=dict)
    source_date_epoch: int = SOURCE_DATE_EPOCH

    def key_parts(self) -> dict[str, bytes | str]:
        return {
            "format": FORMAT_VERSION,
            "suite": self.suite,
            "mirror": self.mirror,
            "packages": ",".join(sorted(self.packages)),
            "versions": repr(sorted(self.versions.items())),
            "epoch": str(self.source_date_epoch),
            "script:rootfs.py": Path(__file__).read_bytes(),
        }

    def key(self) -> str:
        return content_key(self.key_parts())

    def manifest(self) -> dict[str, str]:
        return {"suite": self.suite, "mirror": self.mirror, "packages": ",".join(self.packages),
                **{f"pkg:{k}": v for k, v in self.versions.items()}}


def default_inputs() -> RootfsInputs:
    mirror = os.environ.get(MIRROR_ENV, DEFAULT_MIRROR)
    return RootfsInputs(mirror=mirror, versions=proc.package_versions(BUILD_DEPS))


def _prune(root: Path) -> None:
    for pattern in PRUNE:
        for p in root.glob(pattern):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    doc = root / "usr/share/doc"
    if doc.is_dir():
        for p in doc.rglob("*"):
            if not p.is_dir() and p.name != "copyright":
                p.unlink()


def _configure(root: Path) -> None:
    (root / "etc/hostname").write_text("smol\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tsmol\n")
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("")
    (root / "etc/machine-id").write_text("")
    (root / "etc/dpkg/dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/dpkg/dpkg.cfg.d/01-smol-nodoc").write_text(DPKG_NODOC)
    for needed in ("usr/bin/python3", "bin/sh", "dev", "proc", "sys", "run", "tmp"):
        if not os.path.lexists(root / needed):
            raise RootfsBuildError(f"debootstrapped tree lacks /{needed}")


def clamp_mtimes(root: Path, epoch: int) -> None:
    """Set every mtime/atime newer than ``epoch`` to ``epoch`` (SOURCE_DATE_EPOCH convention)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if st.st_mtime > epoch or st.st_atime > epoch:
                os.utime(p, (epoch, min(st.st_mtime, epoch)), follow_symlinks=False)
    os.utime(root, (epoch, epoch))


def tree_size(root: Path) -> tuple[int, int]:
    """(bytes rounded up to 4 KiB blocks, number of inodes) below ``root``."""
    total, count = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            total += -(-st.st_size // 4096) * 4096
            count += 1
    return total, count


def image_size(data_bytes: int, inodes: int) -> int:
    """Image size with ~25% + 64 MiB headroom (metadata, inode tables), a multiple of 16 MiB."""
    mib = 1 << 20
    want = int(data_bytes * 1.25) + inodes * 256 + 64 * mib
    return -(-want // (16 * mib)) * (16 * mib)


def mkfs(tree: Path, image: Path, epoch: int, log: Path) -> None:
    data, inodes = tree_size(tree)
    size = image_size(data, inodes)
    with open(image, "wb") as fh:
        fh.truncate(size)
    env = {"E2FSPROGS_FAKE_TIME": str(epoch), "SOURCE_DATE_EPOCH": str(epoch), "LC_ALL": "C"}
    proc.run([
        "mkfs.ext4", "-F", "-q", "-L", LABEL, "-U", FS_UUID, "-b", "4096", "-I", "256",
        "-N", str(inodes * 2 + 4096), "-m", "0",
        # Read-only lower layer: no journal to replay, no lazy init threads in the guest.
        "-O", "^has_journal",
        "-E", f"hash_seed={HASH_SEED},root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0",
        "-d", str(tree), str(image),
    ], env=env, log=log)
    proc.run(["e2fsck", "-f", "-n", str(image)], env=env, log=log)


def build_rootfs(inputs: RootfsInputs, out_dir: Path, work_dir: Path, log: Path) -> None:
    """Cache builder: write ``out_dir/rootfs.ext4``."""
    if os.geteuid() != 0:
        raise RootfsBuildError("debootstrap needs root (run the build as root, e.g. in CI)")
    proc.ensure_packages(BUILD_DEPS, log=log)
    tree = work_dir / "root"
    t0 = time.monotonic()
    print(f"[smol.images] rootfs: debootstrap {inputs.suite} (log: {log})", file=sys.stderr, flush=True)
    env = {"SOURCE_DATE_EPOCH": str(inputs.source_date_epoch), "DEBIAN_FRONTEND": "noninteractive",
           "LC_ALL": "C"}
    proc.run(["debootstrap", "--variant=minbase", f"--include={','.join(inputs.packages)}",
              "--components=main", inputs.suite, str(tree), inputs.mirror], env=env, log=log)
    _prune(tree)
    _configure(tree)
    clamp_mtimes(tree, inputs.source_date_epoch)
    mkfs(tree, out_dir / FILENAME, inputs.source_date_epoch, log)
    print(f"[smol.images] rootfs: built in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)


def publish(c: cache.ArtifactCache, inputs: RootfsInputs, *, force: bool = False) -> Path:
    return c.publish("rootfs", inputs.key(), FILENAME,
                     lambda out, work, log: build_rootfs(inputs, out, work, log),
                     manifest=inputs.manifest(), force=force)
