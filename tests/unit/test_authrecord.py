"""smold/authrecord.py: records written without following links and read back only with the daemon's MAC."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from smold.authrecord import MAX_RECORD_BYTES, RecordAuthError, RecordKey


def test_round_trip_and_what_is_refused(tmp_path: Path) -> None:
    key = RecordKey.generate()
    path = tmp_path / "net.json"
    key.write(path, {"allow": ["10.0.0.0/8"], "n": 3}, "net.json m-1")
    assert key.read(path, "net.json m-1") == {"allow": ["10.0.0.0/8"], "n": 3}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(RecordAuthError, match="does not verify"):
        key.read(path, "net.json m-2")                              # another machine's
    with pytest.raises(RecordAuthError, match="does not verify"):
        RecordKey.generate().read(path, "net.json m-1")             # another daemon's
    forged = path.read_text().replace("10.0.0.0/8", "0.0.0.0/0")
    path.write_text(forged)
    with pytest.raises(RecordAuthError, match="does not verify"):
        key.read(path, "net.json m-1")
    with pytest.raises(ValueError, match="'mac' field"):
        key.write(path, {"mac": "x"}, "p")


def test_links_and_odd_files_are_never_followed(tmp_path: Path) -> None:
    key = RecordKey.generate()
    secret = tmp_path / "shadow"
    secret.write_text("root:secret\n")
    path = tmp_path / "machine.json"
    path.symlink_to(secret)
    with pytest.raises(RecordAuthError):
        key.read(path, "p")                                         # O_NOFOLLOW: the link is not read through
    (tmp_path / ".machine.json.tmp").symlink_to(secret)              # planted where the temp file goes
    key.write(path, {"a": 1}, "p")
    assert secret.read_text() == "root:secret\n"                    # neither link was written through
    assert not path.is_symlink() and key.read(path, "p") == {"a": 1}
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(RecordAuthError, match="not a plain file"):
        key.read(fifo, "p")                                         # O_NONBLOCK: no hang on a FIFO
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    with pytest.raises(RecordAuthError, match="larger than"):
        key.read(big, "p")


def test_the_key_persists_and_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "record.key"
    k1 = RecordKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    k1.write(tmp_path / "r.json", {"x": 1}, "p")
    assert RecordKey.load_or_create(path).read(tmp_path / "r.json", "p") == {"x": 1}   # a restarted daemon's
    path.chmod(0o644)
    with pytest.raises(RecordAuthError, match="only its"):
        RecordKey.load_or_create(path)


def test_a_nesting_bomb_is_refused_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    path.write_text("[" * (MAX_RECORD_BYTES // 2))      # within the size cap, deeper than json's recursion
    with pytest.raises(RecordAuthError, match="nested too deeply|not JSON"):
        RecordKey.generate().read(path, "p")
