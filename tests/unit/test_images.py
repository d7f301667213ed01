"""Unit tests for the guest-artifact pipeline (no KVM, no kernel/rootfs build)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from smold.images import cache, cpio, initramfs, kconfig, kernel, rootfs
from smold.images.artifacts import ArtifactMissingError, resolve
from smold.images.cache import ArtifactCache, CacheError, content_key, tree_digest
from smold.images.cpio import Archive, CpioError
from smold.images.initramfs import InitramfsError, InitramfsInputs
from smold.images.kconfig import KconfigError
from smold.images.kernel import KernelInputs
from smold.images.proc import CommandError, run
from smold.images.rootfs import RootfsInputs

REPO = Path(__file__).resolve().parents[2]


def _static_busybox() -> Path:
    bb = Path("/bin/busybox")
    if not bb.is_file():
        pytest.skip("busybox-static not installed")
    try:
        initramfs._require_static_elf(bb)
    except InitramfsError:
        pytest.skip("/bin/busybox is not the static build")
    return bb


# --- cache keys --------------------------------------------------------------------------------

def test_content_key_is_stable_and_framed() -> None:
    assert content_key({"a": "x", "b": b"y"}) == content_key({"b": b"y", "a": "x"})
    assert content_key({"a": "x"}) != content_key({"a": "y"})
    assert content_key({"a": "bc"}) != content_key({"ab": "c"})


def test_kernel_key_tracks_fragment_and_versions(tmp_path: Path) -> None:
    frag = tmp_path / "microvm.config"
    frag.write_text("CONFIG_VIRTIO=y\n")
    tarball = tmp_path / "linux.tar.xz"
    tarball.write_bytes(b"src")
    base = KernelInputs(frag, tarball, {"gcc-12": "12.2"})
    k0 = base.key()
    assert KernelInputs(frag, tarball, {"gcc-12": "12.2"}).key() == k0
    os.utime(frag, (0, 0))  # touching is not a change
    assert base.key() == k0
    assert KernelInputs(frag, tarball, {"gcc-12": "12.3"}).key() != k0
    frag.write_text("CONFIG_VIRTIO=y\nCONFIG_VIRTIO_BLK=y\n")
    k1 = base.key()
    assert k1 != k0
    tarball.write_bytes(b"other source")
    assert base.key() != k1


def _initramfs_inputs(tmp_path: Path, busybox: Path | None = None) -> InitramfsInputs:
    init_dir = tmp_path / "init"
    if not init_dir.exists():
        shutil.copytree(REPO / "guest-agent" / "init", init_dir)
    agent = tmp_path / "smol_agent"
    if not agent.exists():
        (agent / "sub").mkdir(parents=True)
        (agent / "__init__.py").write_text('"""agent"""\n')
        (agent / "__main__.py").write_text("print('hi')\n")
        (agent / "sub" / "__init__.py").write_text("")
        (agent / "sub" / "data.txt").write_text("payload\n")
    if busybox is None:
        busybox = tmp_path / "busybox"
        if not busybox.exists():
            busybox.write_bytes(b"fake busybox")
    return InitramfsInputs(init_dir, agent, busybox, {"busybox-static": "1.35"})


def test_initramfs_key_tracks_agent_init_and_busybox(tmp_path: Path) -> None:
    inputs = _initramfs_inputs(tmp_path)
    k0 = inputs.key()
    assert _initramfs_inputs(tmp_path).key() == k0
    pycache = inputs.agent_dir / "__pycache__"
    pycache.mkdir()
    (pycache / "x.cpython-311.pyc").write_bytes(b"\0")
    assert inputs.key() == k0, "bytecode litter must not change the key"

    (inputs.agent_dir / "sub" / "data.txt").write_text("changed\n")
    k1 = inputs.key()
    assert k1 != k0
    (inputs.agent_dir / "new.py").write_text("")
    k2 = inputs.key()
    assert k2 != k1
    os.chmod(inputs.agent_dir / "new.py", 0o755)
    k3 = inputs.key()
    assert k3 != k2
    (inputs.init_dir / "init").write_text((inputs.init_dir / "init").read_text() + "# edit\n")
    k4 = inputs.key()
    assert k4 != k3
    inputs.busybox.write_bytes(b"other busybox")
    k5 = inputs.key()
    assert k5 != k4
    assert InitramfsInputs(inputs.init_dir, inputs.agent_dir, inputs.busybox, {"busybox-static": "1.36"}).key() != k5


def test_rootfs_key_tracks_packages_and_tools() -> None:
    base = RootfsInputs(versions={"debootstrap": "1.0.128"})
    assert RootfsInputs(versions={"debootstrap": "1.0.128"}).key() == base.key()
    assert RootfsInputs(packages=(*base.packages, "git"), versions=base.versions).key() != base.key()
    assert RootfsInputs(mirror="http://mirror.example/debian", versions=base.versions).key() != base.key()
    assert RootfsInputs(versions={"debootstrap": "1.0.129"}).key() != base.key()


def test_tree_digest_sees_symlink_targets(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    os.symlink("f", tmp_path / "l")
    d0 = tree_digest(tmp_path)
    os.unlink(tmp_path / "l")
    os.symlink("g", tmp_path / "l")
    assert tree_digest(tmp_path) != d0


# --- atomic publishing ---------------------------------------------------------------------------

def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name not in (".locks", "logs"))


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)

    def broken(out: Path, work: Path, log: Path) -> None:
        (out / "vmlinux").write_bytes(b"half a kernel")
        (work / "scratch").write_bytes(b"x")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        c.publish("kernel", "k1", "vmlinux", broken)
    assert c.lookup("kernel", "k1", "vmlinux") is None
    assert _leftovers(tmp_path) == []


def test_builder_that_writes_nothing_is_an_error(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    with pytest.raises(CacheError, match="did not produce"):
        c.publish("rootfs", "k", "rootfs.ext4", lambda out, work, log: None)
    assert _leftovers(tmp_path) == []


def test_publish_then_warm_hit_then_force(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    calls: list[int] = []

    def build(out: Path, work: Path, log: Path) -> None:
        calls.append(1)
        (work / "big-scratch").write_bytes(b"0" * 1000)
        (out / "initramfs.cpio").write_bytes(b"build %d" % len(calls))

    p = c.publish("initramfs", "abc", "initramfs.cpio", build, manifest={"x": "1"})
    assert p == tmp_path / "initramfs-abc" / "initramfs.cpio"
    assert p.read_bytes() == b"build 1"
    assert (p.parent / "manifest.json").is_file()
    assert not (p.parent / "big-scratch").exists()
    assert c.publish("initramfs", "abc", "initramfs.cpio", build) == p
    assert len(calls) == 1, "warm cache must not rebuild"
    c.publish("initramfs", "abc", "initramfs.cpio", build, force=True)
    assert len(calls) == 2 and p.read_bytes() == b"build 2"
    assert _leftovers(tmp_path) == ["initramfs-abc"]


def test_lookup_ignores_directory_without_manifest(tmp_path: Path) -> None:
    d = tmp_path / "kernel-k"
    d.mkdir()
    (d / "vmlinux").write_bytes(b"?")
    assert ArtifactCache(tmp_path).lookup("kernel", "k", "vmlinux") is None


def test_crashed_build_leftovers_are_swept(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-kernel-k-dead"
    (stale / "out").mkdir(parents=True)
    c = ArtifactCache(tmp_path)
    c.publish("kernel", "k", "vmlinux", lambda out, work, log: (out / "vmlinux").write_bytes(b"elf"))
    assert not stale.exists()


def test_cache_root_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "c"))
    assert cache.default_cache_root() == tmp_path / "c"
    monkeypatch.delenv(cache.CACHE_ENV)
    assert cache.default_cache_root() == Path.home() / ".cache" / "smol"


# --- kernel config verification ---------------------------------------------------------------

FRAGMENT = """\
# comment
CONFIG_VIRTIO_MMIO=y
CONFIG_NR_CPUS=32
# CONFIG_ACPI is not set
"""


def test_verify_accepts_config_that_honours_fragment() -> None:
    req = kconfig.parse_fragment(FRAGMENT)
    kconfig.verify_config(req, "CONFIG_VIRTIO_MMIO=y\nCONFIG_NR_CPUS=32\n# CONFIG_ACPI is not set\nCONFIG_X=y\n")
    kconfig.verify_config(req, "CONFIG_VIRTIO_MMIO=y\nCONFIG_NR_CPUS=32\n")  # absent == not set


@pytest.mark.parametrize("config, culprit", [
    ("CONFIG_NR_CPUS=32\n# CONFIG_ACPI is not set\n", "CONFIG_VIRTIO_MMIO"),
    ("# CONFIG_VIRTIO_MMIO is not set\nCONFIG_NR_CPUS=32\n", "CONFIG_VIRTIO_MMIO"),
    ("CONFIG_VIRTIO_MMIO=y\nCONFIG_NR_CPUS=8\n", "CONFIG_NR_CPUS"),
    ("CONFIG_VIRTIO_MMIO=y\nCONFIG_NR_CPUS=32\nCONFIG_ACPI=y\n", "CONFIG_ACPI"),
])
def test_verify_rejects_missing_or_changed_option(config: str, culprit: str) -> None:
    with pytest.raises(KconfigError, match=culprit):
        kconfig.verify_config(kconfig.parse_fragment(FRAGMENT), config)


@pytest.mark.parametrize("text, msg", [
    ("CONFIG_A=y\nCONFIG_A=n\n", "twice"),
    ("CONFIG_A=m\n", "no modules"),
    ("VIRTIO=y\n", "not a Kconfig line"),
    ("# only comments\n", "no options"),
])
def test_fragment_parser_is_strict(text: str, msg: str) -> None:
    with pytest.raises(KconfigError, match=msg):
        kconfig.parse_fragment(text)


def test_repository_fragment_requests_the_microvm_essentials() -> None:
    req = kconfig.load_fragment(kernel.FRAGMENT)
    for name in ("CONFIG_64BIT", "CONFIG_SMP", "CONFIG_X86_MPPARSE", "CONFIG_KVM_GUEST", "CONFIG_SERIAL_8250_CONSOLE",
                 "CONFIG_BLK_DEV_INITRD", "CONFIG_DEVTMPFS_MOUNT", "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES",
                 "CONFIG_VIRTIO_BLK", "CONFIG_VIRTIO_VSOCKETS", "CONFIG_HW_RANDOM_VIRTIO", "CONFIG_EXT4_FS",
                 "CONFIG_OVERLAY_FS", "CONFIG_TMPFS_XATTR", "CONFIG_UNIX", "CONFIG_INET"):
        assert req.get(name) == "y", name
    for name in ("CONFIG_ACPI", "CONFIG_PCI", "CONFIG_MODULES"):
        assert name in req and req[name] is None, name


# --- cpio ---------------------------------------------------------------------------------------

def _parse_newc(data: bytes) -> list[dict[str, object]]:
    """Independent minimal newc reader used to check header fields."""
    out, off = [], 0
    while True:
        assert data[off:off + 6] == b"070701", f"bad magic at {off}"
        f = [int(data[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        namesize, filesize = f[11], f[6]
        name = data[off + 110: off + 110 + namesize - 1].decode()
        off = (off + 110 + namesize + 3) & ~3
        body = data[off: off + filesize]
        off = (off + filesize + 3) & ~3
        if name == "TRAILER!!!":
            assert not data[off:].strip(b"\0")
            return out
        out.append({"name": name, "ino": f[0], "mode": f[1], "uid": f[2], "gid": f[3], "mtime": f[5],
                    "rdev": (f[9], f[10]), "data": body})


def _sample_archive() -> Archive:
    a = Archive(mtime=1234)
    a.add_dirs("smol/pkg/sub")
    a.add_file("smol/pkg/sub/mod.py", b"x = 1\n")
    a.add_file("smol/pkg/__init__.py", b"")
    a.add_file("init", b"#!/bin/sh\necho hi\n", 0o755)
    a.add_dir("bin")
    a.add_file("bin/busybox", b"\x7fELF....", 0o755)
    a.add_symlink("bin/sh", "busybox")
    a.add_dir("dev")
    a.add_chardev("dev/console", 5, 1)
    return a


EXPECTED = ["bin", "bin/busybox", "bin/sh", "dev", "dev/console", "init", "smol", "smol/pkg",
            "smol/pkg/__init__.py", "smol/pkg/sub", "smol/pkg/sub/mod.py"]


def test_cpio_listing_by_gnu_cpio(tmp_path: Path) -> None:
    if shutil.which("cpio") is None:
        pytest.skip("cpio not installed")
    data = _sample_archive().to_bytes()
    assert len(data) % 512 == 0
    listing = subprocess.run(["cpio", "-t", "--quiet"], input=data, capture_output=True, check=True)
    assert listing.stdout.decode().splitlines() == EXPECTED
    dest = tmp_path / "x"
    dest.mkdir()
    # Extract everything but the device node (mknod needs privileges we may not have).
    subprocess.run(["cpio", "-idm", "--quiet", "--no-absolute-filenames", "-f", "dev/console"], input=data,
                   cwd=dest, check=True)
    assert (dest / "smol/pkg/sub/mod.py").read_bytes() == b"x = 1\n"
    assert os.readlink(dest / "bin/sh") == "busybox"
    assert stat.S_IMODE((dest / "init").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "smol/pkg/__init__.py").stat().st_mode) == 0o644
    assert (dest / "init").stat().st_mtime == 1234


def test_cpio_listing_by_busybox(tmp_path: Path) -> None:
    bb = _static_busybox()
    data = _sample_archive().to_bytes()
    listing = subprocess.run([bb, "cpio", "-t"], input=data, capture_output=True, check=True)
    assert [line for line in listing.stdout.decode().splitlines() if line] == EXPECTED


def test_cpio_headers_are_deterministic() -> None:
    a, b = _sample_archive().to_bytes(), _sample_archive().to_bytes()
    assert a == b
    members = _parse_newc(a)
    assert [m["name"] for m in members] == EXPECTED
    assert {m["uid"] for m in members} == {0} and {m["gid"] for m in members} == {0}
    assert {m["mtime"] for m in members} == {1234}
    assert [m["ino"] for m in members] == list(range(1, len(EXPECTED) + 1))
    console = next(m for m in members if m["name"] == "dev/console")
    assert stat.S_ISCHR(int(console["mode"])) and console["rdev"] == (5, 1)  # type: ignore[call-overload]
    sh = next(m for m in members if m["name"] == "bin/sh")
    assert stat.S_ISLNK(int(sh["mode"])) and sh["data"] == b"busybox"  # type: ignore[call-overload]


def test_cpio_rejects_bad_entries() -> None:
    a = Archive()
    with pytest.raises(CpioError, match="invalid"):
        a.add_file("../etc/passwd", b"")
    with pytest.raises(CpioError, match="invalid"):
        a.add_file("a//b", b"")
    a.add_file("x", b"1")
    with pytest.raises(CpioError, match="duplicate"):
        a.add_file("/x", b"2")
    a.add_file("orphan/child", b"")
    with pytest.raises(CpioError, match="no parent"):
        a.to_bytes()


# --- initramfs -----------------------------------------------------------------------------------

def test_initramfs_contains_init_busybox_and_agent(tmp_path: Path) -> None:
    if shutil.which("cpio") is None:
        pytest.skip("cpio not installed")
    inputs = _initramfs_inputs(tmp_path, _static_busybox())
    out = tmp_path / "out"
    out.mkdir()
    initramfs.build_initramfs(inputs, out, tmp_path, tmp_path / "log")
    data = (out / initramfs.FILENAME).read_bytes()
    names = subprocess.run(["cpio", "-t", "--quiet"], input=data, capture_output=True,
                           check=True).stdout.decode().splitlines()
    for needed in ("init", "bin/busybox", "bin/sh", "bin/switch_root", "bin/mount", "dev/console",
                   "smol/poweroff", "smol/smol_agent/__init__.py", "smol/smol_agent/__main__.py",
                   "smol/smol_agent/sub/data.txt", "proc", "sys", "newroot"):
        assert needed in names, needed
    members = {str(m["name"]): m for m in _parse_newc(data)}
    assert members["init"]["data"] == (inputs.init_dir / "init").read_bytes()
    assert members["smol/smol_agent/sub/data.txt"]["data"] == b"payload\n"
    assert stat.S_IMODE(int(members["init"]["mode"])) == 0o755  # type: ignore[call-overload]
    # Deterministic: the same inputs give the same bytes.
    initramfs.build_initramfs(inputs, out, tmp_path, tmp_path / "log")
    assert (out / initramfs.FILENAME).read_bytes() == data


def test_initramfs_rejects_dynamic_busybox(tmp_path: Path) -> None:
    inputs = _initramfs_inputs(tmp_path, Path("/bin/ls"))
    with pytest.raises(InitramfsError, match="dynamically linked"):
        initramfs.make_archive(inputs)


def test_initramfs_rejects_agent_dir_that_is_not_a_package(tmp_path: Path) -> None:
    inputs = _initramfs_inputs(tmp_path)
    (inputs.agent_dir / "__init__.py").unlink()
    with pytest.raises(InitramfsError, match="not a Python package"):
        initramfs.make_archive(inputs)


def test_init_scripts_parse() -> None:
    bb = _static_busybox()
    for script in ("init", "poweroff"):
        subprocess.run([bb, "sh", "-n", str(REPO / "guest-agent" / "init" / script)], check=True)


def test_resolve_initramfs_builds_once_then_hits(tmp_path: Path) -> None:
    _static_busybox()
    p = resolve("initramfs", cache_dir=tmp_path)
    assert p.parent.parent == tmp_path and p.name == "initramfs.cpio"
    ino = p.stat().st_ino
    assert resolve("initramfs", cache_dir=tmp_path, build=False) == p
    assert p.stat().st_ino == ino


def test_resolve_without_build_on_cold_cache_raises(tmp_path: Path) -> None:
    with pytest.raises(ArtifactMissingError, match="not in the cache"):
        resolve("kernel", cache_dir=tmp_path, build=False)


# --- subprocess errors ----------------------------------------------------------------------------

def test_command_error_names_command_and_stderr_tail(tmp_path: Path) -> None:
    script = "for i in $(seq 1 100); do echo line$i >&2; done; exit 3"
    with pytest.raises(CommandError) as info:
        run(["sh", "-c", script])
    err = info.value
    assert err.returncode == 3 and "sh -c" in str(err)
    assert "line100" in err.tail and "line1\n" not in err.tail
    with pytest.raises(CommandError) as info2:
        run(["sh", "-c", script], log=tmp_path / "log")
    assert info2.value.log == tmp_path / "log" and "line100" in str(info2.value)


def test_command_error_for_missing_program() -> None:
    with pytest.raises(CommandError, match="could not start"):
        run(["/nonexistent/tool"])


def test_rootfs_image_size_has_headroom() -> None:
    size = rootfs.image_size(300 << 20, 20000)
    assert size >= (300 << 20) * 1.25 and size % (16 << 20) == 0


def test_clamp_mtimes(tmp_path: Path) -> None:
    (tmp_path / "new").write_text("x")
    os.symlink("new", tmp_path / "link")
    old = tmp_path / "old"
    old.write_text("y")
    os.utime(old, (100, 100))
    rootfs.clamp_mtimes(tmp_path, 1000)
    assert (tmp_path / "new").stat().st_mtime == 1000
    assert os.lstat(tmp_path / "link").st_mtime == 1000
    assert old.stat().st_mtime == 100


def test_unused_import_guard() -> None:
    assert cpio.MAGIC == b"070701"
