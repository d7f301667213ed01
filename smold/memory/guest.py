"""GuestMemory: bounds-checked access to guest RAM backed by a memfd."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass


class GuestMemoryError(Exception):
    """An access outside guest RAM, a negative or overflowing address, or a bad layout."""


@dataclass(frozen=True)
class MemoryRegion:
    """One contiguous range of guest-physical memory backed by part of the memfd."""

    guest_addr: int
    size: int
    file_offset: int

    @property
    def end(self) -> int:
        return self.guest_addr + self.size


PAGE_SIZE = 4096
_MAX_ADDR = (1 << 64) - 1


class GuestMemory:
    """Guest RAM: one memfd mapped once, split into regions at guest-physical addresses.

    Every access is validated: negative addresses, lengths that overflow, and ranges that are not
    entirely inside one region raise :class:`GuestMemoryError`. Nothing else in the project touches
    the mapping; devices and loaders go through these methods only.
    """

    def __init__(self, regions: list[tuple[int, int]], *, fd: int | None = None, name: str = "smol-guest-ram",
                 private: bool = False) -> None:
        if not regions:
            raise GuestMemoryError("guest memory needs at least one region")
        layout: list[MemoryRegion] = []
        offset = 0
        for guest_addr, size in sorted(regions):
            if guest_addr < 0 or size <= 0 or guest_addr % PAGE_SIZE or size % PAGE_SIZE:
                raise GuestMemoryError(f"region {guest_addr:#x}+{size:#x} must be page aligned and non-empty")
            if layout and guest_addr < layout[-1].end:
                raise GuestMemoryError(f"region {guest_addr:#x} overlaps the previous region")
            layout.append(MemoryRegion(guest_addr, size, offset))
            offset += size
        self._regions = tuple(layout)
        self._total = offset
        self._owns_fd = fd is None
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, offset)
        elif os.fstat(fd).st_size < offset:
            raise GuestMemoryError(f"memory file is smaller than the {offset} bytes of guest RAM")
        self._fd = fd
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        self._map = mmap.mmap(fd, offset, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)

    # -- layout -----------------------------------------------------------------------------------------
    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self._regions

    @property
    def size(self) -> int:
        return self._total

    @property
    def fd(self) -> int:
        return self._fd

    def host_address(self, region: MemoryRegion) -> int:
        """Host virtual address of a region (for KVM_SET_USER_MEMORY_REGION only)."""
        import ctypes

        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        return base + region.file_offset

    def _locate(self, addr: int, length: int) -> int:
        """Return the mapping offset for [addr, addr+length) or raise."""
        if not isinstance(addr, int) or not isinstance(length, int):
            raise GuestMemoryError("address and length must be integers")
        if addr < 0 or length < 0:
            raise GuestMemoryError(f"negative guest access {addr:#x}+{length}")
        if addr + length - 1 > _MAX_ADDR:
            raise GuestMemoryError(f"guest access {addr:#x}+{length} overflows the address space")
        for region in self._regions:
            if region.guest_addr <= addr < region.end or (length == 0 and addr == region.end):
                if addr + length > region.end:
                    raise GuestMemoryError(f"guest access {addr:#x}+{length} crosses the end of RAM "
                                           f"region {region.guest_addr:#x}-{region.end:#x}")
                return region.file_offset + (addr - region.guest_addr)
        raise GuestMemoryError(f"guest address {addr:#x}+{length} is not backed by RAM")

    def check_range(self, addr: int, length: int) -> None:
        """Raise unless [addr, addr+length) lies inside guest RAM."""
        self._locate(addr, length)

    def contains(self, addr: int, length: int = 1) -> bool:
        try:
            self._locate(addr, length)
        except GuestMemoryError:
            return False
        return True

    # -- access ---------------------------------------------------------------------------------------
    def read(self, addr: int, length: int) -> bytes:
        off = self._locate(addr, length)
        return bytes(self._view[off:off + length])

    def write(self, addr: int, data: bytes | bytearray | memoryview) -> None:
        length = len(data)
        off = self._locate(addr, length)
        self._view[off:off + length] = data

    def fill(self, addr: int, length: int, byte: int = 0) -> None:
        off = self._locate(addr, length)
        self._view[off:off + length] = bytes([byte]) * length

    def read_into(self, addr: int, out: bytearray | memoryview) -> None:
        off = self._locate(addr, len(out))
        out[:] = self._view[off:off + len(out)]

    def view(self, addr: int, length: int) -> memoryview:
        """A writable memoryview of a validated range (for zero-copy device I/O)."""
        off = self._locate(addr, length)
        return self._view[off:off + length]

    def read_u8(self, addr: int) -> int:
        return self.read(addr, 1)[0]

    def read_u16(self, addr: int) -> int:
        return int(struct.unpack("<H", self.read(addr, 2))[0])

    def read_u32(self, addr: int) -> int:
        return int(struct.unpack("<I", self.read(addr, 4))[0])

    def read_u64(self, addr: int) -> int:
        return int(struct.unpack("<Q", self.read(addr, 8))[0])

    def write_u8(self, addr: int, value: int) -> None:
        self.write(addr, struct.pack("<B", value))

    def write_u16(self, addr: int, value: int) -> None:
        self.write(addr, struct.pack("<H", value))

    def write_u32(self, addr: int, value: int) -> None:
        self.write(addr, struct.pack("<I", value))

    def write_u64(self, addr: int, value: int) -> None:
        self.write(addr, struct.pack("<Q", value))

    def iter_regions(self) -> Iterator[tuple[MemoryRegion, memoryview]]:
        """Each region with a view of its bytes (for snapshots)."""
        for region in self._regions:
            yield region, self._view[region.file_offset:region.file_offset + region.size]

    def close(self) -> None:
        self._view.release()
        self._map.close()
        if self._owns_fd:
            os.close(self._fd)

    def __enter__(self) -> GuestMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
