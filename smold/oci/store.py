"""Content-addressed OCI cache: verified blobs by digest, built root disks by manifest digest, named refs.

Layout under ``<cache>/oci/``::

    blobs/sha256/<hex>                 every blob, written to tmp/ then renamed once its digest matched
    images/<hex>-u<N>/                 rootfs.ext4 + image.json, published by directory rename
    refs/<key>.json                    {"ref": "127.0.0.1:5000/x:tag", "manifest": "sha256:..."}
    tmp/  locks/

Concurrency: every create of a blob, image or ref takes an flock on locks/<what>.lock, then
re-checks; two processes asking for the same new image build it once. A crash leaves only
tmp/ files (a partial download is resumed from its length, then re-verified), never a final entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .digest import CHUNK, check_digest, hex_of, verify_bytes
from .errors import DigestError, ImageNotCachedError, OciError
from .manifest import Descriptor

IMAGE_FILE = "rootfs.ext4"
IMAGE_META = "image.json"

Fetcher = Callable[[Descriptor, BinaryIO, int], None]
"""``fetch(descriptor, out, offset)`` appends the blob's bytes from ``offset`` to ``out`` (it may
restart from 0 by truncating ``out`` and seeking to 0 when the source cannot resume)."""


@dataclass(frozen=True)
class CachedImage:
    """A built root disk and what it came from."""

    manifest: str
    path: Path  # the image directory
    meta: dict[str, object]

    @property
    def rootfs(self) -> Path:
        return self.path / IMAGE_FILE


class OciStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("blobs/sha256", "images", "refs", "tmp", "locks"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    # -- locking ------------------------------------------------------------------------------------
    @contextmanager
    def lock(self, name: str, *, shared: bool = False) -> Iterator[None]:
        fd = os.open(self.root / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- blobs --------------------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / hex_of(digest)

    def has_blob(self, desc: Descriptor) -> bool:
        try:
            return self.blob_path(desc.digest).stat().st_size == desc.size
        except FileNotFoundError:
            return False

    def put_bytes(self, data: bytes, digest: str, size: int | None = None, what: str = "blob") -> Path:
        verify_bytes(data, digest, size, what)
        path = self.blob_path(digest)
        if path.is_file() and path.stat().st_size == len(data):
            return path
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp", prefix="put-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def read_blob(self, digest: str, size: int | None = None, what: str = "blob") -> bytes:
        """A small blob's bytes, re-verified (a corrupt cached blob is deleted and reported)."""
        try:
            data = self.blob_path(digest).read_bytes()
        except FileNotFoundError:
            raise ImageNotCachedError(f"{what} {digest} is not in the cache") from None
        try:
            return verify_bytes(data, digest, size, what)
        except DigestError:
            self.blob_path(digest).unlink(missing_ok=True)
            raise

    def ensure_blob(self, desc: Descriptor, fetch: Fetcher) -> Path:
        """The blob's cache path, fetching (or resuming) it under its lock and verifying it first."""
        path = self.blob_path(desc.digest)
        if self.has_blob(desc):
            return path
        hexd = hex_of(desc.digest)
        with self.lock(f"blob-{hexd}"):
            if self.has_blob(desc):
                return path  # someone fetched it while we waited
            partial = self.root / "tmp" / f"{hexd}.partial"
            with open(partial, "ab+") as out:
                offset = out.seek(0, os.SEEK_END)
                if offset > desc.size:
                    out.truncate(0)
                    offset = 0
                if offset < desc.size or offset == 0:
                    fetch(desc, out, offset)
                out.flush()
                os.fsync(out.fileno())
                out.seek(0)
                h = hashlib.sha256()
                n = 0
                while data := out.read(CHUNK):
                    h.update(data)
                    n += len(data)
            actual = "sha256:" + h.hexdigest()
            if n != desc.size or actual != desc.digest:
                partial.unlink(missing_ok=True)
                raise DigestError(f"blob {desc.digest}: received {n} bytes hashing to {actual} "
                                  f"(descriptor says {desc.size} bytes); discarded")
            os.rename(partial, path)
        return path

    def import_stream(self, desc: Descriptor, src: BinaryIO) -> Path:
        """Copy a local blob (layout directory, archive member) in, verified."""
        def fetch(d: Descriptor, out: BinaryIO, offset: int) -> None:
            out.seek(0)
            out.truncate(0)
            shutil.copyfileobj(src, out, CHUNK)
        return self.ensure_blob(desc, fetch)

    def blobs(self) -> list[tuple[str, int]]:
        out = []
        for p in (self.root / "blobs" / "sha256").iterdir():
            try:
                out.append((f"sha256:{p.name}", p.stat().st_size))
            except FileNotFoundError:
                continue
        return sorted(out)

    # -- refs ---------------------------------------------------------------------------------------
    @staticmethod
    def ref_key(ref: str) -> str:
        return hashlib.sha256(ref.encode()).hexdigest()[:32]

    def set_ref(self, ref: str, manifest: str, *, source: str = "") -> None:
        check_digest(manifest)
        doc = {"ref": ref, "manifest": manifest, "source": source, "updated": time.time()}
        path = self.root / "refs" / f"{self.ref_key(ref)}.json"
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp", prefix="ref-")
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.rename(tmp, path)

    def get_ref(self, ref: str) -> str | None:
        try:
            doc = json.loads((self.root / "refs" / f"{self.ref_key(ref)}.json").read_text())
            return check_digest(doc["manifest"])
        except (FileNotFoundError, ValueError, KeyError, OciError):
            return None

    def refs(self) -> list[dict[str, object]]:
        out = []
        for p in sorted((self.root / "refs").glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (FileNotFoundError, ValueError):
                continue
        return sorted(out, key=lambda d: str(d.get("ref")))

    def remove_ref(self, ref: str) -> bool:
        try:
            (self.root / "refs" / f"{self.ref_key(ref)}.json").unlink()
            return True
        except FileNotFoundError:
            return False

    # -- images -------------------------------------------------------------------------------------
    def image_dir(self, manifest: str, version: str) -> Path:
        return self.root / "images" / f"{hex_of(manifest)}-u{version}"

    def get_image(self, manifest: str, version: str) -> CachedImage | None:
        d = self.image_dir(manifest, version)
        try:
            meta = json.loads((d / IMAGE_META).read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not (d / IMAGE_FILE).is_file():
            return None
        return CachedImage(manifest, d, meta)

    def images(self) -> list[CachedImage]:
        out = []
        for d in sorted((self.root / "images").iterdir()):
            hexd, _, ver = d.name.partition("-u")
            if not ver or len(hexd) != 64:
                continue
            img = self.get_image(f"sha256:{hexd}", ver)
            if img is not None:
                out.append(img)
        return out

    def publish_image(self, manifest: str, version: str, build: Callable[[Path, Path], dict[str, object]]) -> CachedImage:
        """Build once under the image lock: ``build(out_dir, work_dir) -> meta`` writes out_dir/rootfs.ext4."""
        if (hit := self.get_image(manifest, version)) is not None:
            return hit
        with self.lock(f"image-{hex_of(manifest)}"):
            if (hit := self.get_image(manifest, version)) is not None:
                return hit
            tmp = Path(tempfile.mkdtemp(prefix=f"image-{hex_of(manifest)[:16]}-", dir=self.root / "tmp"))
            try:
                out, work = tmp / "out", tmp / "work"
                out.mkdir()
                work.mkdir()
                meta = build(out, work)
                rootfs = out / IMAGE_FILE
                if not rootfs.is_file():
                    raise OciError(f"image build for {manifest} produced no {IMAGE_FILE}")
                h = hashlib.sha256()
                with open(rootfs, "rb") as fh:
                    os.fsync(fh.fileno())
                    while data := fh.read(CHUNK):
                        h.update(data)
                meta = {**meta, "manifest": manifest, "unpack_version": version,
                        "rootfs_digest": "sha256:" + h.hexdigest(), "created": time.time()}
                (out / IMAGE_META).write_text(json.dumps(meta, indent=1, sort_keys=True))
                os.rename(out, self.image_dir(manifest, version))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        hit = self.get_image(manifest, version)
        assert hit is not None
        return hit

    def remove_image(self, manifest: str) -> int:
        """Delete every unpack version of one image; returns bytes freed."""
        freed = 0
        with self.lock(f"image-{hex_of(manifest)}"):
            for d in (self.root / "images").glob(f"{hex_of(manifest)}-u*"):
                freed += _tree_bytes(d)
                shutil.rmtree(d, ignore_errors=True)
        return freed

    # -- garbage collection -------------------------------------------------------------------------
    def prune(self, keep_manifests: set[str], referenced_blobs: Callable[[str], set[str]],
              *, tmp_age_s: float = 3600.0) -> tuple[list[str], int]:
        """Remove images whose manifest is not kept and blobs no kept manifest references.

        Returns (removed digests, bytes freed). Runs under the global 'gc' lock; concurrent pulls
        hold it shared, so a blob fetched for an image not yet named by a ref is never collected.
        """
        removed: list[str] = []
        freed = 0
        with self.lock("gc"):
            for img in self.images():
                if img.manifest not in keep_manifests:
                    freed += self.remove_image(img.manifest)
                    removed.append(img.manifest)
            live: set[str] = set()
            for m in keep_manifests:
                live |= referenced_blobs(m)
            for digest, size in self.blobs():
                if digest not in live:
                    with self.lock(f"blob-{hex_of(digest)}"):
                        self.blob_path(digest).unlink(missing_ok=True)
                    removed.append(digest)
                    freed += size
            now = time.time()
            for p in (self.root / "tmp").iterdir():
                try:
                    if now - p.lstat().st_mtime > tmp_age_s:
                        freed += _tree_bytes(p)
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
                except FileNotFoundError:
                    continue
        return removed, freed


def _tree_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total
