"""Resolve an image spec (registry ref, local OCI layout/archive) through the cache to a built root disk."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from smold.images.cache import default_cache_root

from .build import build_image, referenced_blobs
from .errors import FormatError, ImageNotCachedError, OciError
from .manifest import (
    ImageConfig,
    is_index,
    load_json,
    media_type_of,
    parse_index,
    parse_manifest,
    select_platform,
)
from .reference import Reference, parse_reference
from .registry import RegistryClient
from .runtime import runtime_key
from .source import import_archive, import_layout_dir
from .store import CachedImage, OciStore
from .unpack import UNPACK_VERSION

LOCAL_PREFIXES = ("oci:", "oci-archive:", "docker-archive:")


def default_store() -> OciStore:
    return OciStore(default_cache_root() / "oci")


def image_version() -> str:
    """Part of a built image's cache key: unpacker version and the injected runtime."""
    return f"{UNPACK_VERSION}r{runtime_key()}"


def is_local(spec: str) -> bool:
    """A local OCI layout directory or archive rather than a registry reference."""
    return spec.startswith(("/", "./", "../", "~")) or spec.startswith(LOCAL_PREFIXES)


@dataclass(frozen=True)
class ResolvedImage:
    """A built root disk for a spec, and the image config's exec defaults."""

    spec: str
    manifest: str
    rootfs: Path
    config: ImageConfig
    rootfs_digest: str


def _resolved(spec: str, img: CachedImage) -> ResolvedImage:
    cfg = img.meta.get("config")
    config = ImageConfig.from_json(cfg) if isinstance(cfg, dict) else ImageConfig()
    return ResolvedImage(spec, img.manifest, img.rootfs, config, str(img.meta.get("rootfs_digest", "")))


def local_path(spec: str, base_dir: Path | None = None) -> tuple[str, Path, str | None]:
    """(kind, absolute path, tag) of a local spec: kind "layout" or "archive"; ``oci:DIR:TAG`` names a tag."""
    kind = ""
    rest = spec
    for prefix in LOCAL_PREFIXES:
        if spec.startswith(prefix):
            kind, rest = ("layout" if prefix == "oci:" else "archive"), spec[len(prefix):]
    tag = None
    if kind == "layout" and ":" in rest:
        rest, tag = rest.rsplit(":", 1)
    path = Path(os.path.expanduser(rest))
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = Path(os.path.normpath(path))
    if not kind:
        kind = "layout" if path.is_dir() else "archive"
    if not path.exists():
        raise FormatError(f"local image {path} does not exist")
    return kind, path, tag


def import_local(store: OciStore, spec: str, base_dir: Path | None = None) -> ResolvedImage:
    kind, path, tag = local_path(spec, base_dir)
    with store.lock("gc", shared=True):
        digest = import_layout_dir(store, path, tag) if kind == "layout" else import_archive(store, path, tag)
        img = build_image(store, digest, version=image_version())
        name = f"{'oci' if kind == 'layout' else 'oci-archive'}:{path}" + (f":{tag}" if tag else "")
        store.set_ref(name, digest, source=str(path))
    return _resolved(name, img)


def pull(store: OciStore, ref: Reference | str, *, refresh: bool = True,
         client: RegistryClient | None = None) -> ResolvedImage:
    """Pull (or, without ``refresh``, reuse) an image from its registry, build its root disk, name it."""
    ref = parse_reference(ref) if isinstance(ref, str) else ref
    name = str(ref)
    version = image_version()
    with store.lock("gc", shared=True), store.lock(f"ref-{store.ref_key(name)}"):
        if not refresh or ref.digest:
            have = ref.digest or store.get_ref(name)
            if have is not None and (img := store.get_image(have, version)) is not None:
                store.set_ref(name, have, source="registry")
                return _resolved(name, img)
        client = client or RegistryClient(ref)
        data, media, digest = client.get_manifest(ref.wanted)
        store.put_bytes(data, digest, what="manifest")
        doc = load_json(data, "manifest")
        if is_index(media_type_of(doc, media)):
            desc = select_platform(parse_index(doc))
            data, media, digest = client.get_manifest(desc.digest)
            if len(data) != desc.size:
                raise FormatError(f"manifest {desc.digest}: {len(data)} bytes, index says {desc.size}")
            store.put_bytes(data, digest, what="manifest")
            doc = load_json(data, "manifest")
        manifest = parse_manifest(doc | {"mediaType": media_type_of(doc, media)})
        if store.get_image(digest, version) is None:
            for desc in (manifest.config, *manifest.layers):
                store.ensure_blob(desc, client.fetch_blob)
        img = build_image(store, digest, version=version)
        store.set_ref(name, digest, source="registry")
    return _resolved(name, img)


def resolve(store: OciStore, spec: str, base_dir: Path | None = None) -> ResolvedImage:
    """A spec as a Smolfile gives it: local paths are (re)imported, registry refs come from the cache
    when present (``smolctl image pull`` refreshes a tag) and are pulled otherwise."""
    if is_local(spec):
        return import_local(store, spec, base_dir)
    return pull(store, spec, refresh=False)


@dataclass(frozen=True)
class ImageEntry:
    """One cached image for ``image ls``: the names pointing at it, its manifest and disk size."""

    names: tuple[str, ...]
    manifest: str
    size: int
    created: float


def list_images(store: OciStore) -> list[ImageEntry]:
    names: dict[str, list[str]] = {}
    for r in store.refs():
        names.setdefault(str(r.get("manifest")), []).append(str(r.get("ref")))
    out = []
    for img in store.images():
        try:
            size = img.rootfs.stat().st_size
        except FileNotFoundError:
            continue
        out.append(ImageEntry(tuple(sorted(names.get(img.manifest, ()))), img.manifest, size,
                              float(str(img.meta.get("created", 0)))))
    return sorted(out, key=lambda e: (e.names, e.manifest))


def remove(store: OciStore, name: str) -> list[str]:
    """Drop a name (or every name of a manifest digest); the image itself goes at the next prune."""
    removed = []
    wanted = {name}
    if is_local(name) and not name.startswith(LOCAL_PREFIXES):
        wanted |= {f"oci:{name}", f"oci-archive:{name}"}  # a bare path names its import
    elif (canonical := _canonical(name)) is not None:
        wanted.add(canonical)
    for r in store.refs():
        if r.get("ref") in wanted or r.get("manifest") == name:
            if store.remove_ref(str(r["ref"])):
                removed.append(str(r["ref"]))
    if not removed:
        raise ImageNotCachedError(f"no cached image named {name!r}")
    return removed


def _canonical(name: str) -> str | None:
    try:
        return str(parse_reference(name))
    except OciError:
        return None


def prune(store: OciStore) -> tuple[list[str], int]:
    """Remove every image and blob no name refers to; (removed digests, bytes freed)."""
    keep = {str(r.get("manifest")) for r in store.refs()}
    return store.prune(keep, lambda m: referenced_blobs(store, m))
