"""Build the guest vmlinux from Debian's linux-source-6.1: tinyconfig + microvm.config, verified."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from smold.images import cache, kconfig, proc
from smold.images.cache import content_key
from smold.images.errors import ImageBuildError
from smold.images.paths import GUEST_AGENT_DIR

FILENAME = "vmlinux"
FRAGMENT = GUEST_AGENT_DIR / "kernel" / "microvm.config"
PATCH_DIR = GUEST_AGENT_DIR / "kernel" / "patches"   # *.patch, applied in name order with patch -p1
SOURCE_PACKAGE = "linux-source-6.1"
TARBALL = Path("/usr/src/linux-source-6.1.tar.xz")
BUILD_DEPS = ("build-essential", "bc", "bison", "flex", "libelf-dev", "libssl-dev", "cpio", "xz-utils", "patch",
              SOURCE_PACKAGE)
# Packages whose versions change the output bytes (part of the cache key).
KEY_PACKAGES = (SOURCE_PACKAGE, "gcc-12", "binutils", "libc6-dev")
ARCH = "x86_64"
FORMAT_VERSION = "1"
BUILD_ENV = {
    "ARCH": ARCH,
    "KBUILD_BUILD_USER": "smol",
    "KBUILD_BUILD_HOST": "smol",
    "KBUILD_BUILD_TIMESTAMP": "2024-01-01",
    "SOURCE_DATE_EPOCH": "1704067200",
    "LC_ALL": "C",
}


class KernelBuildError(ImageBuildError):
    """The kernel source is missing or the build did not produce a usable vmlinux."""


@dataclass(frozen=True)
class KernelInputs:
    """Everything that determines the vmlinux bytes."""

    fragment: Path
    tarball: Path
    versions: Mapping[str, str] = field(default_factory=dict)
    patch_dir: Path | None = None

    def patches(self) -> list[Path]:
        if self.patch_dir is None or not self.patch_dir.is_dir():
            return []
        return sorted(self.patch_dir.glob("*.patch"))

    def key_parts(self) -> dict[str, bytes | str]:
        try:
            frag = self.fragment.read_bytes()
        except OSError as exc:
            raise KernelBuildError(f"cannot read kernel config fragment {self.fragment}: {exc}") from exc
        try:
            size = str(self.tarball.stat().st_size)
        except OSError:
            size = "absent"
        return {
            "format": FORMAT_VERSION,
            "fragment": frag,
            "tarball": f"{self.tarball.name}:{size}",
            "versions": repr(sorted(self.versions.items())),
            "env": repr(sorted(BUILD_ENV.items())),
            "script:kernel.py": Path(__file__).read_bytes(),
            "script:kconfig.py": Path(kconfig.__file__).read_bytes(),
            **{f"patch:{p.name}": p.read_bytes() for p in self.patches()},
        }

    def key(self) -> str:
        return content_key(self.key_parts())

    def manifest(self) -> dict[str, str]:
        return {"fragment": str(self.fragment), "tarball": str(self.tarball),
                **{f"pkg:{k}": v for k, v in self.versions.items()}}


def default_inputs() -> KernelInputs:
    return KernelInputs(FRAGMENT, TARBALL, proc.package_versions(KEY_PACKAGES), PATCH_DIR)


def configure(src: Path, fragment: Path, log: Path) -> None:
    """tinyconfig, merge the fragment, olddefconfig, then verify every requested option."""
    requested = kconfig.load_fragment(fragment)
    env = BUILD_ENV
    proc.run(["make", "-C", src, "tinyconfig"], env=env, log=log)
    proc.run([src / "scripts/kconfig/merge_config.sh", "-m", "-O", src, src / ".config", fragment],
             cwd=src, env=env, log=log)
    proc.run(["make", "-C", src, "olddefconfig"], env=env, log=log)
    kconfig.verify_config(requested, (src / ".config").read_text())


def build_kernel(inputs: KernelInputs, out_dir: Path, work_dir: Path, log: Path, *,
                 jobs: int | None = None) -> None:
    """Cache builder: write ``out_dir/vmlinux`` and ``out_dir/kernel.config``."""
    proc.ensure_packages(BUILD_DEPS, log=log)
    if not inputs.tarball.is_file():
        raise KernelBuildError(f"kernel source {inputs.tarball} missing (apt-get install {SOURCE_PACKAGE})")
    t0 = time.monotonic()
    _progress(f"kernel: extracting {inputs.tarball} (log: {log})")
    proc.run(["tar", "-xf", inputs.tarball, "-C", work_dir], log=log)
    srcs = [p for p in work_dir.iterdir() if p.is_dir() and (p / "Makefile").is_file()]
    if len(srcs) != 1:
        raise KernelBuildError(f"{inputs.tarball} did not unpack to one source tree: {srcs}")
    src = srcs[0]
    for patch in inputs.patches():
        _progress(f"kernel: applying {patch.name}")
        proc.run(["patch", "-p1", "--forward", "--batch", "-i", patch], cwd=src, log=log)
    configure(src, inputs.fragment, log)
    jobs = jobs or os.cpu_count() or 1
    _progress(f"kernel: make -j{jobs} vmlinux (several minutes)")
    proc.run(["make", "-C", src, f"-j{jobs}", "vmlinux"], env=BUILD_ENV, log=log)
    vmlinux = src / "vmlinux"
    if vmlinux.read_bytes()[:4] != b"\x7fELF":
        raise KernelBuildError(f"{vmlinux} is not an ELF file")
    # Drop the symbol table: boots the same (the VMM loads PT_LOAD segments and the PVH note stays),
    # but the file the VMM reads on every boot shrinks.
    proc.run(["objcopy", "--strip-all", vmlinux, out_dir / FILENAME], log=log)
    shutil.copyfile(src / ".config", out_dir / "kernel.config")
    (out_dir / "build-seconds").write_text(f"{time.monotonic() - t0:.0f}\n")
    _progress(f"kernel: built in {time.monotonic() - t0:.0f}s")


def _progress(msg: str) -> None:
    print(f"[smol.images] {msg}", file=sys.stderr, flush=True)


def publish(c: cache.ArtifactCache, inputs: KernelInputs, *, force: bool = False) -> Path:
    return c.publish("kernel", inputs.key(), FILENAME,
                     lambda out, work, log: build_kernel(inputs, out, work, log),
                     manifest=inputs.manifest(), force=force)
