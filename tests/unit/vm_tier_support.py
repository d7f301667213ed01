"""A tiny pytest suite for scripts/vm_tier.py's tests: one test dies the way a rig does, once."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VM_TIER = [sys.executable, str(REPO / "scripts" / "vm_tier.py")]

# test_dies ends its process the first time (SMOL_TIER_MARK not there yet; every time with SMOL_TIER_DIE_ALWAYS=1): in the KVM rig it panics the rig's
# kernel (sysrq c), as TCG's emulated SVM did; elsewhere it exits 125, which is what scripts/kvm-rig returns then.
# The mark is written to the tier's shared out directory, so the next rig sees it and the test passes there.
SUITE = '''
import os
import pathlib


def test_first():
    pass


def test_fails_if_asked():
    assert os.environ.get("SMOL_TIER_FAIL") != "1", "this test fails when SMOL_TIER_FAIL=1"


def test_dies():
    mark = pathlib.Path(os.environ["SMOL_TIER_MARK"])
    if not mark.exists() or os.environ.get("SMOL_TIER_DIE_ALWAYS") == "1":
        mark.write_text("died once")
        if os.environ.get("SMOL_KVM_RIG") == "1":
            with open("/proc/sysrq-trigger", "w") as f:
                f.write("c")
        os._exit(125)


def test_after():
    pass
'''
TESTS = ["test_tier.py::test_first", "test_tier.py::test_fails_if_asked", "test_tier.py::test_dies",
         "test_tier.py::test_after"]


def write_suite(where: Path) -> Path:
    """The suite in its own root (a pytest.ini, so the project's conftest does not apply)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "pytest.ini").write_text("[pytest]\n")
    (where / "test_tier.py").write_text(SUITE)
    return where
