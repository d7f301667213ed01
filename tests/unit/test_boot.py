"""Direct kernel boot: guest layout, zero page, MP table and kernel loaders (Linux boot protocol)."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator

import pytest

from smold.boot.layout import (
    BOOT_STACK_ADDR,
    CMDLINE_ADDR,
    CMDLINE_MAX,
    EBDA_START,
    GDT_ADDR,
    HIMEM_START,
    IDENTITY_MAP_ADDR,
    IDT_ADDR,
    IOAPIC_ADDR,
    IOAPIC_PINS,
    LAPIC_ADDR,
    PD_ADDR,
    PDPT_ADDR,
    PML4_ADDR,
    SERIAL_COM1_IRQ,
    TSS_ADDR,
    ZERO_PAGE_ADDR,
    LayoutError,
    RamLayout,
    virtio_mmio_slot,
)
from smold.boot.loader import KernelLoadError, LoadedKernel, load_bzimage, load_elf, load_kernel
from smold.boot.mptable import MpTableError, build_mptable
from smold.boot.params import BootParamsError, build_boot_params, initrd_addr_max
from smold.memory import GuestMemory

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
E820_RAM, E820_RESERVED = 1, 2


def u8(b: bytes, off: int) -> int:
    return b[off]


def u16(b: bytes, off: int) -> int:
    return int(struct.unpack_from("<H", b, off)[0])


def u32(b: bytes, off: int) -> int:
    return int(struct.unpack_from("<I", b, off)[0])


def u64(b: bytes, off: int) -> int:
    return int(struct.unpack_from("<Q", b, off)[0])


# ======================================================================================================
# layout.py
# ======================================================================================================
def test_small_guest_is_one_region() -> None:
    lay = RamLayout.for_size(64 * MiB)
    assert lay.regions == ((0, 64 * MiB),)
    assert lay.low_end == 64 * MiB


def test_exactly_3gib_fits_below_the_hole() -> None:
    lay = RamLayout.for_size(3 * GiB)
    assert lay.regions == ((0, 3 * GiB),)


@pytest.mark.parametrize("size", [3 * GiB + 2 * MiB, 4 * GiB, 8 * GiB, 1 << 40])
def test_large_guest_splits_around_the_hole(size: int) -> None:
    lay = RamLayout.for_size(size)
    assert lay.regions == ((0, 3 * GiB), (4 * GiB, size - 3 * GiB))
    assert lay.low_end == 3 * GiB
    assert sum(n for _, n in lay.regions) == size


@pytest.mark.parametrize("size", [0, 2 * MiB, 62 * MiB, 64 * MiB - 4096, 64 * MiB + MiB, 65 * MiB,
                                  (1 << 40) + 2 * MiB])
def test_bad_sizes_rejected(size: int) -> None:
    with pytest.raises(LayoutError):
        RamLayout.for_size(size)


def test_layout_error_is_value_error() -> None:
    assert issubclass(LayoutError, ValueError)


@pytest.mark.parametrize("size", [64 * MiB, 3 * GiB, 6 * GiB])
def test_e820_usable_entries_are_ram_and_sorted(size: int) -> None:
    lay = RamLayout.for_size(size)
    e820 = lay.e820()
    starts = [a for a, _, _ in e820]
    assert starts == sorted(starts)
    for (a, n, _), (b, _, _) in zip(e820, e820[1:], strict=False):
        assert a + n <= b, "e820 entries overlap"
    for addr, n, kind in e820:
        assert n > 0 and kind in (E820_RAM, E820_RESERVED)
        if kind == E820_RAM:
            assert any(r <= addr and addr + n <= r + rn for r, rn in lay.regions)
    usable = sum(n for _, n, k in e820 if k == E820_RAM)
    assert usable == size - (HIMEM_START - EBDA_START)


def test_e820_low_memory_map() -> None:
    e820 = RamLayout.for_size(128 * MiB).e820()
    assert e820 == [(0, EBDA_START, E820_RAM), (EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED),
                    (HIMEM_START, 127 * MiB, E820_RAM)]


def test_e820_high_memory_entry() -> None:
    e820 = RamLayout.for_size(5 * GiB).e820()
    assert e820[-2] == (HIMEM_START, 3 * GiB - HIMEM_START, E820_RAM)
    assert e820[-1] == (4 * GiB, 2 * GiB, E820_RAM)
    assert not any(a < 4 * GiB and a + n > 3 * GiB for a, n, _ in e820)  # nothing in the hole


def test_layout_regions_accepted_by_guest_memory() -> None:
    with GuestMemory(list(RamLayout.for_size(64 * MiB).regions)) as m:
        assert m.size == 64 * MiB


def test_low_boot_structures_do_not_overlap_and_sit_in_usable_ram() -> None:
    structures = {
        "gdt": (GDT_ADDR, 5 * 8),
        "idt": (IDT_ADDR, 8),
        "zero_page": (ZERO_PAGE_ADDR, 4096),
        "stack": (BOOT_STACK_ADDR - 0x100, 0x100),
        "pml4": (PML4_ADDR, 4096),
        "pdpt": (PDPT_ADDR, 4096),
        "pd": (PD_ADDR, 4 * 4096),
        "cmdline": (CMDLINE_ADDR, CMDLINE_MAX),
    }
    items = sorted(structures.items(), key=lambda kv: kv[1][0])
    for (n1, (a1, l1)), (n2, (a2, _)) in zip(items, items[1:], strict=False):
        assert a1 + l1 <= a2, f"{n1} overlaps {n2}"
    first_usable = RamLayout.for_size(64 * MiB).e820()[0]
    for name, (addr, size) in structures.items():
        assert first_usable[0] <= addr and addr + size <= first_usable[0] + first_usable[1], name


@pytest.mark.parametrize("size", [64 * MiB, 3 * GiB, 16 * GiB])
def test_kvm_private_pages_and_apics_are_never_ram(size: int) -> None:
    regions = RamLayout.for_size(size).regions
    for addr, n in [(TSS_ADDR, 3 * 4096), (IDENTITY_MAP_ADDR, 4096), (IOAPIC_ADDR, 4096),
                    (LAPIC_ADDR, 4096)]:
        assert not any(a < addr + n and addr < a + rn for a, rn in regions), hex(addr)
    assert IDENTITY_MAP_ADDR + 4096 <= TSS_ADDR


def test_virtio_mmio_slots() -> None:
    assert virtio_mmio_slot(0) == (0xD0000000, 5)
    assert virtio_mmio_slot(1) == (0xD0001000, 6)
    slots = [virtio_mmio_slot(n) for n in range(IOAPIC_PINS - 5)]
    assert slots[-1][1] == IOAPIC_PINS - 1
    assert len({b for b, _ in slots}) == len({i for _, i in slots}) == len(slots)
    assert all(3 * GiB <= b and b + 0x1000 <= IOAPIC_ADDR for b, _ in slots)
    assert all(i != SERIAL_COM1_IRQ for _, i in slots)


@pytest.mark.parametrize("n", [-1, IOAPIC_PINS - 5, 100])
def test_virtio_mmio_slot_out_of_range(n: int) -> None:
    with pytest.raises(LayoutError):
        virtio_mmio_slot(n)


# ======================================================================================================
# mptable.py
# ======================================================================================================
class MpTable:
    """A parser written from the MP spec 1.4 §4, independent of the builder."""

    def __init__(self, blob: bytes, base: int) -> None:
        self.blob = blob
        self.fp = blob[:16]
        sig, self.table_addr, self.fp_len, self.fp_rev, _, self.feature1 = struct.unpack_from(
            "<4sIBBBB", blob, 0)
        assert sig == b"_MP_"
        off = self.table_addr - base
        (csig, self.length, self.rev, _, self.oem, self.product, _, _, self.count, self.lapic,
         self.ext_len, _, _) = struct.unpack_from("<4sHBB8s12sIHHIHBB", blob, off)
        assert csig == b"PCMP"
        self.table = blob[off:off + self.length]
        self.cpus: list[tuple[int, int, int]] = []      # (apic id, version, flags)
        self.buses: list[tuple[int, bytes]] = []
        self.ioapics: list[tuple[int, int, int, int]] = []   # (id, version, flags, addr)
        self.intsrc: list[tuple[int, int, int, int, int, int]] = []
        self.lintsrc: list[tuple[int, int, int, int, int, int]] = []
        p = 44
        parsed = 0
        while p < self.length:
            kind = self.table[p]
            if kind == 0:
                _, apic_id, ver, flags, _sig, _feat = struct.unpack_from("<BBBBII", self.table, p)
                self.cpus.append((apic_id, ver, flags))
                p += 20
            elif kind == 1:
                _, bus_id, name = struct.unpack_from("<BB6s", self.table, p)
                self.buses.append((bus_id, name))
                p += 8
            elif kind == 2:
                _, io_id, ver, flags, addr = struct.unpack_from("<BBBBI", self.table, p)
                self.ioapics.append((io_id, ver, flags, addr))
                p += 8
            elif kind in (3, 4):
                _, itype, iflags, sbus, sirq, dst, pin = struct.unpack_from("<BBHBBBB", self.table, p)
                (self.intsrc if kind == 3 else self.lintsrc).append((itype, iflags, sbus, sirq, dst, pin))
                p += 8
            else:
                raise AssertionError(f"unknown MP entry type {kind} at {p}")
            parsed += 1
        assert p == self.length
        self.parsed = parsed


@pytest.mark.parametrize("ncpus", [1, 2, 4, 64, 254])
@pytest.mark.parametrize("base", [EBDA_START, 0xF0000])
def test_mptable_checksums_and_pointers(ncpus: int, base: int) -> None:
    blob = build_mptable(base, ncpus)
    t = MpTable(blob, base)
    assert sum(blob[:16]) & 0xFF == 0
    assert t.fp_len == 1            # length in 16-byte paragraphs
    assert t.fp_rev == 4            # spec 1.4
    assert t.feature1 == 0          # 0: a configuration table is present (not a default config)
    assert t.table_addr == base + 16
    assert sum(t.table) & 0xFF == 0
    assert len(blob) == 16 + t.length
    assert t.rev == 4 and t.ext_len == 0
    assert t.count == t.parsed
    assert t.lapic == LAPIC_ADDR


@pytest.mark.parametrize("ncpus", [1, 3, 16])
def test_mptable_one_processor_per_cpu_bsp_first(ncpus: int) -> None:
    t = MpTable(build_mptable(EBDA_START, ncpus), EBDA_START)
    assert [c[0] for c in t.cpus] == list(range(ncpus))
    assert all(c[2] & 1 for c in t.cpus), "every CPU enabled"
    assert [bool(c[2] & 2) for c in t.cpus] == [True] + [False] * (ncpus - 1)


@pytest.mark.parametrize("ncpus", [1, 8, 254])
def test_mptable_ioapic_and_interrupts(ncpus: int) -> None:
    t = MpTable(build_mptable(EBDA_START, ncpus), EBDA_START)
    assert len(t.ioapics) == 1
    io_id, _ver, flags, addr = t.ioapics[0]
    assert addr == IOAPIC_ADDR and flags & 1
    assert io_id not in {c[0] for c in t.cpus}
    assert len(t.buses) == 1 and t.buses[0][1] == b"ISA   "
    isa = t.buses[0][0]
    assert len(t.intsrc) == IOAPIC_PINS
    assert {(s[2], s[3]) for s in t.intsrc} == {(isa, irq) for irq in range(IOAPIC_PINS)}
    assert all(s[0] == 0 and s[4] == io_id and s[5] == s[3] for s in t.intsrc)  # INT, irq n -> pin n
    # LINT0 = ExtINT and LINT1 = NMI, to every local APIC.
    assert sorted((s[0], s[4], s[5]) for s in t.lintsrc) == [(1, 0xFF, 1), (3, 0xFF, 0)]


@pytest.mark.parametrize("ncpus", [0, -1, 255, 1000])
def test_mptable_cpu_count_limits(ncpus: int) -> None:
    with pytest.raises(MpTableError):
        build_mptable(EBDA_START, ncpus)


def test_mptable_lives_in_reserved_e820() -> None:
    blob = build_mptable(EBDA_START, 4)
    reserved = [(a, n) for a, n, k in RamLayout.for_size(64 * MiB).e820() if k == E820_RESERVED]
    assert any(a <= EBDA_START and EBDA_START + len(blob) <= a + n for a, n in reserved)


# ======================================================================================================
# loader.py: ELF
# ======================================================================================================
PT_NULL, PT_LOAD, PT_NOTE = 0, 1, 4
EM_X86_64 = 62


def elf(segments: list[tuple[int, int, bytes, int]], entry: int, *, ei_class: int = 2, ei_data: int = 1,
        machine: int = EM_X86_64, phentsize: int = 56, phnum: int | None = None,
        truncate_to: int | None = None) -> bytes:
    """A minimal ELF64: header, program headers, then each segment's bytes. segments: (type, paddr, data, memsz)."""
    phoff = 64
    data_off = phoff + len(segments) * phentsize
    ident = b"\x7fELF" + bytes([ei_class, ei_data, 1, 0]) + bytes(8)
    hdr = ident + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, entry, phoff, 0, 0, 64, phentsize,
                              len(segments) if phnum is None else phnum, 64, 0, 0)
    phdrs = bytearray()
    body = bytearray()
    for ptype, paddr, data, memsz in segments:
        ph = struct.pack("<IIQQQQQQ", ptype, 5, data_off + len(body), (0xFFFFFFFF80000000 + paddr) & ((1 << 64) - 1),
                         paddr,
                         len(data), memsz, 0x1000)
        phdrs += ph + bytes(phentsize - 56)
        body += data
    image = hdr + bytes(phdrs) + bytes(body)
    return image[:truncate_to] if truncate_to is not None else image


