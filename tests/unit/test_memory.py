"""GuestMemory: every access is bounds-checked against the RAM regions; the memfd backs the mapping."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator

import pytest

from smold.memory import PAGE_SIZE, GuestMemory, GuestMemoryError, MemoryRegion

MiB = 1 << 20
LOW_END = 1 * MiB            # first region: [0, 1 MiB)
HIGH = 4 * MiB               # second region: [4 MiB, 5 MiB)
HIGH_END = 5 * MiB
MAX_ADDR = (1 << 64) - 1


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    """Two regions with a 3 MiB gap between them."""
    with GuestMemory([(0, MiB), (HIGH, MiB)]) as m:
        yield m


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        assert e.errno == errno.EBADF
        return False
    return True


# -- construction ------------------------------------------------------------------------------------
def test_layout_is_sorted_and_packed_into_the_file() -> None:
    with GuestMemory([(HIGH, 2 * MiB), (0, MiB)]) as m:
        assert m.regions == (MemoryRegion(0, MiB, 0), MemoryRegion(HIGH, 2 * MiB, MiB))
        assert m.size == 3 * MiB
        assert m.regions[1].end == HIGH + 2 * MiB


@pytest.mark.parametrize("regions", [
    [],
    [(-PAGE_SIZE, PAGE_SIZE)],               # negative address
    [(0, 0)],                                # empty region
    [(0, -PAGE_SIZE)],                       # negative size
    [(0x800, PAGE_SIZE)],                    # unaligned address
    [(0, PAGE_SIZE + 1)],                    # unaligned size
    [(0, 2 * PAGE_SIZE), (PAGE_SIZE, PAGE_SIZE)],       # overlap
    [(0, MiB), (0, MiB)],                    # duplicate
    [(HIGH, MiB), (HIGH - PAGE_SIZE, 2 * PAGE_SIZE)],   # overlap given out of order
])
def test_bad_layouts_rejected(regions: list[tuple[int, int]]) -> None:
    with pytest.raises(GuestMemoryError):
        GuestMemory(regions)


def test_adjacent_regions_accepted() -> None:
    with GuestMemory([(0, MiB), (MiB, MiB)]) as m:
        assert [r.guest_addr for r in m.regions] == [0, MiB]
        m.write(MiB - 1, b"a")
        m.write(MiB, b"b")
        assert m.read(MiB - 1, 1) + m.read(MiB, 1) == b"ab"


def test_access_may_not_span_two_adjacent_regions() -> None:
    """Each access must lie inside one region, even where two regions touch in guest space."""
    with GuestMemory([(0, MiB), (MiB, MiB)]) as m:
        with pytest.raises(GuestMemoryError):
            m.read(MiB - 2, 4)
        with pytest.raises(GuestMemoryError):
            m.write(MiB - 2, b"wxyz")
        assert m.read(MiB - 2, 2) == b"\0\0" and m.read(MiB, 2) == b"\0\0"


# -- memfd backing -----------------------------------------------------------------------------------
def test_memfd_sized_to_total_ram(mem: GuestMemory) -> None:
    assert os.fstat(mem.fd).st_size == 2 * MiB == mem.size


def test_guest_writes_reach_the_memfd_at_the_region_offset(mem: GuestMemory) -> None:
    mem.write(0x10, b"low")
    mem.write(HIGH + 0x20, b"high")
    assert os.pread(mem.fd, 3, 0x10) == b"low"
    assert os.pread(mem.fd, 4, mem.regions[1].file_offset + 0x20) == b"high"


def test_memfd_writes_visible_to_guest_reads(mem: GuestMemory) -> None:
    os.pwrite(mem.fd, b"from-host", mem.regions[1].file_offset + 8)
    assert mem.read(HIGH + 8, 9) == b"from-host"


def test_external_fd_used_and_left_open() -> None:
    fd = os.memfd_create("test-mem", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 2 * MiB)
        os.pwrite(fd, b"preexisting", MiB)
        with GuestMemory([(0, MiB), (HIGH, MiB)], fd=fd) as m:
            assert m.fd == fd
            assert m.read(HIGH, 11) == b"preexisting"
            m.write(0, b"shared")
        assert fd_is_open(fd)
        assert os.pread(fd, 6, 0) == b"shared"
    finally:
        os.close(fd)


def test_external_fd_too_small_rejected() -> None:
    fd = os.memfd_create("test-mem-small", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, MiB)
        with pytest.raises(GuestMemoryError):
            GuestMemory([(0, 2 * MiB)], fd=fd)
        assert fd_is_open(fd)
    finally:
        os.close(fd)


def test_private_mapping_does_not_write_the_file() -> None:
    fd = os.memfd_create("test-mem-cow", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, MiB)
        os.pwrite(fd, b"base", 0)
        with GuestMemory([(0, MiB)], fd=fd, private=True) as m:
            assert m.read(0, 4) == b"base"
            m.write(0, b"fork")
            assert m.read(0, 4) == b"fork"
            assert os.pread(fd, 4, 0) == b"base"
    finally:
        os.close(fd)


def test_host_address_offsets_follow_file_layout(mem: GuestMemory) -> None:
    low, high = mem.regions
    assert mem.host_address(low) != 0
    assert mem.host_address(high) - mem.host_address(low) == high.file_offset - low.file_offset == MiB


# -- close -------------------------------------------------------------------------------------------
def test_context_manager_closes_owned_fd() -> None:
    with GuestMemory([(0, MiB)]) as m:
        fd = m.fd
        assert fd_is_open(fd)
    assert not fd_is_open(fd)


def test_close_closes_owned_fd() -> None:
    m = GuestMemory([(0, MiB)])
    fd = m.fd
    m.close()
    assert not fd_is_open(fd)


def test_close_is_idempotent() -> None:
    m = GuestMemory([(0, MiB)])
    fd = m.fd
    m.close()
    reused = os.open(os.devnull, os.O_RDONLY)   # likely takes the freed number; must survive
    try:
        m.close()
        assert m.closed
        assert fd_is_open(reused)
    finally:
        os.close(reused)
    assert not fd_is_open(fd) or fd == reused


def test_close_with_live_view_raises_and_leaves_memory_usable() -> None:
    m = GuestMemory([(0, MiB)])
    fd = m.fd
    v = m.view(0x100, 4)
    sub = v[1:3]                    # a slice of a view pins the mapping as well
    del v
    with pytest.raises(GuestMemoryError, match="views"):
        m.close()
    assert not m.closed and fd_is_open(fd)
    m.write(0x101, b"\x12\x34")   # still fully usable
    assert bytes(sub) == b"\x12\x34" and m.read(0x100, 4) == b"\x00\x12\x34\x00"
    sub.release()
    m.close()
    assert m.closed and not fd_is_open(fd)


def test_close_with_live_iter_regions_view_raises() -> None:
    m = GuestMemory([(0, MiB)])
    (_, view), = list(m.iter_regions())
    with pytest.raises(GuestMemoryError):
        m.close()
    view.release()
    m.close()
    assert m.closed


def test_access_after_close_is_a_guest_memory_error() -> None:
    m = GuestMemory([(0, MiB)])
    m.close()
    with pytest.raises(GuestMemoryError, match="closed"):
        m.read(0, 1)
    with pytest.raises(GuestMemoryError, match="closed"):
        m.write(0, b"x")


# -- bounds checks -----------------------------------------------------------------------------------
BAD_RANGES = [
    pytest.param(-1, 1, id="negative-addr"),
    pytest.param(-PAGE_SIZE, 2 * PAGE_SIZE, id="negative-addr-reaching-ram"),
    pytest.param(0, -1, id="negative-length"),
    pytest.param(0x100, -0x10, id="negative-length-inside"),
    pytest.param(MAX_ADDR, 2, id="overflow-2^64"),
    pytest.param(MAX_ADDR - 3, 8, id="overflow-u64"),
    pytest.param(1 << 64, 1, id="beyond-2^64"),
    pytest.param(1 << 70, 0, id="far-beyond-zero-length"),
    pytest.param(LOW_END - 4, 8, id="straddle-first-end"),
    pytest.param(LOW_END - 1, 2, id="straddle-first-end-by-one"),
    pytest.param(LOW_END, 1, id="first-byte-of-gap"),
    pytest.param(2 * MiB, 16, id="inside-gap"),
    pytest.param(HIGH - 1, 1, id="last-byte-of-gap"),
    pytest.param(HIGH - 4, 8, id="straddle-into-second"),
    pytest.param(0, HIGH + 8, id="spans-whole-gap"),
    pytest.param(HIGH_END - 4, 8, id="straddle-second-end"),
    pytest.param(HIGH_END, 1, id="after-ram"),
    pytest.param(2 * MiB, 0, id="zero-length-in-gap"),
    pytest.param(HIGH_END + PAGE_SIZE, 0, id="zero-length-after-ram"),
]

GOOD_RANGES = [
    pytest.param(0, 1, id="first-byte"),
    pytest.param(0, LOW_END, id="whole-first-region"),
    pytest.param(LOW_END - 1, 1, id="last-byte-first"),
    pytest.param(HIGH, MiB, id="whole-second-region"),
    pytest.param(HIGH_END - 8, 8, id="last-u64-second"),
    pytest.param(0, 0, id="zero-length-at-0"),
    pytest.param(LOW_END, 0, id="zero-length-at-first-end"),
    pytest.param(HIGH_END, 0, id="zero-length-at-second-end"),
]


@pytest.mark.parametrize(("addr", "length"), BAD_RANGES)
def test_bad_range_rejected_by_every_accessor(mem: GuestMemory, addr: int, length: int) -> None:
    assert not mem.contains(addr, length)
    with pytest.raises(GuestMemoryError):
        mem.check_range(addr, length)
    with pytest.raises(GuestMemoryError):
        mem.read(addr, length)
    with pytest.raises(GuestMemoryError):
        mem.view(addr, length)
    with pytest.raises(GuestMemoryError):
        mem.fill(addr, length, 0xEE)
    if length >= 0:
        with pytest.raises(GuestMemoryError):
            mem.write(addr, b"\xee" * length)
        buf = bytearray(b"\x55" * length)
        with pytest.raises(GuestMemoryError):
            mem.read_into(addr, buf)
        assert buf == b"\x55" * length
    # Nothing landed anywhere in RAM.
    assert b"\xee" not in mem.read(0, LOW_END)
    assert b"\xee" not in mem.read(HIGH, MiB)


@pytest.mark.parametrize(("addr", "length"), GOOD_RANGES)
def test_good_range_accepted(mem: GuestMemory, addr: int, length: int) -> None:
    assert mem.contains(addr, length)
    mem.check_range(addr, length)
    data = (bytes(range(1, 252)) * (length // 251 + 1))[:length]
    mem.write(addr, data)
    assert mem.read(addr, length) == data
    assert len(mem.view(addr, length)) == length


def test_contains_defaults_to_one_byte(mem: GuestMemory) -> None:
    assert mem.contains(0) and mem.contains(LOW_END - 1) and mem.contains(HIGH_END - 1)
    assert not mem.contains(LOW_END) and not mem.contains(HIGH_END) and not mem.contains(-1)


@pytest.mark.parametrize("addr", [1.0, "0", None])
def test_non_integer_address_rejected(mem: GuestMemory, addr: object) -> None:
    with pytest.raises(GuestMemoryError):
        mem.read(addr, 1)  # type: ignore[arg-type]
    assert not mem.contains(addr)  # type: ignore[arg-type]


def test_non_integer_length_rejected(mem: GuestMemory) -> None:
    with pytest.raises(GuestMemoryError):
        mem.read(0, 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("end", [LOW_END, HIGH_END])
def test_rejected_straddling_write_changes_nothing(mem: GuestMemory, end: int) -> None:
    mem.write(end - 4, b"keep")
    with pytest.raises(GuestMemoryError):
        mem.write(end - 4, b"overwrite")
    with pytest.raises(GuestMemoryError):
        mem.fill(end - 4, 5, 0xAB)
    assert mem.read(end - 4, 4) == b"keep"


def test_rejected_write_spanning_gap_changes_nothing(mem: GuestMemory) -> None:
    with pytest.raises(GuestMemoryError):
        mem.write(LOW_END - 8, b"\xcc" * (HIGH - LOW_END + 16))
    assert mem.read(LOW_END - 8, 8) == bytes(8)
    assert mem.read(HIGH, 8) == bytes(8)


# -- typed accessors at region edges -----------------------------------------------------------------
WIDTHS = [
    ("u8", 1, 0xA5),
    ("u16", 2, 0xBEEF),
    ("u32", 4, 0xDEADBEEF),
    ("u64", 8, 0x0123456789ABCDEF),
]


@pytest.mark.parametrize(("name", "width", "value"), WIDTHS)
@pytest.mark.parametrize("end", [LOW_END, HIGH_END])
def test_typed_access_at_exact_region_end(mem: GuestMemory, name: str, width: int, value: int,
                                          end: int) -> None:
    write: Callable[[int, int], None] = getattr(mem, f"write_{name}")
    read: Callable[[int], int] = getattr(mem, f"read_{name}")
    write(end - width, value)
    assert read(end - width) == value
    assert mem.read(end - width, width) == value.to_bytes(width, "little")
    if width > 1:
        with pytest.raises(GuestMemoryError):
            write(end - width + 1, value)
        with pytest.raises(GuestMemoryError):
            read(end - width + 1)
    with pytest.raises(GuestMemoryError):
        write(end, value)
    with pytest.raises(GuestMemoryError):
        read(end)
    assert mem.read(end - width, width) == value.to_bytes(width, "little")


@pytest.mark.parametrize(("name", "width", "value"), WIDTHS)
def test_typed_access_rejects_gap_start_and_negative(mem: GuestMemory, name: str, width: int,
                                                     value: int) -> None:
    for addr in (-1, -width, HIGH - width + 1 if width > 1 else HIGH - 1):
        with pytest.raises(GuestMemoryError):
            getattr(mem, f"write_{name}")(addr, value)
        with pytest.raises(GuestMemoryError):
            getattr(mem, f"read_{name}")(addr)


def test_typed_values_are_little_endian(mem: GuestMemory) -> None:
    mem.write_u64(0x100, 0x1122334455667788)
    assert mem.read(0x100, 8) == bytes.fromhex("8877665544332211")
    assert mem.read_u32(0x100) == 0x55667788
    assert mem.read_u16(0x104) == 0x3344
    assert mem.read_u8(0x107) == 0x11


# -- view, read_into, fill ---------------------------------------------------------------------------
def test_view_is_writable_and_aliases_guest_ram(mem: GuestMemory) -> None:
    v = mem.view(HIGH + 0x10, 4)
    v[:] = b"abcd"
    assert mem.read(HIGH + 0x10, 4) == b"abcd"
    mem.write(HIGH + 0x12, b"ZZ")
    assert bytes(v) == b"abZZ"
    v.release()


def test_view_at_region_end(mem: GuestMemory) -> None:
    mem.write(LOW_END - 3, b"end")
    v = mem.view(LOW_END - 3, 3)
    assert bytes(v) == b"end"
    v.release()
    empty = mem.view(LOW_END, 0)
    assert len(empty) == 0
    empty.release()


def test_read_into_bytearray_and_memoryview(mem: GuestMemory) -> None:
    mem.write(HIGH_END - 6, b"123456")
    out = bytearray(6)
    mem.read_into(HIGH_END - 6, out)
    assert out == b"123456"
    big = bytearray(b"..........")
    mem.read_into(HIGH_END - 4, memoryview(big)[3:7])
    assert big == b"...3456..."
    empty = bytearray()
    mem.read_into(HIGH_END, empty)
    assert empty == b""


def test_fill(mem: GuestMemory) -> None:
    mem.write(0x1000, b"\xff" * 16)
    mem.fill(0x1004, 8)
    assert mem.read(0x1000, 16) == b"\xff" * 4 + bytes(8) + b"\xff" * 4
    mem.fill(HIGH_END - 3, 3, 0x7E)
    assert mem.read(HIGH_END - 4, 4) == b"\0~~~"
    mem.fill(HIGH_END, 0, 0x7E)   # zero length at the end: allowed, no effect


def test_iter_regions_views_match_reads(mem: GuestMemory) -> None:
    mem.write(0, b"L")
    mem.write(HIGH, b"H")
    seen = [(r, bytes(v[:1]), len(v)) for r, v in mem.iter_regions()]
    assert seen == [(mem.regions[0], b"L", MiB), (mem.regions[1], b"H", MiB)]


# -- buffers of any format ---------------------------------------------------------------------------
def test_write_wide_item_memoryview_uses_byte_length(mem: GuestMemory) -> None:
    words = memoryview(bytearray(b"\x01\x00\x00\x00\x02\x00\x00\x00")).cast("I")
    assert len(words) == 2 and words.nbytes == 8
    mem.write(0x40, words)
    assert mem.read(0x40, 8) == b"\x01\x00\x00\x00\x02\x00\x00\x00"


def test_write_wide_item_memoryview_is_bounds_checked_in_bytes(mem: GuestMemory) -> None:
    words = memoryview(bytes(16)).cast("Q")   # 2 items, 16 bytes
    with pytest.raises(GuestMemoryError):
        mem.write(LOW_END - 8, words)           # 2 bytes would fit; 16 do not
    mem.write(LOW_END - 16, words)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: memoryview(b"abcdefgh").cast("c"), id="char"),
    pytest.param(lambda: memoryview(b"abcdefgh").cast("b"), id="signed"),
    pytest.param(lambda: memoryview(b"abcdefgh").cast("H"), id="u16"),
    pytest.param(lambda: memoryview(b"abcdefgh").cast("B", (2, 4)), id="2d"),
    pytest.param(lambda: memoryview(b"aXbXcXdXeXfXgXhX")[::2], id="strided"),
])
def test_write_accepts_any_buffer_layout(mem: GuestMemory, make: Callable[[], memoryview]) -> None:
    mem.write(0x80, make())
    assert mem.read(0x80, 8) == b"abcdefgh"


def test_read_into_wide_item_memoryview_fills_every_byte(mem: GuestMemory) -> None:
    mem.write(0x40, bytes(range(1, 9)))
    out = bytearray(8)
    mem.read_into(0x40, memoryview(out).cast("I"))
    assert out == bytes(range(1, 9))
