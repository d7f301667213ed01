"""tests/evidence.py: a failed VM test's daemon logs and consoles are copied to the VM tier's output folder."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evidence import TAIL_BYTES, save_failure_evidence  # noqa: E402


def test_logs_written_during_the_test_are_copied_and_cut(tmp_path: Path) -> None:
    root, out = tmp_path / "tmp", tmp_path / "out"
    mdir = root / "smit-x" / "state" / "machines" / "m-1"
    mdir.mkdir(parents=True)
    (root / "smit-x" / "smold.log").write_bytes(b"a" * (TAIL_BYTES + 10) + b"END")
    (mdir / "console.log").write_text("triple fault\n")
    old = root / "smold-old" / "smold.log"
    old.parent.mkdir()
    old.write_text("before the test")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    saved = save_failure_evidence("tests/integration/test_x.py::test_y[a/b]", time.time() - 60, out=str(out),
                                  root=str(root))
    names = sorted(p.name for p in saved)
    assert names == ["smit-x__smold.log", "smit-x__state__machines__m-1__console.log"]
    d = out / "evidence" / "tests_integration_test_x.py_test_y_a_b_"
    assert (d / "smit-x__smold.log").read_bytes().endswith(b"END")
    assert len((d / "smit-x__smold.log").read_bytes()) == TAIL_BYTES
    assert save_failure_evidence("t", 0, out="", root=str(root)) == []  # outside the VM tier: nothing