LOW_END = 4 * MiB          # test RAM: [0, 4 MiB), a hole, then [8 MiB, 10 MiB)
IN_HOLE = 6 * MiB
HIGH = 8 * MiB
BEYOND = 16 * MiB


RAM_REGIONS = [(0, LOW_END), (HIGH, 2 * MiB)]


@pytest.fixture(scope="module")
def poisoned_fd() -> Iterator[int]:
    """A memfd with every byte 0xAA, so bytes a loader did not touch can be told apart."""
    with GuestMemory(RAM_REGIONS) as m:
        for region in m.regions:
            m.fill(region.guest_addr, region.size, 0xAA)
        fd = os.dup(m.fd)
    yield fd
    os.close(fd)


@pytest.fixture
def ram(poisoned_fd: int) -> Iterator[GuestMemory]:
    """Guest RAM with a hole; a private (copy-on-write) mapping of the poisoned file, fresh per test."""
    with GuestMemory(RAM_REGIONS, fd=poisoned_fd, private=True) as m:
        yield m


def test_elf_segments_copied_bss_zeroed_entry_returned(ram: GuestMemory) -> None:
    text = b"\x90" * 100 + b"\xc3"
    data = b"DATA" * 8
    image = elf([(PT_LOAD, 0x200000, text, len(text)),
                 (PT_NOTE, 0x0, b"note", 4),                    # non-LOAD: ignored, even below 1 MiB
                 (PT_LOAD, 0x300000, data, len(data) + 0x1000)], entry=0x200010)
    k = load_elf(ram, image)
    assert k == LoadedKernel(entry=0x200010, end=0x300000 + len(data) + 0x1000, setup_header=None)
    assert ram.read(0x200000, len(text)) == text
    assert ram.read(0x200000 + len(text), 1) == b"\xaa"       # memsz == filesz: nothing after touched
    assert ram.read(0x300000, len(data)) == data
    assert ram.read(0x300000 + len(data), 0x1000) == bytes(0x1000)   # .bss zeroed
    assert ram.read(0x300000 + len(data) + 0x1000, 1) == b"\xaa"
    assert ram.read(0x1FFFFF, 1) == b"\xaa"


