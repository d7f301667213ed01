"""A read-only MC146818 CMOS RTC at ports 0x70/0x71 reporting the host's UTC time (BCD, 24 h)."""

from __future__ import annotations

import time
from collections.abc import Callable

# MC146818 register indices.
SECONDS, MINUTES, HOURS, WEEKDAY, DAY, MONTH, YEAR = 0x00, 0x02, 0x04, 0x06, 0x07, 0x08, 0x09
REG_A, REG_B, REG_C, REG_D = 0x0A, 0x0B, 0x0C, 0x0D
CENTURY = 0x32
REG_B_24H = 0x02
REG_B_BINARY = 0x04   # never set: x86 Linux reads the RTC as BCD whatever this bit says (RTC_ALWAYS_BCD)
REG_D_VRT = 0x80


def bcd(value: int) -> int:
    """Two decimal digits packed in one byte (MC146818 data mode with REG_B bit 2 clear)."""
    return ((value // 10) << 4) | (value % 10)


class Cmos:
    """Index register at offset 0, data at offset 1. Update-in-progress is never set, so reads never spin."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.index = 0
        self.nvram = bytearray(128)

    def read(self, offset: int, size: int) -> bytes:
        value = self._value(self.index) if offset == 1 else 0xFF
        return bytes([value]) + b"\x00" * (size - 1)

    def _value(self, reg: int) -> int:
        t = time.gmtime(self.clock())
        table = {SECONDS: bcd(t.tm_sec), MINUTES: bcd(t.tm_min), HOURS: bcd(t.tm_hour),
                 WEEKDAY: bcd((t.tm_wday + 1) % 7 + 1), DAY: bcd(t.tm_mday), MONTH: bcd(t.tm_mon),
                 YEAR: bcd(t.tm_year % 100), CENTURY: bcd(t.tm_year // 100),
                 REG_A: 0x26, REG_B: REG_B_24H, REG_C: 0, REG_D: REG_D_VRT}
        if reg in table:
            return table[reg]
        return self.nvram[reg & 0x7F]

    def write(self, offset: int, data: bytes) -> None:
        if not data:
            return
        if offset == 0:
            self.index = data[0] & 0x7F   # bit 7 is the NMI mask
        elif self.index >= 0x0E:
            self.nvram[self.index] = data[0]
