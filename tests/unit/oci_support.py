"""Build OCI layers, image layouts, OCI archives and docker-save tarballs in tests (tarfile, hashlib, json)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from smold.oci.manifest import OCI_CONFIG, OCI_INDEX, OCI_MANIFEST

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
TAR_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass
class Entry:
    name: str
    kind: str = "file"  # file, dir, symlink, hardlink, chr, fifo
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    link: str = ""
    mtime: int = 1700000000
    pax: dict[str, str] = field(default_factory=dict)


def F(name: str, data: bytes | str = b"", mode: int = 0o644, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(name, "file", data.encode() if isinstance(data, str) else data, mode, uid, gid)


def D(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(name, "dir", mode=mode, uid=uid, gid=gid)


def L(name: str, target: str) -> Entry:
    return Entry(name, "symlink", link=target, mode=0o777)


def H(name: str, target: str) -> Entry:
    return Entry(name, "hardlink", link=target)


def layer_tar(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, e.mtime
            ti.pax_headers = dict(e.pax)
            if e.kind == "file":
                ti.size = len(e.data)
                tf.addfile(ti, io.BytesIO(e.data))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                       "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}[e.kind]
            ti.linkname = e.link
            if e.kind == "chr":
                ti.devmajor, ti.devminor = 1, 3
            tf.addfile(ti)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Built:
    """An image written as blobs: the manifest (and maybe index) bytes, and every blob by digest."""

    blobs: dict[str, bytes]
    manifest_digest: str
    index: dict[str, object]
    layer_digests: list[str]
    config_digest: str


def build_image(layers: list[list[Entry]], *, gzip_layers: bool = True, config: dict[str, object] | None = None,
                as_index: bool = False, extra_platforms: tuple[tuple[str, str], ...] = (),
                ref_name: str | None = None) -> Built:
    blobs: dict[str, bytes] = {}
    descs, diff_ids = [], []
    for entries in layers:
        tar = layer_tar(entries)
        diff_ids.append(sha(tar))
        blob = gzip.compress(tar, mtime=0) if gzip_layers else tar
        blobs[sha(blob)] = blob
        descs.append({"mediaType": GZIP_LAYER if gzip_layers else TAR_LAYER, "digest": sha(blob), "size": len(blob)})
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cfg_bytes = json.dumps(cfg).encode()
    blobs[sha(cfg_bytes)] = cfg_bytes
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": sha(cfg_bytes), "size": len(cfg_bytes)},
                "layers": descs}
    m_bytes = json.dumps(manifest).encode()
    blobs[sha(m_bytes)] = m_bytes
    m_desc: dict[str, object] = {"mediaType": OCI_MANIFEST, "digest": sha(m_bytes), "size": len(m_bytes)}
    if ref_name:
        m_desc["annotations"] = {"org.opencontainers.image.ref.name": ref_name}
    if as_index:
        entries_ = []
        for os_, arch in extra_platforms:  # decoys for other platforms (not stored: never fetched)
            fake = json.dumps({"schemaVersion": 2, "decoy": arch}).encode()
            entries_.append({"mediaType": OCI_MANIFEST, "digest": sha(fake), "size": len(fake),
                             "platform": {"os": os_, "architecture": arch}})
        entries_.append({**m_desc, "platform": {"os": "linux", "architecture": "amd64"}})
        inner = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries_}
        inner_bytes = json.dumps(inner).encode()
        blobs[sha(inner_bytes)] = inner_bytes
        top_desc: dict[str, object] = {"mediaType": OCI_INDEX, "digest": sha(inner_bytes), "size": len(inner_bytes)}
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [top_desc]}
    else:
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [m_desc]}
    return Built(blobs, sha(m_bytes), index, [d["digest"] for d in descs], sha(cfg_bytes))  # type: ignore[misc]


def write_layout(built: Built, path: Path) -> Path:
    (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (path / "index.json").write_text(json.dumps(built.index))
    for digest, data in built.blobs.items():
        (path / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
    return path


def write_oci_archive(built: Built, path: Path) -> Path:
    with tarfile.open(path, "w") as tf:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add("index.json", json.dumps(built.index).encode())
        for digest, data in built.blobs.items():
            add(f"blobs/sha256/{digest.split(':')[1]}", data)
    return path


def write_docker_save(layers: list[list[Entry]], path: Path, *, config: dict[str, object] | None = None,
                      tag: str = "test/img:latest") -> Path:
    """Legacy ``docker save`` format: manifest.json, <config hex>.json, <id>/layer.tar (uncompressed)."""
    tars = [layer_tar(e) for e in layers]
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": [sha(t) for t in tars]}}
    cfg_bytes = json.dumps(cfg).encode()
    cfg_name = sha(cfg_bytes).split(":")[1] + ".json"
    with tarfile.open(path, "w") as tf:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        add(cfg_name, cfg_bytes)
        names = []
        for i, t in enumerate(tars):
            name = f"{i:064x}/layer.tar"
            add(name, t)
            names.append(name)
        add("manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": [tag], "Layers": names}]).encode())
    return path


def sparse_tar(where: Path, size: int = 64 << 20) -> bytes:
    """A tar holding one GNU sparse member of ``size`` bytes, all hole (GNU tar -S): a few KiB that unpack to
    ``size`` bytes of zeros. Fails the test where GNU tar is missing (never a skip)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("tar") is None:
        pytest.fail("GNU tar is needed to write a sparse member")
    where.mkdir()
    with open(where / "holes", "wb") as f:
        f.truncate(size)
    data = subprocess.run(["tar", "-c", "-S", "-f", "-", "-C", str(where), "holes"], capture_output=True,
                          check=True).stdout
    assert len(data) < 1 << 20
    return data