def test_elf_pure_bss_segment(ram: GuestMemory) -> None:
    load_elf(ram, elf([(PT_LOAD, 0x380000, b"", 0x800)], entry=0x380000))
    assert ram.read(0x380000, 0x800) == bytes(0x800)
    assert ram.read(0x380800, 1) == b"\xaa"


def test_elf_segment_in_second_region(ram: GuestMemory) -> None:
    k = load_elf(ram, elf([(PT_LOAD, HIGH, b"hi", 2)], entry=HIGH))
    assert ram.read(HIGH, 2) == b"hi" and k.end == HIGH + 2


def test_elf_segment_ending_exactly_at_ram_end(ram: GuestMemory) -> None:
    k = load_elf(ram, elf([(PT_LOAD, LOW_END - 4, b"tail", 4)], entry=LOW_END - 4))
    assert k.end == LOW_END
    assert ram.read(LOW_END - 4, 4) == b"tail"


def test_elf_larger_phentsize_honoured(ram: GuestMemory) -> None:
    image = elf([(PT_LOAD, 0x200000, b"one", 3), (PT_LOAD, 0x210000, b"two", 3)], 0x200000, phentsize=64)
    load_elf(ram, image)
    assert ram.read(0x200000, 3) == b"one" and ram.read(0x210000, 3) == b"two"


