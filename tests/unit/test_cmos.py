"""The CMOS RTC reports the host's UTC time in BCD, as x86 Linux reads it."""

from __future__ import annotations

import calendar

from smold.devices.cmos import CENTURY, DAY, HOURS, MINUTES, MONTH, REG_B, REG_B_BINARY, SECONDS, YEAR, Cmos


def read(c: Cmos, reg: int) -> int:
    c.write(0, bytes([reg | 0x80]))   # bit 7 (NMI mask) is ignored
    return c.read(1, 1)[0]


def unbcd(v: int) -> int:
    assert v >> 4 <= 9 and v & 0xF <= 9, f"{v:#x} is not BCD"
    return (v >> 4) * 10 + (v & 0xF)


def test_time_is_bcd_and_matches_the_clock() -> None:
    when = calendar.timegm((2026, 12, 2, 17, 45, 59, 0, 0, 0))
    c = Cmos(clock=lambda: when)
    assert not read(c, REG_B) & REG_B_BINARY
    got = [unbcd(read(c, r)) for r in (CENTURY, YEAR, MONTH, DAY, HOURS, MINUTES, SECONDS)]
    assert got == [20, 26, 12, 2, 17, 45, 59]
    assert read(c, YEAR) == 0x26 and read(c, SECONDS) == 0x59


def test_nvram_is_writable_above_the_clock_registers() -> None:
    c = Cmos(clock=lambda: 0.0)
    c.write(0, bytes([0x40]))
    c.write(1, b"\x5a")
    assert read(c, 0x40) == 0x5A
    c.write(0, bytes([SECONDS]))
    c.write(1, b"\x11")                # clock registers are read-only
    assert read(c, SECONDS) == 0x00
