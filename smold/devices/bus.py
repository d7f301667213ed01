"""Address-space buses dispatching PIO and MMIO exits to devices."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Protocol


class BusError(Exception):
    """A bad bus layout (overlap, empty range)."""


class BusDevice(Protocol):
    """A device on a bus; offsets are relative to the device's base address."""

    def read(self, offset: int, size: int) -> bytes: ...

    def write(self, offset: int, data: bytes) -> None: ...


@dataclass(frozen=True)
class _Range:
    base: int
    length: int
    device: BusDevice


class Bus:
    """Maps non-overlapping address ranges to devices. Unclaimed reads return 0xff bytes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ranges: list[_Range] = []
        self._bases: list[int] = []
        # One lock serialises all device access from vCPU threads and the event loop.
        self.lock = threading.RLock()

    def insert(self, base: int, length: int, device: BusDevice) -> None:
        if length <= 0 or base < 0:
            raise BusError(f"{self.name}: bad range {base:#x}+{length:#x}")
        i = bisect.bisect_left(self._bases, base)
        if i > 0 and self._ranges[i - 1].base + self._ranges[i - 1].length > base:
            raise BusError(f"{self.name}: {base:#x} overlaps a device")
        if i < len(self._ranges) and base + length > self._ranges[i].base:
            raise BusError(f"{self.name}: {base:#x}+{length:#x} overlaps a device")
        self._ranges.insert(i, _Range(base, length, device))
        self._bases.insert(i, base)

    def find(self, addr: int, size: int = 1) -> tuple[BusDevice, int] | None:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        r = self._ranges[i]
        if addr + size > r.base + r.length:
            return None
        return r.device, addr - r.base

    def read(self, addr: int, size: int) -> bytes:
        hit = self.find(addr, size)
        if hit is None:
            return b"\xff" * size
        with self.lock:
            data = hit[0].read(hit[1], size)
        if len(data) != size:
            data = (bytes(data) + b"\x00" * size)[:size]
        return data

    def write(self, addr: int, data: bytes) -> bool:
        hit = self.find(addr, len(data))
        if hit is None:
            return False
        with self.lock:
            hit[0].write(hit[1], data)
        return True
