"""smolsdk.untar: a guest-made tar archive cannot write outside its destination (issue #19, finding 3)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from smolsdk.untar import UnsafeArchiveError, extract


def archive(*members: tuple[str, str, object]) -> bytes:
    """(kind, name, payload) members: "f" file (bytes), "d" dir, "s" symlink (target), "h" hard link (target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, payload in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "f":
                data = payload if isinstance(payload, bytes) else b""
                info.size, info.mode = len(data), 0o6777   # set-id and world-write bits the unpacker drops
                tar.addfile(info, io.BytesIO(data))
                continue
            if kind == "d":
                info.type, info.mode = tarfile.DIRTYPE, 0o777
            elif kind == "s":
                info.type, info.linkname = tarfile.SYMTYPE, str(payload)
            elif kind == "h":
                info.type, info.linkname = tarfile.LNKTYPE, str(payload)
            elif kind == "c":
                info.type = tarfile.CHRTYPE
            tar.addfile(info)
    return buf.getvalue()


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (outside / "target").write_text("untouched")
    return dest, outside


def test_an_ordinary_tree_round_trips(places: tuple[Path, Path]) -> None:
    dest, _ = places
    n = extract(archive(("d", "logs", None), ("f", "logs/a.txt", b"hello"), ("s", "logs/latest", "a.txt"),
                        ("h", "logs/again.txt", "logs/a.txt"), ("c", "logs/tty", None)), dest)
    assert n == 4
    assert (dest / "logs" / "a.txt").read_bytes() == b"hello" and (dest / "logs" / "again.txt").read_bytes() == b"hello"
    assert os.readlink(dest / "logs" / "latest") == "a.txt" and not (dest / "logs" / "tty").exists()
    mode = stat.S_IMODE((dest / "logs" / "a.txt").stat().st_mode)
    assert mode == 0o755 and (dest / "logs" / "a.txt").stat().st_mtime == 1_700_000_000


@pytest.mark.parametrize("members", [
    # the classic: a symlink to a directory outside, then a file "through" it
    [("s", "link", "OUTSIDE"), ("f", "link/evil", b"x")],
    # a symlink chain (the realpath-based filter's bypasses build these), then a file through it
    [("d", "a", None), ("s", "a/b", "../.."), ("s", "c", "a/b/outside"), ("f", "c/evil", b"x")],
    # names that leave the destination outright
    [("f", "../outside/evil", b"x")],
    [("f", "/tmp/evil-absolute-from-a-guest", b"x")],
    # a hard link to a file outside
    [("h", "copy", "OUTSIDE/target")],
    [("h", "copy", "../outside/target")],
])
def test_nothing_is_written_outside_the_destination(places: tuple[Path, Path], members: list) -> None:
    dest, outside = places
    members = [(k, n, str(p).replace("OUTSIDE", str(outside)) if isinstance(p, str) else p) for k, n, p in members]
    with pytest.raises(UnsafeArchiveError):
        extract(archive(*members), dest)
    assert sorted(p.name for p in outside.iterdir()) == ["target"]
    assert (outside / "target").read_text() == "untouched"
    assert not Path("/tmp/evil-absolute-from-a-guest").exists()


def test_a_file_over_a_symlink_replaces_the_link_never_writes_through_it(places: tuple[Path, Path]) -> None:
    dest, _ = places
    extract(archive(("f", "other", b"orig"), ("s", "s", "other"), ("f", "s", b"mine")), dest)
    assert (dest / "other").read_bytes() == b"orig"
    assert not (dest / "s").is_symlink() and (dest / "s").read_bytes() == b"mine"


def test_a_way_through_any_link_is_refused_even_one_that_stays_inside(places: tuple[Path, Path]) -> None:
    """The unpacker never follows a link, so it needs no resolved path to compare (tarfile's data filter
    compares realpath()s, which its bypasses defeat): a member under a symlink is refused even when the link
    points inside."""
    dest, _ = places
    inside = archive(("d", "real", None), ("s", "alias", "real"), ("f", "alias/x", b"x"))
    with pytest.raises(UnsafeArchiveError, match="'alias'"):
        extract(inside, dest)


@pytest.mark.parametrize("target", ["/etc/shadow", "../../outside/target", "x/../../../y", "/dev/zero"])
def test_a_symlink_that_points_out_is_refused(places: tuple[Path, Path], target: str) -> None:
    """Never followed while unpacking, but a host program reading the tree later would follow it (a reward file
    that is a link to the user's credentials)."""
    dest, _ = places
    with pytest.raises(UnsafeArchiveError, match="symlink"):
        extract(archive(("d", "sub", None), ("s", "sub/link", target)), dest)
    assert not (dest / "sub" / "link").exists() and not (dest / "sub" / "link").is_symlink()


def test_only_plain_tar_and_no_sparse_files(places: tuple[Path, Path], tmp_path: Path) -> None:
    """CopyOut's archives are `tar -c` output: a compressed one (a bomb) is not read, a sparse member (holes that
    unpack to zeros the archive does not carry) is refused."""
    import gzip

    from oci_support import sparse_tar
    dest, _ = places
    with pytest.raises(tarfile.ReadError):
        extract(gzip.compress(archive(("f", "big", b"\0" * (1 << 20)))), dest)
    sparse = sparse_tar(tmp_path / "sparse-src")
    with pytest.raises(UnsafeArchiveError, match="sparse"):
        extract(sparse, dest)


def test_the_destination_itself_may_be_a_symlink(places: tuple[Path, Path], tmp_path: Path) -> None:
    """The destination is the caller's (trusted) choice: a link to a directory is fine; links inside are not."""
    dest, _ = places
    (tmp_path / "via").symlink_to(dest)
    assert extract(archive(("f", "a", b"1")), tmp_path / "via") == 1
    assert (dest / "a").read_bytes() == b"1"
