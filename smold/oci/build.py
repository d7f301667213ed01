"""Turn a stored manifest into a cached read-only ext4 root disk (unpack layers, inject runtime, mkfs -d)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

from smold.images import proc, rootfs

from .digest import HashingReader
from .errors import DigestError, FormatError
from .manifest import Manifest, load_json, media_type_of, parse_config, parse_manifest
from .store import IMAGE_FILE, CachedImage, OciStore
from .unpack import UnpackBudget, apply_layer

LABEL = "smol-oci"


def load_manifest(store: OciStore, digest: str) -> Manifest:
    doc = load_json(store.read_blob(digest, what="manifest"), "manifest")
    return parse_manifest(doc | {"mediaType": media_type_of(doc)})


def referenced_blobs(store: OciStore, digest: str) -> set[str]:
    """The manifest and every blob it references (for garbage collection); just itself if unreadable."""
    try:
        m = load_manifest(store, digest)
    except Exception:
        return {digest}
    return {digest, m.config.digest, *(layer.digest for layer in m.layers)}


def unpack_into(store: OciStore, manifest: Manifest, tree: Path) -> dict[str, object]:
    """Apply every layer (each blob re-verified while read) into ``tree``; returns stats for the metadata."""
    config_bytes = store.read_blob(manifest.config.digest, manifest.config.size, "config")
    config = parse_config(config_bytes)
    if config.diff_ids and len(config.diff_ids) != len(manifest.layers):
        raise FormatError(f"config has {len(config.diff_ids)} diff_ids for {len(manifest.layers)} layers")
    if config.architecture and config.architecture != "amd64":
        raise FormatError(f"image is for {config.architecture}, this host runs amd64 guests")
    files = whiteouts = skipped = 0
    budget = UnpackBudget()   # the image's layers together
    for i, layer in enumerate(manifest.layers):
        path = store.blob_path(layer.digest)
        with open(path, "rb") as raw:
            hashed = HashingReader(raw)
            failure: Exception | None = None
            try:
                stats = apply_layer(tree, hashed, diff_id=config.diff_ids[i] if config.diff_ids else None,  # type: ignore[arg-type]
                                    budget=budget)
            except Exception as e:  # the blob's own digest is checked first: corruption explains any failure
                failure = e
            hashed.drain()
        if hashed.digest != layer.digest or hashed.size != layer.size:
            path.unlink(missing_ok=True)  # a corrupt cached blob: drop it so the next pull refetches
            raise DigestError(f"cached layer {layer.digest} is corrupt (hashes to {hashed.digest}); removed")
        if failure is not None:
            raise failure
        files, whiteouts, skipped = files + stats.files, whiteouts + stats.whiteouts, skipped + stats.skipped_devices
    return {"config": config.to_json(), "files": files, "whiteouts": whiteouts, "skipped_devices": skipped}


def mkfs_ext4(tree: Path, image: Path, log: Path, seed: str = "") -> None:
    """``mkfs.ext4 -d`` (no loop mount), sized to the tree plus headroom; e2fsck-checked.

    The UUID and directory hash seed derive from ``seed`` (the manifest digest), not randomness.
    """
    data, inodes = rootfs.tree_size(tree)
    size = rootfs.image_size(data, inodes)
    with open(image, "wb") as fh:
        fh.truncate(size)
    env = {"LC_ALL": "C", "E2FSPROGS_FAKE_TIME": str(rootfs.SOURCE_DATE_EPOCH)}
    proc.run(["mkfs.ext4", "-F", "-q", "-L", LABEL, "-b", "4096", "-I", "256", "-N", str(inodes * 2 + 4096),
              "-m", "0", "-O", "^has_journal", "-U", _uuid(seed, "fs"),
              "-E", f"root_owner=0:0,lazy_itable_init=0,hash_seed={_uuid(seed, 'hash')}",
              "-d", str(tree), str(image)], env=env, log=log)
    proc.run(["e2fsck", "-f", "-n", str(image)], env=env, log=log)


def _uuid(seed: str, what: str) -> str:
    return str(uuid.UUID(hashlib.sha256(f"{what}:{seed}".encode()).hexdigest()[:32], version=4))


def build_image(store: OciStore, digest: str, *, version: str, inject: bool = True) -> CachedImage:
    """The cached root disk for manifest ``digest``, built once (under the store's image lock)."""
    manifest = load_manifest(store, digest)

    def build(out: Path, work: Path) -> dict[str, object]:
        tree = work / "root"
        tree.mkdir(mode=0o755)
        os.chown(tree, 0, 0)
        meta = unpack_into(store, manifest, tree)
        if inject:
            from .runtime import inject_runtime
            meta["runtime"] = inject_runtime(tree)
        mkfs_ext4(tree, out / IMAGE_FILE, work / "mkfs.log", digest)
        return meta

    return store.publish_image(digest, version, build)
