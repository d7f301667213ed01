"""smold.verifier.outputs.repack: a hostile outputs archive from the task's guest becomes a safe one, or an error."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from smold.verifier.outputs import OutputsError, repack

CAP = 1 << 20


def tar_of(*members: tuple[str, str, bytes | str]) -> bytes:
    """(name, kind, data-or-linkname) with kind in file/dir/sym/hard/fifo/dev."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o6755 if kind == "file" else 0o755
            if kind == "file":
                assert isinstance(data, bytes)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                         "fifo": tarfile.FIFOTYPE, "dev": tarfile.CHRTYPE}[kind]
            if kind in ("sym", "hard"):
                assert isinstance(data, str)
                info.linkname = data
            tar.addfile(info)
    return buf.getvalue()


def names(archive: bytes) -> list[tuple[str, str]]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return [(m.name, "dir" if m.isdir() else "sym" if m.issym() else "file") for m in tar]


def test_a_plain_tree_is_kept_with_modes_masked() -> None:
    raw = tar_of(("app", "dir", ""), ("app/solve.py", "file", b"print(1)\n"), ("app/sub", "dir", ""),
                 ("app/sub/out.txt", "file", b"42\n"), ("app/link", "sym", "solve.py"))
    r = repack(raw, ("/app",), cap=CAP)
    assert names(r.archive) == [("app", "dir"), ("app/sub", "dir"), ("app/solve.py", "file"),
                                ("app/sub/out.txt", "file"), ("app/link", "sym")]
    assert r.files == 2 and r.bytes == 12 and r.dropped == {} and r.present == {"/app"}
    with tarfile.open(fileobj=io.BytesIO(r.archive)) as tar:
        assert all(m.mode & 0o7000 == 0 for m in tar)  # no setuid/setgid/sticky reaches the verifier


def test_members_through_a_link_outside_the_outputs_or_special_are_left_out_and_counted() -> None:
    raw = tar_of(
        ("app/l", "sym", "/usr/bin"),
        ("app/l/python3", "file", b"#!/bin/sh\necho pass\n"),      # through the link: never written
        ("app/../etc/ld.so.preload", "file", b"/tmp/evil.so\n"),   # escapes
        ("/etc/passwd", "file", b"root::0:0::/:/bin/sh\n"),        # absolute
        ("usr/bin/pytest", "file", b"exit 0\n"),                   # not a declared output
        ("app/hard", "hard", "app/ok"),
        ("app/fifo", "fifo", ""),
        ("app/dev", "dev", ""),
        ("app/ok", "file", b"fine"),
        ("app/ok", "file", b"second copy"),                        # duplicate name: the first is kept
        ("app/d/x", "file", b"x"),
        ("app/d", "sym", "/etc"),                                  # a link after what it would shadow
    )
    r = repack(raw, ("/app",), cap=CAP)
    assert names(r.archive) == [("app/ok", "file"), ("app/l", "sym"), ("app/d", "sym")]
    assert r.dropped == {"names outside the outputs": 3, "hard links": 1, "devices, fifos and other special files": 2,
                         "duplicate names": 1, "entries below a symbolic link": 2}, r.dropped
    assert "left out" in r.describe()


def test_unreadable_truncated_and_oversized_archives_are_errors() -> None:
    with pytest.raises(OutputsError, match="unreadable"):
        repack(b"this is not a tar archive" * 40, ("/app",), cap=CAP)
    whole = tar_of(("app/big", "file", b"x" * 5000))
    with pytest.raises(OutputsError, match="truncated|unreadable"):
        repack(whole[:1024 + 512], ("/app",), cap=CAP)
    with pytest.raises(OutputsError, match="larger than the cap of 4096 bytes"):
        repack(whole, ("/app",), cap=4096)


def test_missing_outputs_are_reported() -> None:
    r = repack(tar_of(("app/x", "file", b"1")), ("/app", "/logs/agent"), cap=CAP)
    assert r.present == {"/app"}


def test_the_repacked_archive_extracts_with_gnu_tar_inside_the_outputs_only(tmp_path: Path) -> None:
    """What the verifier machine runs (guestops.place_outputs extracts at / with GNU tar), here at a root dir."""
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    raw = tar_of(("app/l", "sym", "../usr/bin"), ("app/l/python3", "file", b"evil"), ("app/x", "file", b"ok"))
    r = repack(raw, ("/app",), cap=CAP)
    (tmp_path / "o.tar").write_bytes(r.archive)
    subprocess.run(["tar", "-x", "-f", str(tmp_path / "o.tar"), "-C", str(root)], check=True)
    assert not (root / "usr" / "bin" / "python3").exists()
    assert (root / "app" / "x").read_bytes() == b"ok" and os.readlink(root / "app" / "l") == "../usr/bin"


def test_a_hard_link_to_a_kept_file_becomes_a_copy_of_it() -> None:
    raw = tar_of(("app/a", "file", b"42\n"), ("app/b", "hard", "app/a"), ("app/c", "hard", "etc/passwd"))
    r = repack(raw, ("/app",), cap=CAP)
    with tarfile.open(fileobj=io.BytesIO(r.archive)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
    assert got == {"app/a": b"42\n", "app/b": b"42\n"} and r.dropped == {"hard links": 1}
    with pytest.raises(OutputsError, match="larger than the cap"):
        repack(tar_of(("app/a", "file", b"x" * 600), ("app/b", "hard", "app/a")), ("/app",), cap=1000)
