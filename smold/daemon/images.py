"""Guest images by name: "default", --image files, or an OCI image (registry ref, local layout/archive) from the cache."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ImageNotFoundError, ImagePullError, InvalidRequestError

DEFAULT_IMAGE = "default"


@dataclass(frozen=True)
class Image:
    """The three artifacts a VM boots, and a digest over their contents."""

    name: str
    kernel: Path
    initramfs: Path
    rootfs: Path
    digest: str = ""  # "sha256:<hex>", over the three files' SHA-256 digests
    # Exec defaults from an OCI image's config (Env, WorkingDir, User); empty for the default image.
    env: tuple[tuple[str, str], ...] = ()
    working_dir: str = ""
    user: str = ""


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

    def __init__(self, sources: dict[str, Callable[[], tuple[Path, Path, Path]]] | None = None, *,
                 oci_root: Path | None = None, boot_files: Callable[[], tuple[Path, Path, Path]] | None = None) -> None:
        self._sources = sources if sources is not None else {DEFAULT_IMAGE: _default_artifacts}
        self._file_digests: dict[tuple[str, int, int, int], str] = {}
        self._oci_root = oci_root
        self._oci_manifests: dict[str, str] = {}  # OCI image name -> manifest digest it resolved to
        # kernel + initramfs for OCI images (their rootfs comes from the OCI cache): the default image's
        self._boot_files = boot_files or self._sources.get(DEFAULT_IMAGE, _default_artifacts)

    @classmethod
    def with_files(cls, images: dict[str, tuple[Path, Path, Path]], *, oci_root: Path | None = None) -> ImageStore:
        """The default image plus (or overridden by) images given as files."""
        sources: dict[str, Callable[[], tuple[Path, Path, Path]]] = {DEFAULT_IMAGE: _default_artifacts}
        for name, paths in images.items():
            sources[name] = functools.partial(_fixed, paths)
        return cls(sources, oci_root=oci_root)

    def oci_store(self) -> Any:
        from smold.oci.images import default_store
        from smold.oci.store import OciStore

        return OciStore(self._oci_root) if self._oci_root is not None else default_store()

    @property
    def names(self) -> list[str]:
        return sorted(self._sources)

    async def resolve(self, name: str, base_dir: str | None = None) -> Image:
        """The image's files and digest; ImageNotFoundError for an unknown or unbuilt image.

        Any other name with a '/', ':' or '@' is an OCI image: a registry reference (pulled once, then
        served from the cache) or a local OCI layout/archive path (relative to ``base_dir``).
        """
        source = self._sources.get(name)
        if source is None:
            # A bare word is a configured name (so a typo never becomes a Docker Hub pull); an OCI
            # image is written with a tag, digest, registry or path: "debian:bookworm", "./img".
            if any(c in name for c in "/:@"):
                return await self._resolve_oci(name, base_dir)
            raise ImageNotFoundError(f"unknown image '{name}' (this daemon has: {', '.join(self.names)}); "
                                     f"for a registry image give a tag, e.g. '{name}:latest'")
        kernel, initramfs, rootfs = await asyncio.to_thread(source)
        return await self._image(name, kernel, initramfs, rootfs)

    async def _resolve_oci(self, name: str, base_dir: str | None) -> Image:
        from smold.oci import images as oci
        from smold.oci.errors import OciError

        store = await asyncio.to_thread(self.oci_store)
        base = Path(base_dir) if base_dir else None
        for _attempt in range(2):
            try:
                r = await asyncio.to_thread(oci.resolve, store, name, base)
            except OciError as e:
                raise ImageNotFoundError(f"image '{name}': {e}") from None
            kernel, initramfs, _ = await asyncio.to_thread(self._boot_files)
            try:
                actual = await asyncio.to_thread(self._file_digest, r.rootfs)
            except OSError as e:
                raise ImageNotFoundError(f"image '{name}': cannot read its root disk: {e.strerror}") from None
            if r.rootfs_digest == f"sha256:{actual}":
                self._oci_manifests[name] = r.manifest
                user = r.config.user.split(":", 1)[0]
                img = await self._image(name, kernel, initramfs, r.rootfs)
                return dataclasses.replace(img, env=r.config.env, working_dir=r.config.working_dir, user=user)
            # The cached disk changed since it was built: never boot it; rebuild once from the blobs.
            await asyncio.to_thread(store.remove_image, r.manifest)
        raise ImageNotFoundError(f"image '{name}': its cached root disk is corrupt even after a rebuild")

    # -- the OCI cache (PullImage, ListImages, RemoveImage, PruneImages) --------------------------------------
    async def pull(self, ref: str) -> Any:
        """Pull a registry image (a tag is re-resolved) or import an absolute local path; its cache entry."""
        from smold.oci import images as oci
        from smold.oci.errors import BadReferenceError, OciError

        if oci.is_local(ref) and not (ref.startswith("/") or ref.partition(":")[2].startswith("/")):
            raise InvalidRequestError(f"ref: a local image path must be absolute (got {ref!r})")
        store = await asyncio.to_thread(self.oci_store)
        try:
            if oci.is_local(ref):
                r = await asyncio.to_thread(oci.import_local, store, ref)
            else:
                r = await asyncio.to_thread(oci.pull, store, ref)
        except BadReferenceError as e:
            raise InvalidRequestError(f"ref: {e}") from None
        except OciError as e:
            raise ImagePullError(f"image '{ref}': {e}") from None
        entries = await asyncio.to_thread(oci.list_images, store)
        return next(e for e in entries if e.manifest == r.manifest)

    async def list_images(self) -> list[Any]:
        from smold.oci import images as oci

        store = await asyncio.to_thread(self.oci_store)
        return await asyncio.to_thread(oci.list_images, store)

    async def remove_image(self, name: str) -> list[str]:
        from smold.oci import images as oci
        from smold.oci.errors import OciError

        store = await asyncio.to_thread(self.oci_store)
        try:
            return await asyncio.to_thread(oci.remove, store, name)
        except OciError as e:
            raise ImageNotFoundError(str(e)) from None

    async def prune_images(self, in_use: set[str]) -> tuple[list[str], int]:
        """Delete unnamed images and unreferenced blobs, keeping those of ``in_use`` image names."""
        from smold.oci.build import referenced_blobs

        store = await asyncio.to_thread(self.oci_store)
        keep = {str(r.get("manifest")) for r in await asyncio.to_thread(store.refs)}
        keep |= {self._oci_manifests[n] for n in in_use if n in self._oci_manifests}
        return await asyncio.to_thread(store.prune, keep, lambda m: referenced_blobs(store, m))

    async def _image(self, name: str, kernel: Path, initramfs: Path, rootfs: Path) -> Image:
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
