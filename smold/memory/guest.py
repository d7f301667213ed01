"""GuestMemory: bounds-checked access to guest RAM backed by a memfd or, copy-on-write, by a snapshot file."""

from __future__ import annotations

import array
import ctypes
import errno
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
DUMP_CHUNK = 256 * 1024          # granularity of hole detection when writing RAM to a file
# /proc/self/pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
_PM_PRESENT = 1 << 63
_PM_SWAPPED = 1 << 62
_PM_FILE_OR_SHARED = 1 << 61


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of any buffer, whatever its format, shape or strides."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())   # copy a strided view into one contiguous run
    return view.cast("B")


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
        self._private = private
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        self._map = mmap.mmap(fd, offset, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)
        self._closed = False

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], regions: list[tuple[int, int]]) -> GuestMemory:
        """Guest RAM mapped MAP_PRIVATE from a snapshot's memory file: pages fault in lazily from the page
        cache (shared by every VM mapping the same file) and a guest write copies only that page."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise GuestMemoryError(f"cannot open memory file {os.fspath(path)!r}: {e.strerror}") from e
        try:
            mem = cls(regions, fd=fd, private=True)
        except BaseException:
            os.close(fd)
            raise
        mem._owns_fd = True
        return mem

    @property
    def private(self) -> bool:
        """True when guest writes are private copies of a file's pages (a restored VM)."""
        return self._private

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

    def _check_open(self) -> None:
        if self._closed:
            raise GuestMemoryError("guest memory is closed")

    def host_address(self, region: MemoryRegion) -> int:
        """Host virtual address of a region (for KVM_SET_USER_MEMORY_REGION only)."""
        self._check_open()
        import ctypes

        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        return base + region.file_offset

    def _locate(self, addr: int, length: int) -> int:
        """Return the mapping offset for [addr, addr+length) or raise."""
        self._check_open()
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
        src = _as_bytes_view(data)
        length = src.nbytes   # bytes, not items: a memoryview of "I" has len() == nbytes / 4
        off = self._locate(addr, length)
        self._view[off:off + length] = src

    def fill(self, addr: int, length: int, byte: int = 0) -> None:
        off = self._locate(addr, length)
        self._view[off:off + length] = bytes([byte]) * length

    def read_into(self, addr: int, out: bytearray | memoryview) -> None:
        dst = memoryview(out)
        if dst.c_contiguous:
            dst = dst.cast("B")
        elif dst.ndim != 1 or dst.itemsize != 1:
            raise GuestMemoryError("read_into needs a contiguous buffer or a one-dimensional byte view")
        off = self._locate(addr, dst.nbytes)
        dst[:] = self._view[off:off + dst.nbytes]

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
        self._check_open()
        for region in self._regions:
            yield region, self._view[region.file_offset:region.file_offset + region.size]

    # -- writing RAM out (snapshots) ---------------------------------------------------------------------
    def dump(self, fd: int) -> int:
        """Write all of guest RAM into the regular file ``fd`` at mapping offsets; returns bytes written.

        The file is truncated to the RAM size first and all-zero chunks are skipped, so they stay holes
        (a sparse file). Ranges the backing file holds no data for (SEEK_DATA/SEEK_HOLE) are not read at
        all, so dumping a mostly idle VM neither reads nor allocates its untouched memory. For a private
        mapping, chunks holding pages the guest wrote (private copies, from /proc/self/pagemap) are read
        from the mapping and the rest from the backing file.
        """
        self._check_open()
        os.ftruncate(fd, 0)
        os.ftruncate(fd, self._total)
        nchunks = -(-self._total // DUMP_CHUNK)
        in_file = bytearray(nchunks)
        for start, end in _data_extents(self._fd, self._total):
            first, last = start // DUMP_CHUNK, (end - 1) // DUMP_CHUNK
            in_file[first:last + 1] = b"\x01" * (last - first + 1)
        copied = self._copied_chunks(nchunks) if self._private else bytearray(nchunks)
        zero = bytes(DUMP_CHUNK)
        written = 0
        for c in range(nchunks):
            off = c * DUMP_CHUNK
            n = min(DUMP_CHUNK, self._total - off)
            if copied[c]:
                data = self._map[off:off + n]
            elif in_file[c]:
                data = os.pread(self._fd, n, off)
            else:
                continue
            if data == (zero if n == DUMP_CHUNK else bytes(n)):
                continue
            view = memoryview(data)
            pos = off
            while view:
                done = os.pwrite(fd, view, pos)
                view, pos = view[done:], pos + done
            written += n
        return written

    def _copied_chunks(self, nchunks: int) -> bytearray:
        """One byte per DUMP_CHUNK: 1 where this process holds private (copied) pages of its MAP_PRIVATE
        mapping, from /proc/self/pagemap; all 1 where pagemap cannot be read (read everything)."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        pages = self._total // PAGE_SIZE
        raw = b""
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            try:
                raw = os.pread(fd, pages * 8, (base // PAGE_SIZE) * 8)
            finally:
                os.close(fd)
        except OSError:
            pass
        if len(raw) != pages * 8:
            return bytearray(b"\x01" * nchunks)
        out = bytearray(nchunks)
        per_chunk = DUMP_CHUNK // PAGE_SIZE
        for i, e in enumerate(array.array("Q", raw)):
            if e & (_PM_PRESENT | _PM_SWAPPED) and not e & _PM_FILE_OR_SHARED:
                out[i // per_chunk] = 1
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap guest RAM and close the memfd if we created it. A second call is a no-op.

        All-or-nothing: while a memoryview from :meth:`view` or :meth:`iter_regions` (or a slice of
        one) is still alive the mapping cannot be unmapped, so this raises :class:`GuestMemoryError`
        and leaves the object open and fully usable; release the views and call again.
        """
        if self._closed:
            return
        try:
            self._view.release()
            try:
                self._map.close()
            except BufferError:
                self._view = memoryview(self._map)   # undo: the object stays exactly as it was
                raise
        except BufferError as e:
            raise GuestMemoryError("cannot close guest memory while views of it are still alive; "
                                   "release them first") from e
        self._closed = True                       # before os.close: never close an fd number twice
        if self._owns_fd:
            os.close(self._fd)

    def __enter__(self) -> GuestMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _data_extents(fd: int, total: int) -> list[tuple[int, int]]:
    """[start, end) ranges of ``fd`` below ``total`` that may hold data (SEEK_DATA/SEEK_HOLE); the whole
    range where the file system cannot tell."""
    out: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < total:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:   # no data after pos
                    break
                raise
            if start >= total:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), total)
            out.append((start, end))
            pos = end
    except OSError:
        return [(0, total)]
    return out