def test_load_kernel_dispatches_elf(ram: GuestMemory) -> None:
    k = load_kernel(ram, elf([(PT_LOAD, 0x200000, b"x", 1)], entry=0x200000))
    assert k.setup_header is None and k.entry == 0x200000


ELF_REJECTS = {
    "short-header": elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000)[:63],
    "32-bit": elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000, ei_class=1),
    "big-endian": elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000, ei_data=2),
    "aarch64": elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000, machine=183),
    "i386": elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000, machine=3),
    "phdrs-truncated": elf([(PT_LOAD, 0x200000, b"", 0)], 0x200000, truncate_to=64 + 40),
    "phnum-beyond-file": elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000, phnum=50),
    "segment-beyond-file": elf([(PT_LOAD, 0x200000, b"x" * 100, 100)], 0x200000, truncate_to=64 + 56 + 50),
    "filesz-above-memsz": elf([(PT_LOAD, 0x200000, b"x" * 16, 8)], 0x200000),
    "below-1mib": elf([(PT_LOAD, HIMEM_START - 0x1000, b"x", 1)], HIMEM_START),
    "at-zero": elf([(PT_LOAD, 0, b"x", 1)], HIMEM_START),
    "beyond-ram": elf([(PT_LOAD, BEYOND, b"x", 1)], 0x200000),
    "in-hole": elf([(PT_LOAD, IN_HOLE, b"x", 1)], 0x200000),
    "straddles-ram-end": elf([(PT_LOAD, LOW_END - 2, b"xxxx", 4)], 0x200000),
    "bss-past-ram-end": elf([(PT_LOAD, LOW_END - 16, b"x", 32)], 0x200000),
    "huge-memsz": elf([(PT_LOAD, 0x200000, b"x", 1 << 62)], 0x200000),
    "address-overflow": elf([(PT_LOAD, (1 << 64) - 2, b"xxxx", 4)], 0x200000),
    "no-pt-load": elf([(PT_NOTE, 0x200000, b"x", 1)], 0x200000),
    "no-segments": elf([], 0x200000),
    "entry-outside-ram": elf([(PT_LOAD, 0x200000, b"x", 1)], IN_HOLE),
    "entry-beyond-ram": elf([(PT_LOAD, 0x200000, b"x", 1)], 1 << 40),
}


@pytest.mark.parametrize("name", sorted(ELF_REJECTS))
def test_elf_rejects(ram: GuestMemory, name: str) -> None:
    with pytest.raises(KernelLoadError):
        load_elf(ram, ELF_REJECTS[name])


