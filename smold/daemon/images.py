"""Guest images by name: "default" is the built default guest, resolved lazily; digests are cached by file identity."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ImageNotFoundError

DEFAULT_IMAGE = "default"


@dataclass(frozen=True)
class Image:
    """The three artifacts a VM boots, and a digest over their contents."""

    name: str
    kernel: Path
    initramfs: Path
    rootfs: Path
    digest: str = ""  # "sha256:<hex>", over the three files' SHA-256 digests


def _default_artifacts() -> tuple[Path, Path, Path]:
    from smold.images.artifacts import default_artifacts
    from smold.images.errors import ImageBuildError

    try:
        a = default_artifacts(build=False)
    except ImageBuildError as e:
        raise ImageNotFoundError(f"image 'default' is not built on this host: {e}") from None
    return a.kernel, a.initramfs, a.rootfs


def parse_image_option(text: str) -> tuple[str, tuple[Path, Path, Path]]:
    """``NAME=KERNEL:INITRAMFS:ROOTFS`` (smold --image) -> (name, paths); ValueError if malformed."""
    name, sep, rest = text.partition("=")
    parts = rest.split(":")
    if not sep or not name or len(parts) != 3 or not all(parts):
        raise ValueError(f"--image wants NAME=KERNEL:INITRAMFS:ROOTFS (got {text!r})")
    paths = tuple(Path(p).absolute() for p in parts)
    return name, (paths[0], paths[1], paths[2])


def _fixed(paths: tuple[Path, Path, Path]) -> tuple[Path, Path, Path]:
    return paths


class ImageStore:
    """Resolves image names at create time (a kernel rebuild may replace the cache's entries meanwhile)."""

    def __init__(self, sources: dict[str, Callable[[], tuple[Path, Path, Path]]] | None = None) -> None:
        self._sources = sources if sources is not None else {DEFAULT_IMAGE: _default_artifacts}
        self._file_digests: dict[tuple[str, int, int, int], str] = {}

    @classmethod
    def with_files(cls, images: dict[str, tuple[Path, Path, Path]]) -> ImageStore:
        """The default image plus (or overridden by) images given as files."""
        sources: dict[str, Callable[[], tuple[Path, Path, Path]]] = {DEFAULT_IMAGE: _default_artifacts}
        for name, paths in images.items():
            sources[name] = functools.partial(_fixed, paths)
        return cls(sources)

    @property
    def names(self) -> list[str]:
        return sorted(self._sources)

    async def resolve(self, name: str) -> Image:
        """The image's files and digest; ImageNotFoundError for an unknown or unbuilt image."""
        source = self._sources.get(name)
        if source is None:
            raise ImageNotFoundError(f"unknown image '{name}' (this daemon has: {', '.join(self.names)})")
        kernel, initramfs, rootfs = await asyncio.to_thread(source)
        digests = {}
        for kind, path in (("kernel", kernel), ("initramfs", initramfs), ("rootfs", rootfs)):
            try:
                digests[kind] = await asyncio.to_thread(self._file_digest, path)
            except OSError as e:
                raise ImageNotFoundError(f"image '{name}': cannot read its {kind} {path}: {e.strerror}") from None
        whole = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
        return Image(name, kernel, initramfs, rootfs, f"sha256:{whole}")

    def _file_digest(self, path: Path) -> str:
        st = os.stat(path)
        key = (os.fspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._file_digests.get(key)
        if cached is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            cached = self._file_digests[key] = h.hexdigest()
        return cached
