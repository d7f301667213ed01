"""Import local images into the store: an OCI image layout directory, an OCI archive, or ``docker save`` output."""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .digest import file_digest, sha256_bytes
from .errors import DigestError, FormatError
from .manifest import (
    DOCKER_CONFIG,
    OCI_CONFIG,
    OCI_MANIFEST,
    Descriptor,
    is_index,
    load_json,
    media_type_of,
    parse_config,
    parse_index,
    parse_manifest,
    select_platform,
)
from .store import OciStore

REF_NAME = "org.opencontainers.image.ref.name"  # annotations.md
Opener = Callable[[str], BinaryIO]  # relative path inside the layout -> stream (FileNotFoundError if absent)


def _blob_rel(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    return f"blobs/{algo}/{hexd}"


def _import_blob(store: OciStore, opener: Opener, desc: Descriptor) -> None:
    if store.has_blob(desc):
        return
    try:
        src = opener(_blob_rel(desc.digest))
    except FileNotFoundError:
        raise FormatError(f"image layout lacks blob {desc.digest}") from None
    with src:
        store.import_stream(desc, src)


def _import_layout(store: OciStore, opener: Opener, tag: str | None) -> str:
    """image-layout.md: oci-layout + index.json + blobs/; returns the linux/amd64 manifest digest."""
    try:
        with opener("oci-layout") as fh:
            layout = load_json(fh.read(), "oci-layout")
        with opener("index.json") as fh:
            index_bytes = fh.read()
    except FileNotFoundError as e:
        raise FormatError(f"not an OCI image layout (missing {e.filename or 'oci-layout/index.json'})") from None
    if layout.get("imageLayoutVersion") != "1.0.0":
        raise FormatError(f"unsupported imageLayoutVersion {layout.get('imageLayoutVersion')!r}")
    index = load_json(index_bytes, "index.json")
    entries = parse_index(index)
    raw = index.get("manifests", [])
    if tag is not None:
        named = [d for d, r in zip(entries, raw, strict=True)
                 if isinstance(r, dict) and (r.get("annotations") or {}).get(REF_NAME) == tag]
        if not named:
            raise FormatError(f"image layout has no manifest named {tag!r}")
        entries = named
    if not entries:
        raise FormatError("index.json lists no manifests")
    desc = entries[0] if len(entries) == 1 and not any(entries[0].platform) else select_platform(entries)
    for _ in range(4):  # an index may point at a nested index (e.g. skopeo/buildx output)
        _import_blob(store, opener, desc)
        doc_bytes = store.read_blob(desc.digest, desc.size, "manifest")
        doc = load_json(doc_bytes, "manifest")
        if not is_index(media_type_of(doc, desc.media_type)):
            break
        desc = select_platform(parse_index(doc))
    else:
        raise FormatError("image indexes nested too deeply")
    manifest = parse_manifest(doc)
    _import_blob(store, opener, manifest.config)
    for layer in manifest.layers:
        _import_blob(store, opener, layer)
    return desc.digest


def import_layout_dir(store: OciStore, path: Path, tag: str | None = None) -> str:
    """Import an OCI image layout directory; returns the manifest digest."""
    if not path.is_dir():
        raise FormatError(f"{path} is not a directory")
    root = os.path.realpath(path)

    def opener(rel: str) -> BinaryIO:
        full = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([root, full]) != root:
            raise FormatError(f"{rel} leaves the layout directory")
        return open(full, "rb")

    return _import_layout(store, opener, tag)


def import_archive(store: OciStore, path: Path, tag: str | None = None) -> str:
    """Import an OCI archive (a tarred layout) or ``docker save`` output; returns the manifest digest."""
    try:
        tf = tarfile.open(path, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise FormatError(f"{path} is not a readable tar archive: {e}") from None
    with tf:
        members = {}
        for m in tf.getmembers():
            name = "/".join(p for p in m.name.split("/") if p not in ("", "."))
            members[name] = m

        def opener(rel: str) -> BinaryIO:
            m = members.get(rel)
            seen = 0
            while m is not None and m.issym() and seen < 8:  # docker save links duplicate layers
                target = os.path.normpath(os.path.join(os.path.dirname(rel), m.linkname))
                m, rel, seen = members.get(target), target, seen + 1
            if m is None or not m.isfile():
                raise FileNotFoundError(rel)
            f = tf.extractfile(m)
            if f is None:
                raise FileNotFoundError(rel)
            return f  # type: ignore[return-value]

        if "index.json" in members and "oci-layout" in members:
            return _import_layout(store, opener, tag)
        if "manifest.json" in members:
            return _import_docker_save(store, opener, tag)
    raise FormatError(f"{path} is neither an OCI archive (oci-layout, index.json) nor docker save output "
                      "(manifest.json)")


def _import_docker_save(store: OciStore, opener: Opener, tag: str | None) -> str:
    """Legacy ``docker save``: manifest.json lists a config file and uncompressed layer tars.

    The config's name is its digest and each layer must hash to its diff_id; we store them as an
    OCI manifest with uncompressed layers (so layer digest == diff_id), and return its digest.
    """
    with opener("manifest.json") as fh:
        try:
            entries = json.loads(fh.read())
        except ValueError as e:
            raise FormatError(f"docker save manifest.json is not JSON: {e}") from None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise FormatError("docker save manifest.json must be a non-empty array of objects")
    if tag is not None:
        entries = [e for e in entries if tag in (e.get("RepoTags") or [])]
        if not entries:
            raise FormatError(f"docker save archive has no image tagged {tag!r}")
    if len(entries) > 1:
        raise FormatError("docker save archive holds several images; name one with a tag")
    entry = entries[0]
    cfg_name, layer_names = entry.get("Config"), entry.get("Layers")
    if not isinstance(cfg_name, str) or not isinstance(layer_names, list):
        raise FormatError("docker save manifest.json entry lacks Config/Layers")
    with opener(cfg_name) as fh:
        cfg_bytes = fh.read()
    cfg_digest = sha256_bytes(cfg_bytes)
    stem = os.path.basename(cfg_name).removesuffix(".json")
    if len(stem) == 64 and f"sha256:{stem}" != cfg_digest:
        raise DigestError(f"docker save config {cfg_name} hashes to {cfg_digest}")
    config = parse_config(cfg_bytes)
    if len(config.diff_ids) != len(layer_names):
        raise FormatError(f"config lists {len(config.diff_ids)} diff_ids for {len(layer_names)} layers")
    store.put_bytes(cfg_bytes, cfg_digest, what="config")
    layers = []
    for name, diff_id in zip(layer_names, config.diff_ids, strict=True):
        if not isinstance(name, str):
            raise FormatError("docker save Layers entries must be strings")
        with opener(name) as fh:
            digest, size = file_digest(fh)
        if digest != diff_id:
            raise DigestError(f"docker save layer {name} hashes to {digest}, config diff_id is {diff_id}")
        desc = Descriptor("application/vnd.oci.image.layer.v1.tar", digest, size)
        with opener(name) as fh:
            store.import_stream(desc, fh)
        layers.append({"mediaType": desc.media_type, "digest": digest, "size": size})
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG if "oci" in cfg_name else DOCKER_CONFIG,
                           "digest": cfg_digest, "size": len(cfg_bytes)},
                "layers": layers}
    data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    digest = sha256_bytes(data)
    store.put_bytes(data, digest, what="manifest")
    return digest