NOT_ELF = b"\x7fELG" + elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000)[4:]   # valid but for the magic


def test_load_kernel_rejects_bad_elf_magic(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):
        load_kernel(ram, NOT_ELF)
    assert ram.read(0x200000, 1) == b"\xaa"


def test_load_elf_itself_rejects_bad_magic(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError, match="magic"):
        load_elf(ram, NOT_ELF)
    assert ram.read(0x200000, 1) == b"\xaa"


def test_load_elf_rejects_a_bzimage(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):
        load_elf(ram, bzimage(PAYLOAD))


def test_elf_phentsize_below_56_rejected(ram: GuestMemory) -> None:
    image = bytearray(elf([(PT_LOAD, 0x200000, b"x", 1)], 0x200000))
    struct.pack_into("<H", image, 54, 32)   # e_phentsize
    with pytest.raises(KernelLoadError):
        load_elf(ram, bytes(image))


def test_elf_rejected_segment_below_1mib_writes_nothing(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):
        load_elf(ram, elf([(PT_LOAD, 0x1000, b"\x00" * 64, 64)], HIMEM_START))
    assert ram.read(0x1000, 64) == b"\xaa" * 64


def test_elf_straddling_segment_writes_nothing(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):
        load_elf(ram, elf([(PT_LOAD, LOW_END - 2, b"\x00" * 4, 4)], 0x200000))
    assert ram.read(LOW_END - 2, 2) == b"\xaa\xaa"


# ======================================================================================================
# loader.py: bzImage
# ======================================================================================================
XLF_KERNEL_64 = 1
JUMP = 0x6A      # offset byte at 0x201 in current kernels: the header ends at 0x26C


def bzimage(payload: bytes, *, setup_sects: int = 4, version: int = 0x020F, xloadflags: int = XLF_KERNEL_64,
            pref_address: int = 2 * MiB, init_size: int = 0, jump: int = JUMP) -> bytes:
    real_sects = setup_sects or 4
    img = bytearray(b"\xcc" * ((real_sects + 1) * 512))    # setup code filler
    img[0x1F1:0x202 + jump] = bytes(0x202 + jump - 0x1F1)
    img[0x1F1] = setup_sects
    struct.pack_into("<H", img, 0x1FE, 0xAA55)
    img[0x200:0x202] = bytes([0xEB, jump])
    img[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", img, 0x206, version)
    img[0x211] = 0x01                                       # LOADED_HIGH, as the kernel ships it
    struct.pack_into("<I", img, 0x22C, 0x7FFFFFFF)          # initrd_addr_max
    struct.pack_into("<I", img, 0x230, 0x200000)            # kernel_alignment
    img[0x234] = 1                                          # relocatable_kernel
    struct.pack_into("<H", img, 0x236, xloadflags)
    struct.pack_into("<I", img, 0x238, 2047)                # cmdline_size
    struct.pack_into("<Q", img, 0x258, pref_address)
    struct.pack_into("<I", img, 0x260, init_size)
    return bytes(img) + payload


PAYLOAD = bytes(range(256)) * 16 + b"END"


@pytest.fixture
def big_ram() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 32 * MiB)]) as m:
        yield m


def test_bzimage_payload_at_pref_address(ram: GuestMemory) -> None:
    k = load_bzimage(ram, bzimage(PAYLOAD, pref_address=2 * MiB, init_size=0x10000))
    assert ram.read(2 * MiB, len(PAYLOAD)) == PAYLOAD
    assert ram.read(2 * MiB - 1, 1) == b"\xaa"
    assert k.entry == 2 * MiB + 0x200             # 64-bit entry (boot.rst, "64-bit boot protocol")
    assert k.end == 2 * MiB + 0x10000             # init_size larger than the payload


def test_bzimage_end_uses_payload_when_larger_than_init_size(ram: GuestMemory) -> None:
    k = load_bzimage(ram, bzimage(PAYLOAD, pref_address=3 * MiB, init_size=16))
    assert k.end == 3 * MiB + len(PAYLOAD)


def test_bzimage_default_load_address(big_ram: GuestMemory) -> None:
    k = load_bzimage(big_ram, bzimage(PAYLOAD, pref_address=0))
    assert big_ram.read(16 * MiB, len(PAYLOAD)) == PAYLOAD
    assert k.entry == 16 * MiB + 0x200


@pytest.mark.parametrize(("setup_sects", "real"), [(0, 4), (1, 1), (4, 4), (27, 27)])
def test_bzimage_setup_sects(ram: GuestMemory, setup_sects: int, real: int) -> None:
    image = bzimage(PAYLOAD, setup_sects=setup_sects)
    assert len(image) == (real + 1) * 512 + len(PAYLOAD)
    load_bzimage(ram, image)
    assert ram.read(2 * MiB, len(PAYLOAD)) == PAYLOAD


