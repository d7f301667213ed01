"""Unit tests for OCI import, layer unpacking, the blob/image cache and the registry client (no KVM)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path
from typing import BinaryIO

import pytest
from oci_support import (
    D,
    Entry,
    F,
    H,
    L,
    layer_tar,
    sha,
    write_docker_save,
    write_layout,
    write_oci_archive,
)
from oci_support import (
    build_image as build_blobs,
)

from smold.oci import images as oci_images
from smold.oci.build import build_image
from smold.oci.digest import sha256_bytes
from smold.oci.errors import (
    BadReferenceError,
    DigestError,
    FormatError,
    ImageNotCachedError,
    PlatformError,
    UnsafePathError,
    UnsupportedError,
)
from smold.oci.manifest import Descriptor, parse_config
from smold.oci.reference import parse_reference
from smold.oci.registry import parse_challenge
from smold.oci.source import import_archive, import_layout_dir
from smold.oci.store import OciStore
from smold.oci.unpack import apply_layer

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking ownership needs root")


def apply(root: Path, entries: list[Entry], *, gz: bool = False) -> None:
    import io

    tar = layer_tar(entries)
    data = gzip.compress(tar) if gz else tar
    apply_layer(root, io.BytesIO(data), diff_id=sha(tar))  # type: ignore[arg-type]


# --- references ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,registry,repo,tag,digest", [
    ("debian", "docker.io", "library/debian", "latest", None),
    ("debian:bookworm-slim", "docker.io", "library/debian", "bookworm-slim", None),
    ("ghcr.io/org/img:1.0", "ghcr.io", "org/img", "1.0", None),
    ("127.0.0.1:5000/a/b", "127.0.0.1:5000", "a/b", "latest", None),
    ("localhost:5000/x:t", "localhost:5000", "x", "t", None),
    ("user/repo", "docker.io", "user/repo", "latest", None),
    ("r.io/x@sha256:" + "a" * 64, "r.io", "x", None, "sha256:" + "a" * 64),
])
def test_parse_reference(text: str, registry: str, repo: str, tag: str | None, digest: str | None) -> None:
    r = parse_reference(text)
    assert (r.registry, r.repository, r.tag, r.digest) == (registry, repo, tag, digest)
    assert parse_reference(str(r)) == r


@pytest.mark.parametrize("text", ["", "UPPER/case", "a//b", "x:bad tag", "x@sha256:short", "x@md5:" + "a" * 32])
def test_parse_reference_rejects(text: str) -> None:
    with pytest.raises(BadReferenceError):
        parse_reference(text)


def test_docker_hub_api_host() -> None:
    assert parse_reference("alpine").api_host == "registry-1.docker.io"
    assert parse_reference("127.0.0.1:5000/x").api_host == "127.0.0.1:5000"


# --- layer unpacking -------------------------------------------------------------------------------
@needs_root
def test_layers_whiteout_opaque_and_replace(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    apply(root, [D("etc"), F("etc/keep", "k"), F("etc/gone", "g"), D("opq"), F("opq/old1", "1"),
                 D("opq/sub"), F("opq/sub/old2", "2"), F("file-then-dir", "x"), D("dir-then-file"),
                 F("dir-then-file/inner", "i")])
    apply(root, [F("etc/.wh.gone"), D("opq"), F("opq/.wh..wh..opq"), F("opq/new", "n"), D("file-then-dir"),
                 F("file-then-dir/child", "c"), F("dir-then-file", "now a file"), F("etc/keep", "k2")], gz=True)
    assert not (root / "etc/gone").exists()
    assert (root / "etc/keep").read_text() == "k2"
    assert sorted(os.listdir(root / "opq")) == ["new"]  # lower children hidden, this layer's kept
    assert (root / "file-then-dir/child").read_text() == "c"
    assert (root / "dir-then-file").read_text() == "now a file"
    assert not any(n.startswith(".wh.") for _, dirs, files in os.walk(root) for n in dirs + files)


@needs_root
def test_opaque_marker_after_siblings_keeps_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    apply(root, [D("d"), F("d/lower", "l")])
    apply(root, [D("d"), F("d/a", "a"), D("d/sub"), F("d/sub/b", "b"), F("d/.wh..wh..opq")])
    assert sorted(os.listdir(root / "d")) == ["a", "sub"]
    assert (root / "d/sub/b").read_text() == "b"


@needs_root
def test_whiteout_of_directory_and_missing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    apply(root, [D("a"), D("a/b"), F("a/b/c", "c")])
    apply(root, [F("a/.wh.b"), F("nothere/.wh.x"), F(".wh.nothing")])
    assert os.listdir(root / "a") == []
    assert not (root / "nothere").exists()


@needs_root
def test_hardlinks_symlinks_devices_owner_modes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    apply(root, [D("usr"), D("usr/bin"), F("usr/bin/tool", "#!bin", mode=0o4755, uid=0, gid=0),
                 F("home-file", "mine", mode=0o640, uid=1000, gid=1001), H("usr/bin/tool2", "usr/bin/tool"),
                 L("bin", "usr/bin"), Entry("dev-null", "chr", mode=0o666), Entry("fifo", "fifo", mode=0o600),
                 D("private", mode=0o700, uid=33, gid=33)])
    apply(root, [H("bin/tool3", "usr/bin/tool")])  # hard link from a lower layer, through a symlinked parent
    tool = os.lstat(root / "usr/bin/tool")
    assert stat.S_IMODE(tool.st_mode) == 0o4755  # setuid survives chown
    assert os.lstat(root / "usr/bin/tool2").st_ino == tool.st_ino
    assert os.lstat(root / "usr/bin/tool3").st_ino == tool.st_ino  # landed in usr/bin via the bin symlink
    assert tool.st_nlink == 3
    assert os.readlink(root / "bin") == "usr/bin"
    home = os.lstat(root / "home-file")
    assert (home.st_uid, home.st_gid, stat.S_IMODE(home.st_mode)) == (1000, 1001, 0o640)
    priv = os.lstat(root / "private")
    assert (priv.st_uid, stat.S_IMODE(priv.st_mode)) == (33, 0o700)
    assert not os.path.lexists(root / "dev-null")  # device nodes are skipped
    assert stat.S_ISFIFO(os.lstat(root / "fifo").st_mode)
    assert tool.st_mtime == 1700000000


@needs_root
def test_parent_symlink_followed_inside_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    apply(root, [D("usr"), D("usr/lib"), L("lib", "/usr/lib"), L("lib64", "usr/lib")])
    apply(root, [F("lib/a.so", "a"), F("lib64/b.so", "b")])
    assert (root / "usr/lib/a.so").read_text() == "a"  # absolute symlink target is root-relative
    assert (root / "usr/lib/b.so").read_text() == "b"


@pytest.mark.parametrize("entries", [
    [F("../escape", "x")],
    [F("/abs/file", "x")],
    [F("a/../../escape", "x")],
    [L("evil", "../../../.."), F("evil/escape", "x")],
    [D("d"), L("d/up", "../.."), F("d/up/escape", "x")],
    [H("link", "../outside-target")],
    [F(".wh...", "")],
])
def test_traversal_rejected(tmp_path: Path, entries: list[Entry]) -> None:
    root = tmp_path / "a" / "b" / "root"
    root.mkdir(parents=True)
    (tmp_path / "outside-target").write_text("secret")
    with pytest.raises(UnsafePathError):
        apply(root, entries)
    assert not any(p.name == "escape" for p in tmp_path.rglob("*"))


def test_symlink_escape_via_whiteout_rejected(tmp_path: Path) -> None:
    root = tmp_path / "r" / "root"
    root.mkdir(parents=True)
    (tmp_path / "r" / "victim").write_text("v")
    apply(root, [L("up", "../..")])
    with pytest.raises(UnsafePathError):
        apply(root, [F("up/r/.wh.victim")])
    assert (tmp_path / "r" / "victim").exists()


def test_symlink_loop_rejected(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    apply(root, [L("a", "b"), L("b", "a")])
    with pytest.raises(UnsafePathError):
        apply(root, [F("a/x", "x")])


def test_diff_id_mismatch_rejected(tmp_path: Path) -> None:
    import io

    root = tmp_path / "root"
    root.mkdir()
    tar = layer_tar([F("x", "1")])
    with pytest.raises(DigestError):
        apply_layer(root, io.BytesIO(tar), diff_id=sha(b"something else"))  # type: ignore[arg-type]


def test_zstd_layer_without_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)  # a host where the module is missing: import fails
    with pytest.raises(UnsupportedError, match="zstandard"):
        apply_layer(tmp_path, io.BytesIO(b"\x28\xb5\x2f\xfd" + b"\0" * 100))  # type: ignore[arg-type]


def test_zstd_layer(tmp_path: Path) -> None:
    import io

    import zstandard

    tar = layer_tar([F("z", "zstd data")])
    blob = zstandard.ZstdCompressor().compress(tar)
    apply_layer(tmp_path, io.BytesIO(blob), diff_id=sha(tar))  # type: ignore[arg-type]
    assert (tmp_path / "z").read_text() == "zstd data"


def test_garbage_layer_is_format_error(tmp_path: Path) -> None:
    import io

    with pytest.raises(FormatError):
        apply_layer(tmp_path, io.BytesIO(gzip.compress(b"not a tar" * 100)))  # type: ignore[arg-type]


# --- image config -----------------------------------------------------------------------------------
def test_parse_config_exec_defaults() -> None:
    cfg = parse_config(json.dumps({"architecture": "amd64", "os": "linux", "config": {
        "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "EMPTY="], "WorkingDir": "/app", "User": "1000:1000",
        "Entrypoint": ["/entry"], "Cmd": ["serve", "--port=1"], "Labels": {"a": "b"}},
        "rootfs": {"type": "layers", "diff_ids": []}}).encode())
    assert cfg.env == (("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8"), ("EMPTY", ""))
    assert (cfg.working_dir, cfg.user, cfg.entrypoint, cfg.cmd) == ("/app", "1000:1000", ("/entry",),
                                                                    ("serve", "--port=1"))
    assert cfg.labels == (("a", "b"),)


@pytest.mark.parametrize("bad", [b"[]", b"{", json.dumps({"config": {"Env": ["NOEQUALS"]}}).encode(),
                                 json.dumps({"config": {"Cmd": "string"}}).encode()])
def test_parse_config_rejects(bad: bytes) -> None:
    with pytest.raises(FormatError):
        parse_config(bad)


# --- import + store --------------------------------------------------------------------------------
def test_import_layout_and_archive_verify(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "1")], [F("b", "2")]])
    store = OciStore(tmp_path / "store")
    d1 = import_layout_dir(store, write_layout(built, tmp_path / "layout"))
    d2 = import_archive(store, write_oci_archive(built, tmp_path / "img.tar"))
    assert d1 == d2 == built.manifest_digest
    for digest, data in built.blobs.items():
        assert store.blob_path(digest).read_bytes() == data


def test_tampered_blob_rejected(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "1" * 1000)]])
    layout = write_layout(built, tmp_path / "layout")
    layer = layout / "blobs/sha256" / built.layer_digests[0].split(":")[1]
    data = bytearray(layer.read_bytes())
    data[-10] ^= 0xFF
    layer.write_bytes(bytes(data))
    store = OciStore(tmp_path / "store")
    with pytest.raises(DigestError):
        import_layout_dir(store, layout)
    assert not store.blob_path(built.layer_digests[0]).exists()
    assert list((store.root / "tmp").iterdir()) == []  # the bad partial download was discarded


def test_truncated_blob_rejected(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "x")]])
    layout = write_layout(built, tmp_path / "layout")
    (layout / "blobs/sha256" / built.config_digest.split(":")[1]).write_bytes(b"{}")
    with pytest.raises(DigestError):
        import_layout_dir(OciStore(tmp_path / "store"), layout)


def test_manifest_list_picks_linux_amd64(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "1")]], as_index=True, extra_platforms=(("linux", "arm64"), ("windows", "amd64")))
    store = OciStore(tmp_path / "store")
    assert import_layout_dir(store, write_layout(built, tmp_path / "layout")) == built.manifest_digest


def test_manifest_list_without_amd64(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "1")]], as_index=True, extra_platforms=(("linux", "arm64"),))
    index_digest = built.index["manifests"][0]["digest"]  # type: ignore[index]
    inner = json.loads(built.blobs[index_digest])
    inner["manifests"] = [m for m in inner["manifests"] if m["platform"]["architecture"] != "amd64"]
    inner_bytes = json.dumps(inner).encode()
    built.blobs[sha(inner_bytes)] = inner_bytes
    built.index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.index.v1+json",
                                                      "digest": sha(inner_bytes), "size": len(inner_bytes)}]}
    with pytest.raises(PlatformError, match="linux/arm64"):
        import_layout_dir(OciStore(tmp_path / "store"), write_layout(built, tmp_path / "layout"))


def test_layout_tag_selection(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "1")]], ref_name="v1")
    layout = write_layout(built, tmp_path / "layout")
    store = OciStore(tmp_path / "store")
    assert import_layout_dir(store, layout, "v1") == built.manifest_digest
    with pytest.raises(FormatError, match="v2"):
        import_layout_dir(store, layout, "v2")


def test_docker_save_import(tmp_path: Path) -> None:
    path = write_docker_save([[F("a", "1")], [F(".wh.a"), F("b", "2")]], tmp_path / "save.tar",
                             config={"Env": ["X=1"]})
    store = OciStore(tmp_path / "store")
    digest = import_archive(store, path)
    tree = tmp_path / "tree"
    tree.mkdir()
    from smold.oci.build import load_manifest, unpack_into

    meta = unpack_into(store, load_manifest(store, digest), tree)
    assert sorted(os.listdir(tree)) == ["b"]
    assert meta["config"]["env"] == [["X", "1"]]  # type: ignore[index]


def test_docker_save_layer_diff_id_mismatch(tmp_path: Path) -> None:
    import io
    import tarfile

    path = write_docker_save([[F("a", "1")]], tmp_path / "save.tar")
    out = tmp_path / "tampered.tar"
    with tarfile.open(path) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()  # type: ignore[union-attr]
            if m.name.endswith("layer.tar"):
                data = layer_tar([F("a", "2")])
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    with pytest.raises(DigestError):
        import_archive(OciStore(tmp_path / "store"), out)


def test_not_an_image(tmp_path: Path) -> None:
    (tmp_path / "x.tar").write_bytes(b"junk")
    with pytest.raises(FormatError):
        import_archive(OciStore(tmp_path / "store"), tmp_path / "x.tar")
    (tmp_path / "dir").mkdir()
    with pytest.raises(FormatError):
        import_layout_dir(OciStore(tmp_path / "store"), tmp_path / "dir")


def test_corrupt_cached_blob_detected_at_build(tmp_path: Path) -> None:
    built = build_blobs([[F("a", "1" * 5000)]])
    store = OciStore(tmp_path / "store")
    digest = import_layout_dir(store, write_layout(built, tmp_path / "layout"))
    blob = store.blob_path(built.layer_digests[0])
    blob.write_bytes(gzip.compress(layer_tar([F("a", "evil")])))
    with pytest.raises(DigestError):
        build_image(store, digest, version="t", inject=False)
    assert not blob.exists()  # dropped, so the next pull refetches it
    assert store.images() == []


def test_ensure_blob_resumes_partial(tmp_path: Path) -> None:
    store = OciStore(tmp_path / "store")
    data = os.urandom(10000)
    desc = Descriptor("", sha256_bytes(data), len(data))
    (store.root / "tmp" / f"{desc.digest.split(':')[1]}.partial").write_bytes(data[:4000])
    calls: list[int] = []

    def fetch(d: Descriptor, out: BinaryIO, offset: int) -> None:
        calls.append(offset)
        out.seek(offset)
        out.write(data[offset:])

    assert store.ensure_blob(desc, fetch).read_bytes() == data
    assert calls == [4000]


def test_ensure_blob_concurrent_fetches_once(tmp_path: Path) -> None:
    store = OciStore(tmp_path / "store")
    data = os.urandom(1 << 16)
    desc = Descriptor("", sha256_bytes(data), len(data))
    calls: list[int] = []
    gate = threading.Event()

    def fetch(d: Descriptor, out: BinaryIO, offset: int) -> None:
        calls.append(offset)
        gate.wait(5)
        out.write(data)

    threads = [threading.Thread(target=store.ensure_blob, args=(desc, fetch)) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert calls == [0]
    assert store.blob_path(desc.digest).read_bytes() == data


def test_publish_image_concurrent_builds_once(tmp_path: Path) -> None:
    store = OciStore(tmp_path / "store")
    builds: list[int] = []
    digest = "sha256:" + "b" * 64

    def build(out: Path, work: Path) -> dict[str, object]:
        builds.append(1)
        (out / "rootfs.ext4").write_bytes(b"disk")
        return {}

    threads = [threading.Thread(target=store.publish_image, args=(digest, "1", build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [1]
    img = store.get_image(digest, "1")
    assert img is not None and img.meta["rootfs_digest"] == sha256_bytes(b"disk")


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    store = OciStore(tmp_path / "store")

    def build(out: Path, work: Path) -> dict[str, object]:
        (out / "rootfs.ext4").write_bytes(b"half")
        raise RuntimeError("mkfs died")

    with pytest.raises(RuntimeError):
        store.publish_image("sha256:" + "c" * 64, "1", build)
    assert store.images() == [] and list((store.root / "tmp").iterdir()) == []


def _debugfs(image: Path, cmd: str) -> str:
    return subprocess.run(["debugfs", "-R", cmd, str(image)], capture_output=True, text=True, check=True).stdout


@needs_root
@pytest.mark.skipif(shutil.which("mkfs.ext4") is None or shutil.which("debugfs") is None, reason="e2fsprogs")
def test_import_builds_ext4_with_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = build_blobs([[D("etc"), F("etc/deleted", "x"), F("etc/kept", "k", mode=0o600, uid=7, gid=8),
                          D("bin"), F("bin/sh", "#!", mode=0o755), H("bin/sh2", "bin/sh")],
                         [F("etc/.wh.deleted")]],
                        config={"Env": ["FOO=bar"], "WorkingDir": "/work", "User": "7"})
    layout = write_layout(built, tmp_path / "layout")
    store = OciStore(tmp_path / "store")
    r = oci_images.import_local(store, str(layout))
    assert r.manifest == built.manifest_digest and r.spec == f"oci:{layout}"
    assert r.config.env == (("FOO", "bar"),) and r.config.working_dir == "/work" and r.config.user == "7"
    etc = _debugfs(r.rootfs, "ls -l /etc")
    assert "kept" in etc and "deleted" not in etc
    stat_kept = _debugfs(r.rootfs, "stat /etc/kept")
    assert "User:     7" in stat_kept and "Group:     8" in stat_kept and "Mode:  0600" in stat_kept
    assert "Links: 2" in _debugfs(r.rootfs, "stat /bin/sh")
    assert "python3" in _debugfs(r.rootfs, "ls /.smol/runtime/bin")
    subprocess.run(["e2fsck", "-f", "-n", str(r.rootfs)], check=True, capture_output=True)
    # Re-import: served from the cache (same directory, not rebuilt).
    mtime = r.rootfs.stat().st_mtime_ns
    assert oci_images.import_local(store, str(layout)).rootfs.stat().st_mtime_ns == mtime
    entries = oci_images.list_images(store)
    assert [e.names for e in entries] == [(f"oci:{layout}",)]
    # rm drops the name; prune then deletes the image and every blob.
    assert oci_images.remove(store, f"oci:{layout}") == [f"oci:{layout}"]
    removed, freed = oci_images.prune(store)
    assert built.manifest_digest in removed and freed > 0
    assert store.images() == [] and store.blobs() == []
    with pytest.raises(ImageNotCachedError):
        oci_images.remove(store, f"oci:{layout}")


def test_prune_keeps_named_images(tmp_path: Path) -> None:
    a = build_blobs([[F("a", "1")]])
    b = build_blobs([[F("b", "2")]])
    store = OciStore(tmp_path / "store")
    da = import_layout_dir(store, write_layout(a, tmp_path / "la"))
    import_layout_dir(store, write_layout(b, tmp_path / "lb"))
    store.set_ref("keep", da)
    removed, _ = oci_images.prune(store)
    assert {d for d, _ in store.blobs()} == set(a.blobs)
    assert set(b.blobs) <= set(removed)


def test_parse_challenge() -> None:
    scheme, params = parse_challenge('Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull"')
    assert scheme == "bearer"
    assert params == {"realm": "https://auth.example/token", "service": "reg", "scope": "repository:a/b:pull"}


def test_a_decompression_bomb_stops_at_the_images_cap(tmp_path: Path) -> None:
    """Issue #19 (8): a layer that is small compressed and huge unpacked (here 32 MiB of zeros in 32 KiB of gzip,
    about 1000:1) stops being read at the image's cap, with little of it written; the cap and the entry count
    are the image's, across its layers."""
    import gzip
    import io

    from smold.oci.unpack import MAX_IMAGE_UNPACKED_BYTES, UnpackBudget

    bomb_tar = layer_tar([F("zeros", b"\0" * (32 << 20))])
    bomb = gzip.compress(bomb_tar, compresslevel=9)
    assert len(bomb_tar) / len(bomb) > 900
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(FormatError, match=r"unpack to more than 4194304 bytes"):
        apply_layer(root, io.BytesIO(bomb), budget=UnpackBudget(max_bytes=4 << 20))  # type: ignore[arg-type]
    written = (root / "zeros").stat().st_size if (root / "zeros").exists() else 0
    assert written <= 4 << 20
    # the same layer fits the default cap; two layers share one budget
    budget = UnpackBudget(max_bytes=48 << 20)
    apply_layer(root, io.BytesIO(bomb), budget=budget)  # type: ignore[arg-type]
    assert (root / "zeros").stat().st_size == 32 << 20 and MAX_IMAGE_UNPACKED_BYTES >= 16 << 30
    with pytest.raises(FormatError, match="unpack to more than"):
        apply_layer(root, io.BytesIO(bomb), budget=budget)  # type: ignore[arg-type]
    many = layer_tar([F(f"f{i}", "") for i in range(50)])
    with pytest.raises(FormatError, match="more than 20 entries"):
        apply_layer(root, io.BytesIO(many), budget=UnpackBudget(max_entries=20))  # type: ignore[arg-type]


def test_a_sparse_member_is_charged_for_the_zeros_it_unpacks_to(tmp_path: Path) -> None:
    """A GNU sparse member's holes come out of tarfile as zeros the stream never carried (64 MiB from a few
    KiB): the image's budget is charged its full size, so a layer of such members cannot get past the cap."""
    import io

    from oci_support import sparse_tar

    from smold.oci.unpack import UnpackBudget

    layer = sparse_tar(tmp_path / "src")
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(FormatError, match="unpack to more than"):
        apply_layer(root, io.BytesIO(layer), budget=UnpackBudget(max_bytes=16 << 20))  # type: ignore[arg-type]
    assert not (root / "holes").exists()
