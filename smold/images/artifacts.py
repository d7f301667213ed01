"""Python API for the three guest artifacts (vmlinux, initramfs, rootfs) from the content-hash cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smold.images import initramfs, kernel, proc, rootfs
from smold.images.cache import ArtifactCache, default_cache_root
from smold.images.errors import ImageBuildError

KINDS = ("kernel", "initramfs", "rootfs")


class ArtifactMissingError(ImageBuildError):
    """An artifact is not in the cache and building was not allowed."""


@dataclass(frozen=True)
class Artifacts:
    """Paths the VMM boots: ELF vmlinux, newc initramfs, read-only ext4 root disk (/dev/vda)."""

    kernel: Path
    initramfs: Path
    rootfs: Path


@dataclass(frozen=True)
class _Kind:
    filename: str
    deps: tuple[str, ...]
    inputs: Callable[[], Any]
    publish: Callable[..., Path]


_KINDS: dict[str, _Kind] = {
    "kernel": _Kind(kernel.FILENAME, kernel.BUILD_DEPS, kernel.default_inputs, kernel.publish),
    "initramfs": _Kind(initramfs.FILENAME, initramfs.PACKAGES, initramfs.default_inputs, initramfs.publish),
    "rootfs": _Kind(rootfs.FILENAME, rootfs.BUILD_DEPS, rootfs.default_inputs, rootfs.publish),
}


def resolve(kind: str, *, cache_dir: Path | None = None, build: bool = True, force: bool = False) -> Path:
    """Path of one artifact (``kernel``, ``initramfs`` or ``rootfs``), building it if allowed."""
    try:
        k = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown artifact kind {kind!r}; expected one of {KINDS}") from None
    c = ArtifactCache(cache_dir or default_cache_root())
    if not force and (hit := c.lookup(kind, k.inputs().key(), k.filename)) is not None:
        return hit
    if not build:
        raise ArtifactMissingError(f"{kind} is not in the cache under {c.root}; "
                                   "build it with: python -m smold.images.build_base")
    # Install build tools first: their versions are part of the key, so compute it afterwards.
    proc.ensure_packages(k.deps)
    return k.publish(c, k.inputs(), force=force)


def default_artifacts(build: bool = True, *, cache_dir: Path | None = None, force: bool = False) -> Artifacts:
    """The default guest artifacts; with ``build=False`` raise ArtifactMissingError on a cold cache."""
    return Artifacts(
        kernel=resolve("kernel", cache_dir=cache_dir, build=build, force=force),
        initramfs=resolve("initramfs", cache_dir=cache_dir, build=build, force=force),
        rootfs=resolve("rootfs", cache_dir=cache_dir, build=build, force=force),
    )