def test_bzimage_setup_header_returned(ram: GuestMemory) -> None:
    image = bzimage(PAYLOAD)
    hdr = load_bzimage(ram, image).setup_header
    assert hdr is not None
    assert hdr[0] == 4                                  # setup_sects at 0x1f1
    assert hdr[0x202 - 0x1F1:0x206 - 0x1F1] == b"HdrS"
    assert hdr == image[0x1F1:0x1F1 + len(hdr)]
    assert u32(hdr, 0x22C - 0x1F1) == 0x7FFFFFFF


@pytest.mark.parametrize("jump", [0x62, JUMP, 0x7E])
def test_bzimage_setup_header_ends_where_boot_rst_says(ram: GuestMemory, jump: int) -> None:
    image = bzimage(PAYLOAD, jump=jump)
    hdr = load_bzimage(ram, image).setup_header
    assert hdr is not None
    assert len(hdr) == 0x202 + jump - 0x1F1            # boot.rst: the header ends at 0x202 + byte 0x201
    assert b"\xcc" not in hdr                           # no setup code after the header leaks in


def test_bzimage_header_ending_before_init_size_rejected(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError, match="setup header ends"):
        load_bzimage(ram, bzimage(PAYLOAD, jump=0x5E))  # ends at 0x260: no room for init_size


def test_bzimage_minimum_protocol_accepted(ram: GuestMemory) -> None:
    k = load_bzimage(ram, bzimage(PAYLOAD, version=0x020C))   # 2.12: xloadflags
    assert k.entry == 2 * MiB + 0x200


# pref_address/init_size exist from 2.10 and xloadflags (XLF_KERNEL_64) from 2.12 (boot.rst).
@pytest.mark.parametrize("version", [0x0000, 0x0200, 0x0205, 0x0206, 0x0209, 0x020A, 0x020B])
def test_bzimage_old_protocol_rejected(ram: GuestMemory, version: int) -> None:
    with pytest.raises(KernelLoadError, match=r"older than 2\.12.*xloadflags"):
        load_bzimage(ram, bzimage(PAYLOAD, version=version))
    assert ram.read(2 * MiB, 4) == b"\xaa" * 4


@pytest.mark.parametrize("xloadflags", [0, 0x2, 0x1E])
def test_bzimage_without_64bit_entry_rejected(ram: GuestMemory, xloadflags: int) -> None:
    with pytest.raises(KernelLoadError, match="XLF_KERNEL_64"):
        load_bzimage(ram, bzimage(PAYLOAD, xloadflags=xloadflags))
    assert ram.read(2 * MiB, 4) == b"\xaa" * 4


def test_bzimage_without_payload_rejected(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):
        load_bzimage(ram, bzimage(b""))


@pytest.mark.parametrize(("pref", "init_size"), [
    (LOW_END - 16, 0),              # payload straddles the end of the low region
    (IN_HOLE, 0),                   # in the hole
    (BEYOND, 0),                    # beyond RAM
    (HIGH - 4096, 0),               # straddles into the second region from the hole
    (3 * MiB, 2 * MiB),             # payload fits, init_size does not
    ((1 << 64) - 0x100, 0),         # address overflow
])
def test_bzimage_not_fitting_rejected(ram: GuestMemory, pref: int, init_size: int) -> None:
    with pytest.raises(KernelLoadError):
        load_bzimage(ram, bzimage(PAYLOAD, pref_address=pref, init_size=init_size))


def test_bzimage_default_address_beyond_small_ram(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):   # pref_address 0 means 16 MiB, beyond this guest's RAM
        load_bzimage(ram, bzimage(PAYLOAD, pref_address=0))


def test_load_kernel_dispatches_bzimage(ram: GuestMemory) -> None:
    k = load_kernel(ram, bzimage(PAYLOAD))
    assert k.setup_header is not None and k.entry == 2 * MiB + 0x200


@pytest.mark.parametrize("image", [b"", b"MZ", b"\0" * 0x1000, b"\x7fEL",
                                   bytes(0x202) + b"HdrS"])   # signature but nothing after it
def test_load_kernel_rejects_unknown_formats(ram: GuestMemory, image: bytes) -> None:
    with pytest.raises(KernelLoadError):
        load_kernel(ram, image)


def test_truncated_bzimage_rejected_with_kernel_load_error(ram: GuestMemory) -> None:
    with pytest.raises(KernelLoadError):
        load_kernel(ram, bzimage(PAYLOAD)[:0x220])


# Cut inside/just before each field read: version 0x206, xloadflags 0x236, pref_address 0x258,
# init_size 0x260, the end of the header, and inside the setup sectors.
TRUNCATIONS = [0x206, 0x207, 0x208, 0x220, 0x236, 0x237, 0x258, 0x25F, 0x260, 0x263, 0x26C, 0x400,
               5 * 512 - 1]


