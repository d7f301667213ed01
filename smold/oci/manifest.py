"""Parse OCI/Docker manifests, indexes and image configs; pick the linux/amd64 manifest from an index."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .digest import check_digest
from .errors import FormatError, PlatformError

# OCI image spec media-types.md, plus the Docker v2 schema 2 equivalents registries still serve.
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
CONFIG_TYPES = (OCI_CONFIG, DOCKER_CONFIG)
LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
)
ACCEPT = ", ".join((*INDEX_TYPES, *MANIFEST_TYPES))
WANT_OS, WANT_ARCH = "linux", "amd64"
MAX_DOC = 4 << 20  # manifests, indexes and configs are small; refuse to parse anything huge
MAX_LAYERS = 256


@dataclass(frozen=True)
class Descriptor:
    """descriptor.md: mediaType, digest, size (+ platform in an index)."""

    media_type: str
    digest: str
    size: int
    platform: tuple[str, str, str] = ("", "", "")  # os, architecture, variant

    @classmethod
    def parse(cls, obj: object, where: str) -> Descriptor:
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: descriptor is not an object")
        media = obj.get("mediaType", "")
        size = obj.get("size")
        if not isinstance(media, str):
            raise FormatError(f"{where}: mediaType is not a string")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatError(f"{where}: size must be a non-negative integer")
        try:
            digest = check_digest(obj.get("digest"))
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
        plat = obj.get("platform") or {}
        if not isinstance(plat, dict):
            raise FormatError(f"{where}: platform is not an object")
        platform = (str(plat.get("os", "")), str(plat.get("architecture", "")), str(plat.get("variant", "")))
        return cls(media, digest, size, platform)


@dataclass(frozen=True)
class Manifest:
    """manifest.md: one config blob and the ordered layers (lowest first)."""

    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    """The parts of config.md's ``config`` object that shape a VM, and the layers' diff_ids."""

    env: tuple[tuple[str, str], ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    diff_ids: tuple[str, ...] = ()
    os: str = ""
    architecture: str = ""
    labels: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {"env": [list(p) for p in self.env], "working_dir": self.working_dir, "user": self.user,
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd), "diff_ids": list(self.diff_ids),
                "os": self.os, "architecture": self.architecture, "labels": [list(p) for p in self.labels]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageConfig:
        return cls(env=tuple((str(k), str(v)) for k, v in d.get("env", ())),
                   working_dir=str(d.get("working_dir", "")), user=str(d.get("user", "")),
                   entrypoint=tuple(d.get("entrypoint", ())), cmd=tuple(d.get("cmd", ())),
                   diff_ids=tuple(d.get("diff_ids", ())), os=str(d.get("os", "")),
                   architecture=str(d.get("architecture", "")),
                   labels=tuple((str(k), str(v)) for k, v in d.get("labels", ())))


def load_json(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > MAX_DOC:
        raise FormatError(f"{what} is {len(data)} bytes; refusing documents over {MAX_DOC}")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{what} is not a JSON object")
    return doc


def media_type_of(doc: dict[str, Any], fallback: str = "") -> str:
    """A document's media type: its own mediaType field, else the transport's, else guessed by shape."""
    mt = doc.get("mediaType") or fallback
    if mt in (*INDEX_TYPES, *MANIFEST_TYPES):
        return str(mt)
    if "manifests" in doc:
        return OCI_INDEX
    if "layers" in doc and "config" in doc:
        return OCI_MANIFEST
    raise FormatError(f"unsupported manifest media type {mt!r}")


def is_index(media_type: str) -> bool:
    return media_type in INDEX_TYPES


def parse_index(doc: dict[str, Any]) -> list[Descriptor]:
    """image-index.md: the manifests[] descriptors."""
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise FormatError("index has no manifests[] array")
    return [Descriptor.parse(m, f"index manifests[{i}]") for i, m in enumerate(manifests)]


def select_platform(descriptors: list[Descriptor], os_: str = WANT_OS, arch: str = WANT_ARCH) -> Descriptor:
    """The first manifest for os/arch; attestation manifests (platform unknown/unknown) never match."""
    candidates = [d for d in descriptors if d.platform[0] == os_ and d.platform[1] == arch
                  and (d.media_type in (*MANIFEST_TYPES, *INDEX_TYPES) or not d.media_type)]
    if not candidates:
        have = sorted({"/".join(p for p in d.platform if p) or "unspecified" for d in descriptors})
        raise PlatformError(f"no {os_}/{arch} image in the index (it has: {', '.join(have) or 'nothing'})")
    # amd64 has no variants in practice; prefer one without a variant, then the first listed.
    candidates.sort(key=lambda d: d.platform[2] != "")
    return candidates[0]


def parse_manifest(doc: dict[str, Any]) -> Manifest:
    media = media_type_of(doc)
    if media not in MANIFEST_TYPES:
        raise FormatError(f"expected an image manifest, got {media}")
    if doc.get("schemaVersion") != 2:
        raise FormatError("manifest schemaVersion must be 2")
    config = Descriptor.parse(doc.get("config"), "manifest config")
    if config.media_type and config.media_type not in CONFIG_TYPES:
        raise FormatError(f"manifest config has media type {config.media_type!r}, not an image config")
    layers_raw = doc.get("layers")
    if not isinstance(layers_raw, list):
        raise FormatError("manifest has no layers[] array")
    if len(layers_raw) > MAX_LAYERS:
        raise FormatError(f"manifest has {len(layers_raw)} layers (max {MAX_LAYERS})")
    layers = tuple(Descriptor.parse(d, f"manifest layers[{i}]") for i, d in enumerate(layers_raw))
    for i, layer in enumerate(layers):
        if layer.media_type and layer.media_type not in LAYER_TYPES:
            raise FormatError(f"manifest layers[{i}] has unsupported media type {layer.media_type!r}")
    return Manifest(media, config, layers)


def _strings(value: object, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(f"image config {what} must be an array of strings")
    return tuple(value)


def parse_config(data: bytes) -> ImageConfig:
    """config.md: Env (NAME=VALUE), WorkingDir, User, Entrypoint, Cmd, Labels; rootfs.diff_ids."""
    doc = load_json(data, "image config")
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise FormatError("image config 'config' is not an object")
    env = []
    for item in _strings(cfg.get("Env"), "Env"):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise FormatError(f"image config Env entry {item!r} is not NAME=VALUE")
        env.append((name, value))
    rootfs = doc.get("rootfs") or {}
    if not isinstance(rootfs, dict):
        raise FormatError("image config rootfs is not an object")
    diff_ids = _strings(rootfs.get("diff_ids"), "rootfs.diff_ids")
    for d in diff_ids:
        check_digest(d)
    labels = cfg.get("Labels") or {}
    if not isinstance(labels, dict):
        raise FormatError("image config Labels is not an object")
    wd, user = cfg.get("WorkingDir") or "", cfg.get("User") or ""
    if not isinstance(wd, str) or not isinstance(user, str):
        raise FormatError("image config WorkingDir and User must be strings")
    return ImageConfig(env=tuple(env), working_dir=wd, user=user,
                       entrypoint=_strings(cfg.get("Entrypoint"), "Entrypoint"),
                       cmd=_strings(cfg.get("Cmd"), "Cmd"), diff_ids=diff_ids,
                       os=str(doc.get("os", "")), architecture=str(doc.get("architecture", "")),
                       labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())))
