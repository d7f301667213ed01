"""How the VMM classifies a guest reset: a clean poweroff versus a kernel panic or a failed /init."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from smold.vmm.machine import Machine, MachineExit


def classify(console: bytes) -> MachineExit:
    fake = SimpleNamespace(console=SimpleNamespace(tail=bytearray(console)), _CRASH_MARKERS=Machine._CRASH_MARKERS)
    return Machine._classify_reset(fake)  # type: ignore[arg-type]


def test_plain_reset_is_a_clean_poweroff() -> None:
    out = classify(b"smol-agent: power off requested\r\n[  150.3] reboot: Restarting system\r\n")
    assert out.kind == "poweroff" and out.clean


@pytest.mark.parametrize("line", [
    b"[  206.59] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100",
    b"smol-init: FATAL: cannot mount root /dev/vda (type ext4) read-only",
])
def test_panic_or_init_failure_is_a_crash_with_the_reason(line: bytes) -> None:
    out = classify(b"booting...\n" + line + b"\r\nreboot: Restarting system\n")
    assert out.kind == "crash" and not out.clean
    assert line.decode().split("] ")[-1].strip() in out.detail


def test_only_the_recent_tail_counts() -> None:
    out = classify(b"Kernel panic - not syncing: old\n" + b"x" * 9000)
    assert out.kind == "poweroff"