@pytest.mark.parametrize("length", TRUNCATIONS, ids=hex)
@pytest.mark.parametrize("loader", [load_kernel, load_bzimage])
def test_truncated_bzimage_never_raises_struct_or_index_error(
        ram: GuestMemory, length: int, loader: Callable[[GuestMemory, bytes], LoadedKernel]) -> None:
    with pytest.raises(KernelLoadError):
        loader(ram, bzimage(PAYLOAD)[:length])
    assert ram.read(2 * MiB, 4) == b"\xaa" * 4


def test_bzimage_shorter_than_its_setup_sectors_rejected(ram: GuestMemory) -> None:
    image = bzimage(PAYLOAD, setup_sects=27)[:20 * 512]    # header intact, setup code cut short
    with pytest.raises(KernelLoadError, match="setup sectors"):
        load_bzimage(ram, image)
    assert ram.read(2 * MiB, 4) == b"\xaa" * 4


@pytest.mark.parametrize("image", [b"", b"\x7fELF", bytes(0x300), b"\x7fELF" + bytes(0x300),
                                   bzimage(PAYLOAD)[:0x202] + b"HdrZ" + bzimage(PAYLOAD)[0x206:]])
def test_load_bzimage_itself_rejects_missing_hdrs(ram: GuestMemory, image: bytes) -> None:
    with pytest.raises(KernelLoadError, match="HdrS"):
        load_bzimage(ram, image)


# ======================================================================================================
# params.py: the zero page
# ======================================================================================================
ELF_KERNEL = LoadedKernel(entry=0x1000000, end=0x2000000, setup_header=None)
E820 = RamLayout.for_size(256 * MiB).e820()

# zero-page.rst / boot.rst offsets, written out independently of params.py.
EXT_RAMDISK_IMAGE, EXT_RAMDISK_SIZE, EXT_CMD_LINE_PTR = 0x0C0, 0x0C4, 0x0C8
E820_ENTRIES, E820_TABLE = 0x1E8, 0x2D0
SETUP_SECTS, BOOT_FLAG, HEADER, VERSION = 0x1F1, 0x1FE, 0x202, 0x206
TYPE_OF_LOADER, LOADFLAGS = 0x210, 0x211
RAMDISK_IMAGE, RAMDISK_SIZE, HEAP_END_PTR, CMD_LINE_PTR = 0x218, 0x21C, 0x224, 0x228
INITRD_ADDR_MAX, KERNEL_ALIGNMENT, XLOADFLAGS, CMDLINE_SIZE = 0x22C, 0x230, 0x236, 0x238
PREF_ADDRESS, INIT_SIZE = 0x258, 0x260
LOADED_HIGH, CAN_USE_HEAP = 0x01, 0x80


def zero_page(kernel: LoadedKernel = ELF_KERNEL, *, cmdline_addr: int = CMDLINE_ADDR, cmdline_len: int = 42,
              e820: list[tuple[int, int, int]] | None = None,
              initrd: tuple[int, int] | None = None) -> bytes:
    return build_boot_params(kernel, cmdline_addr=cmdline_addr, cmdline_len=cmdline_len,
                             e820=E820 if e820 is None else e820, initrd=initrd)


def test_zero_page_is_one_page() -> None:
    assert len(zero_page()) == 4096
    assert len(zero_page(initrd=(64 * MiB, MiB))) == 4096


def test_elf_kernel_gets_a_synthesised_header() -> None:
    zp = zero_page()
    assert u16(zp, BOOT_FLAG) == 0xAA55
    assert zp[HEADER:HEADER + 4] == b"HdrS"
    assert u16(zp, VERSION) >= 0x020C         # 2.12+: ext_* fields and xloadflags are meaningful
    assert u32(zp, INITRD_ADDR_MAX) == initrd_addr_max(ELF_KERNEL)
    assert u32(zp, KERNEL_ALIGNMENT) != 0


def test_loader_fields() -> None:
    zp = zero_page(cmdline_len=123)
    assert zp[TYPE_OF_LOADER] == 0xFF
    assert zp[LOADFLAGS] & LOADED_HIGH and zp[LOADFLAGS] & CAN_USE_HEAP
    assert u16(zp, HEAP_END_PTR) == 0xFE00
    assert u32(zp, CMD_LINE_PTR) == CMDLINE_ADDR
    assert u32(zp, EXT_CMD_LINE_PTR) == 0
    assert u32(zp, CMDLINE_SIZE) == 123


def test_cmdline_above_4gib_uses_ext_cmd_line_ptr() -> None:
    zp = zero_page(cmdline_addr=5 * GiB + 0x1000)
    assert u32(zp, CMD_LINE_PTR) == (GiB + 0x1000)
    assert u32(zp, EXT_CMD_LINE_PTR) == 1


def test_no_initrd_leaves_ramdisk_fields_zero() -> None:
    zp = zero_page()
    for off in (RAMDISK_IMAGE, RAMDISK_SIZE, EXT_RAMDISK_IMAGE, EXT_RAMDISK_SIZE):
        assert u32(zp, off) == 0


def test_initrd_below_4gib() -> None:
    zp = zero_page(initrd=(0x7F00000, 0x123456))
    assert u32(zp, RAMDISK_IMAGE) == 0x7F00000
    assert u32(zp, RAMDISK_SIZE) == 0x123456
    assert u32(zp, EXT_RAMDISK_IMAGE) == 0 and u32(zp, EXT_RAMDISK_SIZE) == 0


def test_initrd_above_4gib_split_into_ext_fields() -> None:
    addr, size = 6 * GiB + 0x3000, 5 * GiB + 0x10
    zp = zero_page(initrd=(addr, size))
    assert u32(zp, RAMDISK_IMAGE) | u32(zp, EXT_RAMDISK_IMAGE) << 32 == addr
    assert u32(zp, RAMDISK_SIZE) | u32(zp, EXT_RAMDISK_SIZE) << 32 == size
    assert u32(zp, EXT_RAMDISK_IMAGE) == 1 and u32(zp, EXT_RAMDISK_SIZE) == 1


def test_e820_table_layout() -> None:
    e820 = [(0, 0x9FC00, 1), (0x9FC00, 0x60400, 2), (0x100000, 0x7F00000, 1), (4 * GiB, 2 * GiB, 1),
            (0xDEAD0000, 0x1000, 4)]
    zp = zero_page(e820=e820)
    assert zp[E820_ENTRIES] == len(e820)
    for i, entry in enumerate(e820):
        assert struct.unpack_from("<QQI", zp, E820_TABLE + 20 * i) == entry
    assert zp[E820_TABLE + 20 * len(e820):E820_TABLE + 20 * len(e820) + 20] == bytes(20)


def test_e820_128_entries_fit_exactly() -> None:
    e820 = [(i * 0x10000, 0x10000, 1 + i % 2) for i in range(128)]
    zp = zero_page(e820=e820)
    assert zp[E820_ENTRIES] == 128
    assert struct.unpack_from("<QQI", zp, E820_TABLE + 20 * 127) == e820[127]
    assert E820_TABLE + 20 * 128 <= 0xCD0 <= len(zp)       # the table ends before eddbuf


def test_too_many_e820_entries_rejected() -> None:
    with pytest.raises(BootParamsError):
        zero_page(e820=[(i * 0x10000, 0x10000, 1) for i in range(129)])
    assert issubclass(BootParamsError, ValueError)


def test_nothing_else_is_written_for_an_elf_kernel() -> None:
    zp = bytearray(zero_page(cmdline_len=7, initrd=(0x7000000, 0x1000)))
    e820_end = E820_TABLE + 20 * len(E820)
    owned = [(EXT_RAMDISK_IMAGE, 12), (E820_ENTRIES, 1), (E820_TABLE, e820_end - E820_TABLE),
             (BOOT_FLAG, 2), (HEADER, 4), (VERSION, 2), (TYPE_OF_LOADER, 2), (RAMDISK_IMAGE, 8),
             (HEAP_END_PTR, 2), (CMD_LINE_PTR, 4), (INITRD_ADDR_MAX, 4), (KERNEL_ALIGNMENT, 4),
             (CMDLINE_SIZE, 4)]
    for off, n in owned:
        zp[off:off + n] = bytes(n)
    assert zp == bytes(4096)


def test_bzimage_header_copied_and_loader_fields_overlaid(ram: GuestMemory) -> None:
    image = bzimage(PAYLOAD, pref_address=2 * MiB, init_size=0x8000)
    k = load_bzimage(ram, image)
    zp = zero_page(k, cmdline_len=99, initrd=(0x7000000, 0x2000))
    # Kernel-provided fields come through unchanged.
    for off, n in [(SETUP_SECTS, 1), (BOOT_FLAG, 2), (HEADER, 4), (VERSION, 2), (INITRD_ADDR_MAX, 4),
                   (KERNEL_ALIGNMENT, 4), (0x234, 1), (XLOADFLAGS, 2), (PREF_ADDRESS, 8), (INIT_SIZE, 4)]:
        assert zp[off:off + n] == image[off:off + n], hex(off)
    # Loader-written fields are ours; loadflags keeps the kernel's bits and adds ours.
    assert zp[TYPE_OF_LOADER] == 0xFF
    assert zp[LOADFLAGS] == image[LOADFLAGS] | LOADED_HIGH | CAN_USE_HEAP
    assert u32(zp, CMD_LINE_PTR) == CMDLINE_ADDR
    assert u32(zp, RAMDISK_IMAGE) == 0x7000000 and u32(zp, RAMDISK_SIZE) == 0x2000
    assert u16(zp, HEAP_END_PTR) == 0xFE00
    assert zp[E820_ENTRIES] == len(E820)
    assert initrd_addr_max(k) == 0x7FFFFFFF


def test_initrd_addr_max_default_for_elf() -> None:
    assert initrd_addr_max(ELF_KERNEL) == 0x37FFFFFF
    short = LoadedKernel(entry=0, end=0, setup_header=bytes(0x10))    # header too short to hold the field
    assert initrd_addr_max(short) == 0x37FFFFFF
